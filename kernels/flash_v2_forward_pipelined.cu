// flash_v2_forward_pipelined.cu: FlashAttention-2 forward, version "pipelined" (fp16 / bf16 in, fp32 accumulate).
// Paper: Dao, "FlashAttention-2" (arXiv 2307.08691), Algorithm 1, work split of Section 3.3: one block per
// (Q tile i, head), looping over K/V tiles j; warp w owns rows 16 MT w .. 16 MT (w + 1) - 1 of Q_i, so a warp's
// softmax is its own. What changed from version "tc", and why each is faster:
//   * K_j, V_j double-buffered with cp.async: tile j + 1 is in flight while tile j is computed;
//   * shared rows padded by 16 bytes: the 8 rows of one ldmatrix phase fall in 8 different bank groups;
//   * softmax in base 2 with log2(e) folded into the scale: one FMUL, FADD and MUFU.EX2 per score;
//   * two m-tiles per warp where they fit (d <= 128: Br = 128, 4 warps x 32 rows): every K/V fragment read from
//     shared memory feeds two mma. d = 256 takes 8 warps x 16 rows, and the fallbacks Br = 64 (tc.CANDIDATES);
//   * the tile body compiled twice, masked and plain: the plain copy has no branch from S_ij to P~_ij V_j;
//   * SKIP: the rescale of O_i by alpha is skipped when no row of an m-tile changed its max (alpha = 1 exactly);
//   * causal: only tiles crossing the diagonal are masked; the longest Q tiles are launched first.
// Units. The stage README's pseudocode is in natural units (S_ij = scale Q_i K_j^T, P~_ij = exp(S_ij - m_i)). Here
// the mma gives s = Q_i K_j^T unscaled (a Score hook may scale it: ModScore) and the scale enters the exponent through
// exp2_scale = scale log2(e) (log2(e) after ModScore). So m_i is the running max of s exp2_scale, the README's m_i
// times log2(e); P~_ij = exp2(s exp2_scale - m_i), the same number; the rescale is alpha = 2^(m_old - m_new); and
// L_i = m_i ln 2 + log l_i (row_lse), not m_i + log l_i.
// Names: lane = 4 g + t; the 4 lanes of one g are a quad, and together hold rows g and g + 8 of each m-tile.
// Where the rest is: the hooks of the variants (window, packed batches, softcap, ALiBi, dropout) in
// kernels/variants.cuh; the tile bookkeeping this loop calls (tile_and_head, init_row_state, row_max,
// inverse_row_sum, row_lse, merge_row_into_running, visited_kv_tiles) in kernels/attention_tiles.cuh, which
// variants.cuh includes; fragment layouts, ldmatrix, mma and cp.async in kernels/common.cuh; the tiles per head dim
// in stages/02_flash_v2/tc.py.
// Run: python stages/02_flash_v2/run.py --version pipelined   (tests: pytest tests/test_02_flash_v2.py)
#include "variants.cuh"

// The tiles of one instantiation: head dim D, Bc keys per K/V tile computed in slices of SUB keys (SUB = Bc in every
// configuration today: tc.CANDIDATES), NWARPS warps of MT m-tiles (Br = 16 MT NWARPS rows of Q_i), MINB blocks per
// SM the registers must allow, SKIP (above).
template <int D_, int BC_, int NWARPS_, int MT_, int SUB_, int MINB_, bool SKIP_>
struct FwdTiles {
    static constexpr int D = D_, BC = BC_, NWARPS = NWARPS_, MT = MT_, SUB = SUB_, MINB = MINB_;
    static constexpr bool SKIP = SKIP_;
    static constexpr int BR = 16 * MT * NWARPS;  // rows of Q_i
};

