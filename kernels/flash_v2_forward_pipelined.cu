// flash_v2_forward_pipelined.cu: FlashAttention-2 forward, version 3 "pipelined" (fp16 / bf16 in, fp32 accumulate).
//
// Paper: Dao, "FlashAttention-2" (arXiv 2307.08691), Algorithm 1 (forward), Section 3.3 (work partitioning).
// Versions of stage 02 (all runnable: python stages/02_flash_v2/run.py --version fp32|tc|pipelined|fp32x3):
//   1 fp32       flash_v2_forward_fp32.cu: CUDA cores, one block per Q tile, warps split Q_i's rows.
//   2 tc         flash_v2_forward_tc.cu: mma.sync m16n8k16 + ldmatrix, K_j/V_j loaded synchronously.
//   3 pipelined  THIS FILE. What changed from version 2, and why each change is faster:
//      * K_j, V_j double-buffered with cp.async: tile j+1 is in flight while tile j is computed (memory latency
//        hidden behind the mma), and one __syncthreads per K/V tile instead of two;
//      * every shared row padded by 16 bytes, so the 8 rows of one ldmatrix phase hit 8 different bank
//        groups: no bank conflicts at any head dim;
//      * softmax in base 2: exp(scale * s - m) = exp2(s * scale*log2(e) - m'): FMUL, FADD, one MUFU.EX2 (no
//        natural-exp range reduction); the FMUL is not fused with the FADD so the row max gives exactly 1;
//      * each warp owns MT = 2 m-tiles (32 rows of Q_i; Br = 128 with 4 warps, FA2's own layout): every K/V
//        fragment read from shared memory feeds two mma instead of one, halving shared-memory traffic per FLOP;
//      * tiles per head dim (stages/02_flash_v2/tc.py CANDIDATES): S (32 x Bc) and O_i (32 x d) of a warp share
//        one thread's registers, which is what bounds Bc as d grows (d = 256: one m-tile per warp, O_i alone
//        is 128 registers a thread);
//      * 32-bit shared addresses: each lane computes one base per operand, fragments are base + constant
//        (fewer registers and address instructions than 64-bit generic pointers);
//      * a K/V tile with no row past Nk (all but a ragged last one) is copied without per-row checks: one base
//        plus constant offsets instead of a bounds test and an address select per row;
//      * the tile body is compiled twice, masked and plain; the plain copy has no branch from S_ij to P_ij V_j,
//        so the compiler can interleave the exponentials of one m-tile with the P V mma of the other;
//      * SKIP (d = 128): the rescale of O_i by alpha is skipped when alpha = 1 for all 16 rows of an m-tile
//        (no new row max: bitwise the same result, d / 2 fewer multiplies per row); at smaller head dims the
//        vote and branch cost more than the multiplies they save, so it is off there;
//      * causal: masking only on tiles crossing the diagonal (and per warp: a warp skips key slices none of its
//        rows sees), longest Q tiles launched first inside groups of heads (no long block left for the tail).
//   4 fp32x3     flash_v2_forward_fp32x3.cu: float32 on TF32 tensor cores (3xTF32 split), this file's structure.
//
// Work split (FA2 Sec. 3.3): one block per (Q tile i, head), looping over K/V tiles j.
// Warp w owns rows 16*MT*w .. 16*MT*(w+1)-1 of Q_i: a warp's softmax is its own, no block-wide reduction.
// mma.sync fragment layout (lane = 4 g + t): see kernels/common.cuh.
//
// Run: python stages/02_flash_v2/run.py --version pipelined   (tests: pytest tests/test_02_flash_v2.py;
//      timings beside PyTorch: python dev/bench.py --direction fwd)
#include "attention_tiles.cuh"
#include "dropout.cuh"

// Algorithm 1 of FA2 for one (Q tile i, head bh). T = __half or __nv_bfloat16. D: head dim (multiple of 16);
// BC: keys per K/V tile (Bc); NWARPS warps, each owning MT m-tiles of 16 rows, so Br = 16 * MT * NWARPS;
// SUB: keys per compute slice of a K/V tile; MINB: blocks per SM the registers must allow (64K / (MINB * threads)
// per thread); SKIP: skip the rescale of O_i by alpha = 1 (see below). HG: heads per group of the causal block
// order. Shared memory: (Br + 4 Bc) (D + 8) elements.
// Grouped-query attention (every instantiation): q has H heads, k and v H / group; query head h reads kv head
// h / group. VAR, the variants (stages/common/variants.py): 0 is plain attention (maybe causal).
// VAR >= 1, the masks: a window (left, right) around the diagonal (-1: unbounded; causal is (-1, 0)) whose tiles
// outside are never visited, and packed batches (below). VAR = 2 adds what changes the scores or P: the scores
// in natural units first (x = scale S_ij; scale_log2 is then log2(e)): softcap x -> c tanh(x / c) (c = 0: off),
// ALiBi x -> x - slope |r + shift + a_off - c| (slopes: one float per (batch, head), or null); dropout (keep != 0,
// dropout.cuh): P~_ij is zeroed where Z_ij = 0 before P~_ij V_j (l_i, and so the lse, keeps every P~_ij) and O_i is
// scaled by rp = 1 / (1 - p). a_off, q_off, k_off: 0, or where a ring block sits in the whole problem (ALiBi's
// diagonal moves by a_off; dropout draws from global indices q_off + r, k_off + c).
// Variable-length packed batches (VAR >= 1, cu_q != null): q, o are (H, total_q, D) and lse (H, total_q), k and v
// (H / group, total_k, D), with Nq = total_q, Nk = total_k; sequence s is rows cu_q[s]..cu_q[s + 1] - 1 of q (keys:
// cu_k). grid.y runs over (sequence, head), grid.x over the Q tiles of the longest sequence; a block past its own
// sequence's end returns at once. Inside a block everything is that one sequence's attention (its own Nq, Nk and
// bottom-right alignment; ALiBi and dropout take head h alone, each sequence being batch entry 0 of its own).
// ldq, ldk: rows per head of q, o, lse and of k, v: Nq and Nk for a whole problem. A ring block (stage 04) is rows
// a..b-1 of its query shard against keys c..m-1 of a key block: its pointers start at row a and key c, Nq = b - a,
// Nk = m - c, and ldq, ldk are the shard's and the block's lengths, so no row is copied. Such a block has float O
// (16-bit O is always a whole problem: ldq, ldk unused), and it merges into the running (O, L) it is given (below).
template <typename T, typename TO, int D, int BC, int NWARPS, int MT, int SUB, int MINB, bool SKIP, int VAR>
__global__ void __launch_bounds__(NWARPS * 32, MINB)
flash_v2_forward_pipelined(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                           TO* __restrict__ o, float* __restrict__ lse, const float* __restrict__ slopes,
                           const int* __restrict__ cu_q, const int* __restrict__ cu_k, int Nq, int Nk, int ldq, int ldk,
                           float scale_log2, int causal, int HG, int H, int group, int left, int right,
                           float scale, float softcap, int a_off, int q_off, int k_off, unsigned int keep, float rp,
                           unsigned int seed_lo, unsigned int seed_hi) {
    constexpr int BR = 16 * MT * NWARPS;  // Br: rows of Q_i
    constexpr int NT = NWARPS * 32;       // threads
    constexpr int LD = D + 8;             // padded row (elements): +16 B puts consecutive rows in new banks
    constexpr int CH = D / 8;             // 16-byte chunks per row
    static_assert(BC % SUB == 0 && SUB % 16 == 0, "slices of SUB keys must tile Bc");
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);  // [BR][LD]
    T* Ks = Qs + BR * LD;                    // [2][BC][LD]  double buffer
    T* Vs = Ks + 2 * BC * LD;                // [2][BC][LD]  double buffer

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group g, thread-in-group t
    // Non-causal: grid (Tr, B*H), the Q tiles of one head side by side, sharing K_j, V_j in L2.
    // Causal: a 1-D grid of B*H*Tr blocks; heads in groups of HG, and inside a group the Q tiles with the most
    // keys (the last ones) go first, so short tiles fill the tail (longest job first) while the blocks running
    // at once still share the K/V of a few heads in L2.
    int i;
    long bh;
    if (causal) {
        const int Tr = (Nq + BR - 1) / BR, BH = gridDim.x / Tr;
        const int grp = blockIdx.x / (HG * Tr), r = blockIdx.x % (HG * Tr);
        const int gsz = min(HG, BH - grp * HG);  // heads in this group (the last group may be short)
        i = Tr - 1 - r / gsz;
        bh = (long)grp * HG + r % gsz;
    } else {
        i = blockIdx.x;
        bh = blockIdx.y;
    }
    // This head's K and V (pointers the loop needs); q, o, lse are offset where they are used, so no register
    // holds them across the loop.
    const int bkv = (int)bh / H * (H / group) + (int)bh % H / group;  // the kv head of query head bh (GQA)
    if constexpr (sizeof(TO) == sizeof(T)) ldq = Nq, ldk = Nk;  // 16-bit O: always a whole problem
    long q_row0 = bh * ldq, kv_row0 = (long)bkv * ldk;  // this head's first row of q, o, lse and of k, v
    long hd = bh;  // the (batch, head) of the ALiBi slope and of dropout's counter
    if constexpr (VAR) {
        if (cu_q != nullptr) {  // varlen: this block's sequence s and head h
            const int sq = (int)bh / H, h = (int)bh % H;
            q_row0 = (long)h * ldq + cu_q[sq];
            kv_row0 = (long)(h / group) * ldk + cu_k[sq];
            Nq = cu_q[sq + 1] - cu_q[sq];
            Nk = cu_k[sq + 1] - cu_k[sq];
            hd = h;
            if (i * BR >= Nq) return;  // past this sequence's last Q tile (the whole block: before any barrier)
        }
    }
    const T* kh = k + kv_row0 * D;
    const T* vh = v + kv_row0 * D;
    const int row0 = i * BR;  // first row of Q_i
    const int shift = Nk - Nq;  // causal (bottom-right): query r sees key c iff c <= r + shift
    const int last_row = min(row0 + BR, Nq) - 1;
    // K/V tiles j_first <= j < n_tiles: Tc (causal: fewer); a window visits only the band of tiles holding a key
    // some row of Q_i sees: from the first row's first key to the last row's last key.
    int j_first = 0, n_tiles;
    if constexpr (VAR) {
        const int last_key = right < 0 ? Nk - 1 : min(Nk - 1, last_row + shift + right);
        const int first_key = left < 0 ? 0 : max(0, row0 + shift - left);
        j_first = first_key / BC;
        n_tiles = last_key < 0 || first_key > last_key ? j_first : min((Nk + BC - 1) / BC, last_key / BC + 1);
    } else {
        n_tiles = visited_kv_tiles<BR, BC>(row0, Nq, Nk, causal);
    }
    const float slope = VAR == 2 && slopes != nullptr ? slopes[hd] : 0.f;

    // cp.async a [rows][D] tile (rows r0.. of a [n][D] matrix) into padded shared memory, 16 bytes per thread per
    // step; rows >= n are zero-filled (they are masked out of S, and zeros keep P V free of NaN). Thread tid
    // copies chunk tid % CHP of rows tid / CHP + RS * it: its addresses are one base plus constant offsets.
    constexpr int CHP = CH <= 4 ? 4 : CH <= 8 ? 8 : CH <= 16 ? 16 : 32;  // chunks per row rounded up to a power
                                                                          // of 2 (D = 96: 16)
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

    // Alg.1 L4: load Q_i; Alg.1 L6 (j = 0): load K_0, V_0. One cp.async group.
    load_tile(Qs, q + q_row0 * D, row0, BR, Nq);
    if (n_tiles > j_first) {
        load_tile(Ks, kh, j_first * BC, BC, Nk);
        load_tile(Vs, vh, j_first * BC, BC, Nk);
    }
    cp_async_commit();

    // Alg.1 L5: O_i = 0, l_i = 0, m_i = -inf. m-tile m of a thread holds rows g (h = 0) and g + 8 (h = 1).
    float acc_o[MT][D / 8][4];
    float m_i[MT][2], l_i[MT][2];  // running max of S*scale*log2(e); this thread's part of the running row sum
    init_row_state<MT, D>(acc_o, m_i, l_i);

    const int wrow = warp * 16 * MT;  // this warp's first row inside Q_i
    // Each lane's ldmatrix row address (shared space, bytes) inside a 16 x 16 block; lanes 8q..8q+7 address
    // 8x8 tile q, which lands in register q of the fragment (common.cuh):
    //   Q (A operand):          tiles (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (0-7, 8-15), (8-15, 8-15)
    //   K (B operand of S):     tiles (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (8-15, 8-15):
    //                           b[0..1] of the n-tile of keys 0-7, b[2..3] of keys 8-15
    //   V (B of P V, .trans):   tiles (keys 0-7, d 0-7), (keys 8-15, d 0-7), (0-7, d 8-15), (8-15, d 8-15):
    //                           b[0..1] of the n-tile of d 0-7, b[2..3] of d 8-15
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
        // The tile is computed in slices of SUB keys (SUB = Bc unless registers ask for less): S of one slice,
        // 16*MT x SUB fp32 per warp, lives in registers beside O_i's 16*MT x D accumulators. Two copies of the
        // body: MASKED (the ragged last tile, tiles crossing the causal diagonal) and the plain one, which has no
        // branch from S_ij to P_ij V_j, so the compiler may interleave one m-tile's softmax with the other's mma.
        auto tile = [&](const bool MASKED) {  // called with a constant: each call inlines its own copy
#pragma unroll
            for (int sb = 0; sb < BC / SUB; ++sb) {
                const u32 kj = k_base + (buf * BC + sb * SUB) * LD * 2;  // K_j rows sb*SUB.., in buffer buf
                const u32 vj = v_base + (buf * BC + sb * SUB) * LD * 2;
                const int col0 = j * BC + sb * SUB;  // first key of this slice
                if constexpr (VAR) {  // a slice outside the window of every row of this warp
                    if (MASKED && ((right >= 0 && col0 > row0 + wrow + 16 * MT - 1 + shift + right) ||
                                   (left >= 0 && col0 + SUB - 1 < row0 + wrow + shift - left)))
                        continue;
                } else if (MASKED && causal && col0 > row0 + wrow + 16 * MT - 1 + shift) {
                    continue;  // no row of ours sees it
                }
                // Alg.1 L8: S_ij = Q_i K_j^T (16*MT x SUB per warp), fp32 accumulators in the C fragment layout.
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
                // Masking: only the slice holding Nk's tail and slices crossing this warp's causal diagonal pay for it.
                if constexpr (VAR) {
                    if constexpr (VAR == 2)
                        transform_scores<MT, SUB>(s, row0 + wrow, col0, shift + a_off, scale, softcap, slope, g, t);
                    if (MASKED) mask_window<MT, SUB>(s, row0 + wrow, col0, Nk, left, right, shift, g, t);
                } else if (MASKED && (col0 + SUB > Nk || (causal && col0 + SUB - 1 > row0 + wrow + shift))) {
                    mask_scores<MT, SUB>(s, row0 + wrow, col0, Nk, causal, shift, g, t);
                }
                // Alg.1 L9: m_ij = max(m_i, rowmax(S_ij)), P_ij = exp(S_ij - m_ij),
                //           l_ij = e^{m_i - m_ij} l_i + rowsum(P_ij).
                // In base 2, with log2(e) folded into the scale: exp2(s * scale_log2 - m), m the row max of the
                // scaled scores. The product is rounded before the subtraction (__fmul_rn is never fused into an
                // FFMA), so the largest score gives exactly exp2(0) = 1: fused, its rounding residual makes
                // P_max = 1 +- a few 1e-3 with huge logits (inputs x100), rounded one way in P's 16 bits (P V)
                // and kept in fp32 in l_i: 1-ulp errors in o.
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    float m_use[2], alpha[2];
#pragma unroll
                    for (int h = 0; h < 2; ++h) {  // h = 0: row g (fragment entries 0,1); h = 1: row g+8 (entries 2,3)
                        const float mx = row_max<SUB>(s[m], h);  // m~_ij of row g + 8 h (raw scores)
                        const float m_new = fmaxf(m_i[m][h], mx * scale_log2);
                        m_use[h] = MASKED && m_new == -INF ? 0.f : m_new;  // a row with nothing visible yet: P = 0
                        alpha[h] = fast_exp2(m_i[m][h] - m_use[h]);  // e^{m_i - m_ij}: 0 when m_i = -inf
                        m_i[m][h] = m_new;
                    }
                    // Alg.1 L10 (first half): O_i = diag(e^{m_i - m_ij}) O_i (normalisation deferred to the end).
                    // SKIP: alpha = 1 exactly when a row's max did not change (exp2(0)); when none of the warp's 16
                    // rows of this m-tile changed, the warp skips the D / 2 multiplies by 1 (same bits, fewer
                    // instructions).
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
                            s[m][n][2 * h] = fast_exp2(__fmul_rn(s[m][n][2 * h], scale_log2) - m_use[h]);
                            s[m][n][2 * h + 1] = fast_exp2(__fmul_rn(s[m][n][2 * h + 1], scale_log2) - m_use[h]);
                            rs += s[m][n][2 * h] + s[m][n][2 * h + 1];
                        }
                        l_i[m][h] = l_i[m][h] * alpha[h] + rs;  // the quad's 4 partial sums add up at the end
                    }
                }
                // Dropout: P~_ij Z_ij. Rows r = first + 16 m + g (+8), keys col0 + 16 kk + 2t + e (+8): the four
                // draws of one Philox call are exactly entries e and 2 + e of n-tiles 2kk and 2kk + 1.
                if constexpr (VAR == 2) {
                    if (keep != 0u) {
                        const Dropout drop{keep, seed_lo, seed_hi, rp, q_off, k_off};
#pragma unroll
                        for (int m = 0; m < MT; ++m)
#pragma unroll
                            for (int kk = 0; kk < SUB / 16; ++kk)
#pragma unroll
                                for (int e = 0; e < 2; ++e) {
                                    const uint4 u = dropout_draws(drop, row0 + wrow + 16 * m + g,
                                                                  col0 + 16 * kk + 2 * t + e, hd);
                                    if (u.x >= keep) s[m][2 * kk][e] = 0.f;          // (r, c)
                                    if (u.y >= keep) s[m][2 * kk + 1][e] = 0.f;      // (r, c + 8)
                                    if (u.z >= keep) s[m][2 * kk][2 + e] = 0.f;      // (r + 8, c)
                                    if (u.w >= keep) s[m][2 * kk + 1][2 + e] = 0.f;  // (r + 8, c + 8)
                                }
                    }
                }
                // Alg.1 L10 (second half): O_i += P_ij V_j.
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
        // Block-uniform: the tile holds Nk's tail, or keys right of the diagonal of Q_i's first row (VAR: right of
        // its window, or left of the last row's window).
        bool masked = (j + 1) * BC > Nk;
        if constexpr (VAR)
            masked = masked || (right >= 0 && (j + 1) * BC - 1 > row0 + shift + right) ||
                     (left >= 0 && j * BC < last_row + shift - left);
        else
            masked = masked || (causal && (j + 1) * BC - 1 > row0 + shift);
        if (masked)
            tile(true);
        else
            tile(false);
    }
    cp_async_wait<0>();  // with no K/V tile at all (causal, fully masked Q_i) the Q_i copy may still be landing:
    __syncthreads();     // ... every thread's copy is done before this warp's Q rows are reused for O below

    // Alg.1 L12-14: O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i).
    // 16-bit O: staged through this warp's own rows of Qs, then 16-byte coalesced stores.
    // float O: a ring block (stage 04). (o, lse) hold the running (O, L) of these rows over the blocks merged so far
    // (L = -inf: none yet), and this block's (O_i, L_i) is merged into them as ring.merge does:
    //     L = log(e^L + e^L_i),   O = e^(L - L_new) O + e^(L_i - L_new) O_i
    // so the ring keeps no partial result per block and makes no pass of its own over O.
    constexpr bool STAGE_O = sizeof(TO) == sizeof(T);
    T* Ow = Qs + wrow * LD;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l;
            // fully masked row: O = 0; dropout: the kept probabilities' 1 / (1 - p), once (rp = 1 without dropout)
            const float inv_l = inverse_row_sum(l_i[m][h], l) * (VAR == 2 ? rp : 1.f);
            const int rl = m * 16 + g + 8 * h;            // row inside the warp's rows
            float L_run = -INF;  // float O: this row's running L, read by lane t = 0 and passed to its quad, so every
            if constexpr (!STAGE_O) {  // lane has it before lane t = 0 overwrites it below
                if (t == 0 && row0 + wrow + rl < Nq) L_run = lse[q_row0 + row0 + wrow + rl];
                L_run = __shfl_sync(0xffffffffu, L_run, lane & ~3);
            }
            // Alg.1 L13, natural log: m_i is in base 2. The product in fp64: with huge logits m_i is ~1e4 and an
            // fp32 product would add its own rounding (~1e-3) to the lse.
            if (STAGE_O && t == 0 && row0 + wrow + rl < Nq)
                lse[q_row0 + row0 + wrow + rl] =
                    l != 0.f ? (float)((double)m_i[m][h] * 0.6931471805599453 + (double)logf(l)) : -INF;
            if constexpr (STAGE_O) {
#pragma unroll
                for (int d = 0; d < D / 8; ++d)
                    store2(Ow + rl * LD + d * 8 + 2 * t, acc_o[m][d][2 * h] * inv_l, acc_o[m][d][2 * h + 1] * inv_l);
            } else if (row0 + wrow + rl < Nq) {
                const float L_i = l != 0.f ? (float)((double)m_i[m][h] * 0.6931471805599453 + (double)logf(l)) : -INF;
                float w_run = 0.f, w_new = inv_l, L = L_i;  // the first block these rows see: O = O_i, L = L_i
                if (L_run > -INF) {  // merge (the max is finite, so both weights are in [0, 1])
                    const float mx = fmaxf(L_run, L_i);
                    const float e_run = expf(L_run - mx), e_new = expf(L_i - mx);  // e_new = 0 if L_i = -inf
                    L = mx + logf(e_run + e_new);
                    w_run = e_run / (e_run + e_new);
                    w_new = inv_l * (e_new / (e_run + e_new));
                }
                if (t == 0) lse[q_row0 + row0 + wrow + rl] = L;
                float* orow = o + (q_row0 + row0 + wrow + rl) * D + 2 * t;
#pragma unroll
                for (int d = 0; d < D / 8; ++d) {
                    float lo = acc_o[m][d][2 * h] * w_new, hi = acc_o[m][d][2 * h + 1] * w_new;
                    if (w_run != 0.f) {  // (never reads O where nothing was merged yet: it may be uninitialised)
                        const float2 prev = *reinterpret_cast<const float2*>(orow + d * 8);
                        lo += prev.x * w_run, hi += prev.y * w_run;
                    }
                    store2(orow + d * 8, lo, hi);
                }
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