// Algorithm 1 for one (Q tile i, head). T: __half or __nv_bfloat16; TO: o's type (T, or float for a ring block,
// which merges into the running (O, L) it is given: see the epilogue). Shared memory: (Br + 4 Bc) (D + 8) elements
// of 2 bytes (tc.smem_bytes). Grouped-query attention in every instantiation: query head h reads k/v head h / group.
// __launch_bounds__(threads, MINB): the block size, and MINB blocks must fit on one SM, which caps the registers a
// thread may take at 65536 / (MINB threads). __grid_constant__: p stays in the kernel's parameter (constant) memory,
// and references to it (the hooks keep one) read it there: no thread copies the struct into its local memory.
template <typename T, typename TO, typename Tiles, typename Mask, typename Score, typename Drop>
__global__ void __launch_bounds__(Tiles::NWARPS * 32, Tiles::MINB)
flash_v2_forward_pipelined(const __grid_constant__ FwdParams p) {
    constexpr int D = Tiles::D, BC = Tiles::BC, NWARPS = Tiles::NWARPS, MT = Tiles::MT, SUB = Tiles::SUB;
    constexpr bool SKIP = Tiles::SKIP;
    constexpr int BR = Tiles::BR;         // Br: rows of Q_i
    constexpr int NT = NWARPS * 32;       // threads
    constexpr int LD = D + 8;             // padded row (elements): +16 B puts consecutive rows in new banks
    constexpr int CH = D / 8;             // 16-byte chunks per row
    static_assert(BC % SUB == 0 && SUB % 16 == 0, "slices of SUB keys must tile Bc");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);  // [BR][LD]
    T* Ks = Qs + BR * LD;                    // [2][BC][LD]  double buffer
    T* Vs = Ks + 2 * BC * LD;                // [2][BC][LD]  double buffer
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group g (a quad), thread-in-group t
    int i;  // Q tile
    long bh;  // (batch, head)
    tile_and_head<BR>(p.head_group, p.Nq, i, bh);
    // this head's rows (16-bit O is always a whole problem; float O may be a ring block inside larger arrays)
    const HeadRows rows = head_rows<Mask::packed>(p, bh, sizeof(TO) == sizeof(T));
    const int Nq = rows.Nq, Nk = rows.Nk;
    const long q_row0 = rows.q0;
    if (i * BR >= Nq) return;  // a packed batch's block past its sequence's last Q tile (before any barrier)
    const T* q = static_cast<const T*>(p.q);
    const T* kh = static_cast<const T*>(p.k) + rows.kv0 * D;
    const T* vh = static_cast<const T*>(p.v) + rows.kv0 * D;
    TO* o = static_cast<TO*>(p.o);
    float* lse = p.lse;
    const int row0 = i * BR;  // first row of Q_i
    const int last_row = min(row0 + BR, Nq) - 1;
    const Mask mask(p, Nq, Nk);  // the hooks (kernels/variants.cuh)
    const Score score(p, rows.hd, Nk - Nq);
    const Drop drop(p, rows.hd);
    const int2 jr = mask.template kv_tiles<BR, BC>(row0, Nq);  // K/V tiles j_first <= j < n_tiles (Alg.1 L6)
    const int j_first = jr.x, n_tiles = jr.y;  // n_tiles: the end of the range, not a count (a window: j_first > 0)
    const float exp2_scale = p.exp2_scale;  // scale log2(e), or log2(e) after ModScore (kernels/params.cuh)

    // cp.async a [rows][D] tile (rows r0.. of a [n][D] matrix) into padded shared memory, 16 bytes per thread per
    // step; rows >= n are zero-filled (masked out of S; zeros keep P V free of NaN). Thread tid copies chunk
    // tid % CHP of rows tid / CHP + RS * it: its addresses are one base plus constant offsets. Shared addresses
    // (u32, from smem_u32) count bytes, so element offsets are multiplied by 2 (sizeof(T)) here and below.
    constexpr int CHP = CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;  // chunks per row, a power of 2 (D = 96: 16)
    constexpr int RS = NT / CHP;                                          // rows covered by one pass of all threads
    static_assert(D % 16 == 0 && D <= 256 && BR % RS == 0 && BC % RS == 0, "a pass must cover whole rows");
    const int lr = tid / CHP, lc = (tid % CHP) * 8;
    auto load_tile = [&](T* dst, const T* src, int r0, int rows, int n) {
        const T* s0 = src + (long)(r0 + lr) * D + lc;
        const u32 d0 = smem_u32(dst + lr * LD + lc);
        if (CHP != CH && lc >= D) return;  // D = 96: the last quarter of the threads idles
        if (r0 + rows <= n) {  // the whole tile exists (all tiles but a ragged last one): base + constant offsets
#pragma unroll
            for (int it = 0; it < rows / RS; ++it) cp_async_16_u32(d0 + it * RS * LD * 2, s0 + it * RS * D);
            return;
        }
#pragma unroll
        for (int it = 0; it < rows / RS; ++it) {  // rows is a constant here: unrolled
            const bool ok = r0 + lr + it * RS < n;
            cp_async_16_u32(d0 + it * RS * LD * 2, ok ? s0 + it * RS * D : src, ok);
        }
    };

    // Alg.1 L4: load Q_i; Alg.1 L7 for the first tile, j = j_first: load K_j, V_j. One cp.async group.
    load_tile(Qs, q + q_row0 * D, row0, BR, Nq);
    if (n_tiles > j_first) {
        load_tile(Ks, kh, j_first * BC, BC, Nk);
        load_tile(Vs, vh, j_first * BC, BC, Nk);
    }
    cp_async_commit();

    // Alg.1 L5: O_i = 0, l_i = 0, m_i = -inf. m-tile m of a thread holds rows g (h = 0) and g + 8 (h = 1).
    float acc_o[MT][D / 8][4];
    float m_i[MT][2], l_i[MT][2];  // running max of s exp2_scale (base 2: header); this lane's part of the row sum
    init_row_state<MT, D>(acc_o, m_i, l_i);

    const int wrow = warp * 16 * MT;  // this warp's first row inside Q_i
    // Each lane's ldmatrix row address (shared space, bytes) inside a 16 x 16 block; lanes 8q..8q+7 address
    // 8x8 tile q, which lands in register q of the fragment (common.cuh; notebook 02 draws and checks these):
    //   Q (A operand):          tiles (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (0-7, 8-15), (8-15, 8-15)
    //   K (B operand of S):     tiles (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (8-15, 8-15):
    //                           b[0..1] of the n-tile of keys 0-7, b[2..3] of keys 8-15
    //   V (B of P V, .trans):   tiles (keys 0-7, d 0-7), (keys 8-15, d 0-7), (0-7, d 8-15), (8-15, d 8-15):
    //                           b[0..1] of the n-tile of d 0-7, b[2..3] of d 8-15
    // Lane 4g + t gets row g, columns 2t, 2t+1 of a tile (with .trans: rows 2t, 2t+1 of column g), and a B register
    // holds two values adjacent in k: for S = Q K^T k is d, two columns of a K_j row; for P V k is the key, two rows.
    const u32 q_base = smem_u32(Qs + (wrow + lane % 16) * LD + (lane / 16) * 8);  // only this warp reads its rows
    const u32 k_base = smem_u32(Ks + (lane % 8 + (lane / 16) * 8) * LD + ((lane / 8) % 2) * 8);
    const u32 v_base = smem_u32(Vs + (lane % 16) * LD + (lane / 16) * 8);
    for (int j = j_first; j < n_tiles; ++j) {  // Alg.1 L6: loop over K/V tiles
        const int buf = (j - j_first) & 1;
        cp_async_wait<0>();  // this thread's copies of K_j, V_j (and Q_i) have landed ...
        __syncthreads();     // ... everyone's too; and every warp has finished tile j-1, so buffer buf^1 is free
        if (j + 1 < n_tiles) {  // prefetch K_{j+1}, V_{j+1} into the other buffer while tile j is computed
            load_tile(Ks + (buf ^ 1) * BC * LD, kh, (j + 1) * BC, BC, Nk);
            load_tile(Vs + (buf ^ 1) * BC * LD, vh, (j + 1) * BC, BC, Nk);
            cp_async_commit();
        }
        // The tile is computed in slices of SUB keys (SUB = Bc in every configuration today): S of one slice,
        // 16*MT x SUB fp32 per warp, lives in registers beside O_i's 16*MT x D accumulators. Two copies of the
        // body: MASKED (the ragged last tile, tiles crossing the causal diagonal) and the plain one, which has no
        // branch from S_ij to P~_ij V_j, so the compiler may interleave one m-tile's softmax with the other's mma.
        auto tile = [&](const bool MASKED) {  // called with a constant: each call inlines its own copy
#pragma unroll
            for (int sb = 0; sb < BC / SUB; ++sb) {
                const u32 kj = k_base + (buf * BC + sb * SUB) * LD * 2;  // K_j rows sb*SUB.., buffer buf (bytes)
                const u32 vj = v_base + (buf * BC + sb * SUB) * LD * 2;
                const int col0 = j * BC + sb * SUB;  // first key of this slice
                if (MASKED && mask.slice_hidden(col0, SUB, row0 + wrow, row0 + wrow + 16 * MT - 1))
                    continue;  // no row of this warp sees a key of the slice
                // Alg.1 L8, unscaled: s = Q_i K_j^T (16*MT x SUB per warp), fp32 accumulators in C fragment layout.
                float s[MT][SUB / 8][4];
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int n = 0; n < SUB / 8; ++n) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    u32 qa[MT][4];  // A fragments of Q_i: rows 16m.., cols 16kk..16kk+15 (re-read: registers for O, S)
#pragma unroll
                    for (int m = 0; m < MT; ++m) ldsm_x4(qa[m], q_base + ((m * 16) * LD + kk * 16) * 2);
#pragma unroll
                    for (int n = 0; n < SUB / 16; ++n) {  // K rows 16n..16n+15: two n-tiles of 8 keys, MT m-tiles
                        u32 b[4];
                        ldsm_x4(b, kj + ((n * 16) * LD + kk * 16) * 2);
#pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            mma_16816<T>(s[m][2 * n], qa[m], b);
                            mma_16816<T>(s[m][2 * n + 1], qa[m], b + 2);
                        }
                    }
                }
                // The hooks: the score (identity for plain attention), then the mask, which only slices holding Nk's
                // tail or crossing this warp's diagonal pay for.
                score.template apply<MT, SUB>(s, row0 + wrow, col0, g, t);
                if (MASKED && mask.slice_masked(col0, SUB, row0 + wrow))
                    mask.template apply<MT, SUB>(s, row0 + wrow, col0, g, t);
                // Alg.1 L9: m_new = max(m_i, rowmax S_ij), P~_ij = exp(S_ij - m_new), l_i = e^(m_i - m_new) l_i +
                // rowsum P~_ij, in base 2 (header): P~_ij = exp2(s exp2_scale - m_new), alpha = 2^(m_i - m_new).
                // __fmul_rn keeps the product out of an FFMA, so the row max gives exactly exp2(0) = 1. These are
                // online_softmax_fp32's steps (attention_tiles.cuh, the fp32x3 kernels), inline here for SKIP's vote
                // (both rows' alpha before the rescale) and an l_i update the compiler may fuse into one FFMA.
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    float m_use[2], alpha[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {  // h = 0: row g (fragment entries 0,1); h = 1: row g+8 (entries 2,3)
                        const float mx = row_max<SUB>(s[m], h);  // rowmax of row g + 8 h (raw s), over the quad
                        const float m_new = fmaxf(m_i[m][h], mx * exp2_scale);
                        m_use[h] = MASKED && m_new == -INF ? 0.f : m_new;  // a row with nothing visible yet: P = 0
                        alpha[h] = fast_exp2(m_i[m][h] - m_use[h]);  // 2^(m_i - m_new): 0 when m_i = -inf
                        m_i[m][h] = m_new;
                    }
                    // Alg.1 L10 (first half): O_i = diag(alpha) O_i (normalisation deferred to the end). SKIP: alpha
                    // = 1 exactly when a row's max did not change (exp2(0)); when none of the warp's 16 rows of this
                    // m-tile changed, the warp skips the D / 2 multiplies by 1 (same bits, fewer instructions). The
                    // vote __any_sync(mask, x) gives every lane the same answer: x holds on some lane of the mask.
                    if (!SKIP || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
                        for (int d = 0; d < D / 8; ++d) {
                            acc_o[m][d][0] *= alpha[0], acc_o[m][d][1] *= alpha[0];
                            acc_o[m][d][2] *= alpha[1], acc_o[m][d][3] *= alpha[1];
                        }
                    }
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        float rs = 0.f;
#pragma unroll
                        for (int n = 0; n < SUB / 8; ++n) {
                            s[m][n][2 * h] = fast_exp2(__fmul_rn(s[m][n][2 * h], exp2_scale) - m_use[h]);
                            s[m][n][2 * h + 1] = fast_exp2(__fmul_rn(s[m][n][2 * h + 1], exp2_scale) - m_use[h]);
                            rs += s[m][n][2 * h] + s[m][n][2 * h + 1];
                        }
                        l_i[m][h] = l_i[m][h] * alpha[h] + rs;  // the quad's 4 parts add up at the end: inverse_row_sum
                    }
                }
                drop.template apply<MT, SUB>(s, row0 + wrow, col0, g, t);  // dropout hook: P~_ij Z_ij
                // Alg.1 L10 (second half): O_i += P~_ij V_j.
#pragma unroll
                for (int kk = 0; kk < SUB / 16; ++kk) {  // keys 16kk..16kk+15
                    // The C fragments of n-tiles 2kk, 2kk+1 ARE the A fragment of P for k-step kk (rounded to T).
                    u32 pa[MT][4];
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        c_to_a<T>(pa[m], 2 * kk, s[m][2 * kk]);
                        c_to_a<T>(pa[m], 2 * kk + 1, s[m][2 * kk + 1]);
                    }
#pragma unroll
                    for (int d = 0; d < D / 16; ++d) {  // V rows 16kk.., cols 16d..16d+15, transposed into B fragments
                        u32 b[4];
                        ldsm_x4_trans(b, vj + ((kk * 16) * LD + d * 16) * 2);
#pragma unroll
                        for (int m = 0; m < MT; ++m) {
                            mma_16816<T>(acc_o[m][2 * d], pa[m], b);
                            mma_16816<T>(acc_o[m][2 * d + 1], pa[m], b + 2);
                        }
                    }
                }
            }
        };
        // Block-uniform: does the tile hold a key some row of Q_i does not see?
        if (mask.template tile_masked<BC>(j, row0, last_row))
            tile(true);
        else
            tile(false);
    }
    cp_async_wait<0>();  // with no K/V tile at all (causal, fully masked Q_i) the Q_i copy may still be landing:
    __syncthreads();     // ... every thread's copy is done before this warp's Q rows are reused for O below

    // Alg.1 L12-15: O_i = diag(l_i)^-1 O_i, L_i = m_i ln 2 + log(l_i) (m_i in base 2: row_lse). 16-bit O: staged
    // through this warp's own rows of Qs, then 16-byte coalesced stores. float O (a ring block): merged into the
    // running (O, L) it is given.
    constexpr bool STAGE_O = sizeof(TO) == sizeof(T);
    T* Ow = Qs + wrow * LD;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l;
            // fully masked row: O = 0; dropout: the kept probabilities' 1 / (1 - p), once (rp = 1 without dropout)
            const float inv_l = inverse_row_sum(l_i[m][h], l) * drop.rp();
            const int rl = m * 16 + g + 8 * h;    // row inside the warp's rows
            const long row = q_row0 + row0 + wrow + rl;  // its row of o and lse
            const bool valid = row0 + wrow + rl < Nq;
            if constexpr (STAGE_O) {
                if (t == 0 && valid) lse[row] = row_lse(m_i[m][h], l);
#pragma unroll
                for (int d = 0; d < D / 8; ++d)
                    store2(Ow + rl * LD + d * 8 + 2 * t, acc_o[m][d][2 * h] * inv_l, acc_o[m][d][2 * h + 1] * inv_l);
            } else {
                merge_row_into_running<D>(reinterpret_cast<float*>(o) + row * D, lse + row, acc_o[m], h, inv_l,
                                          m_i[m][h], l, valid, lane);
            }
        }
    if constexpr (!STAGE_O) return;
    __syncwarp();  // the warp's rows of O are in shared memory before its lanes read other lanes' parts
    for (int c = lane; c < 16 * MT * CH; c += 32) {
        const int r = c / CH, ch = c % CH;
        if (row0 + wrow + r < Nq)
            *reinterpret_cast<uint4*>(o + (q_row0 + row0 + wrow + r) * D + ch * 8) =
                *reinterpret_cast<const uint4*>(Ow + r * LD + ch * 8);
    }
}
