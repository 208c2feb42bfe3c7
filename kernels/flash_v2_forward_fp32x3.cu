// flash_v2_forward_fp32x3.cu: FlashAttention-2 forward, version "fp32x3": float32 on TF32 tensor cores (3xTF32).
//
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 1 (as in flash_v2_forward_fp32.cu), Section 3.3.
// What changes from version "fp32", and why: tensor cores have far more throughput than FFMA, and the 3xTF32
// split keeps close to fp32 accuracy (PyTorch's float32 backend does the same); the structure is version "pipelined":
//   * S_ij = Q_i K_j^T and O_i += P~_ij V_j on mma.sync m16n8k8 .tf32 (10 mantissa bits), fp32 accumulators;
//   * 3xTF32: x = big + small (cvt.rna), a b = a_small b_big + a_big b_small + a_big b_big (a_small b_small dropped);
//   * for huge logits each k step goes to a fresh accumulator and one rounded fp32 add (tensor-core adds truncate),
//     and V is split in three exact TF32 parts, so a one-hot row of P gives V's row exactly;
//   * 32-bit fragments by plain loads (ldmatrix moves 16-bit elements); each mma's k index is permuted (column t
//     <-> element 2t, t+4 <-> 2t+1): a thread's two elements are adjacent, and S_ij's C fragments are P~_ij's A;
//   * K_j, V_j are split once per block, not by every warp: the block converts each tile into its TF32 parts in
//     shared memory (split_kv), laid out so that a B fragment's parts are one 16-byte (K) or three 8-byte (V) loads;
//     the raw tile j+1 lands by cp.async while tile j is computed.
// Work split (FA2 Sec. 3.3): grid (Tr, B*H), last Q tiles first; warp w owns rows 16 MT w .. 16 MT (w+1) - 1 of Q_i.
// Shared (floats): Q_i [Br][D+8]; raw K_j, V_j [Bc][D+4] each; K_j's parts [Bc][2D+16], V_j's [Bc/2][6D+24]; padded
// so that every fragment load is conflict-free. The mma.sync m16n8k8 .tf32 fragment layouts: tf32x3.cuh.
// Run: python stages/02_flash_v2/run.py --version fp32x3   (tests: pytest tests/test_02_flash_v2.py -k fp32x3)
#include "attention_tiles.cuh"
#include "params.cuh"
#include "tf32x3.cuh"

// The TF32 parts of a K/V tile, from its raw floats (rows of LDR floats), for the fragment loads of the tile loop.
// K_j: key r, element pair e (elements 2e, 2e+1) -> Kp[r][4e..4e+3] = big(2e), big(2e+1), small(2e), small(2e+1): the
// B fragment of S = Q K^T at one k step (permuted k index) with its parts in one 16-byte load.
// V_j: key pair e (keys 2e, 2e+1), column c -> Vp[e][6c..6c+5] = hi, hi, mid, mid, lo, lo of the two keys: the B
// fragment of O += P V at one k step, each of its three parts in one 8-byte load.
template <int D, int BC, int NT, int LDR, int LDKP, int LDVP>
__device__ __forceinline__ void split_kv(const float* Kraw, const float* Vraw, float* Kp, float* Vp, int tid) {
    for (int c = tid; c < BC * D / 4; c += NT) {  // elements 4e..4e+3 of key r
        const int r = c / (D / 4), e = c % (D / 4);
        const float4 x = *reinterpret_cast<const float4*>(Kraw + r * LDR + 4 * e);
        u32 b[4], sm[4];
        split_tf32(x.x, b[0], sm[0]);
        split_tf32(x.y, b[1], sm[1]);
        split_tf32(x.z, b[2], sm[2]);
        split_tf32(x.w, b[3], sm[3]);
        uint4* dst = reinterpret_cast<uint4*>(Kp + r * LDKP + 8 * e);
        dst[0] = make_uint4(b[0], b[1], sm[0], sm[1]);
        dst[1] = make_uint4(b[2], b[3], sm[2], sm[3]);
    }
    for (int c = tid; c < BC / 2 * D / 4; c += NT) {  // columns 4e..4e+3 of key pair p
        const int p = c / (D / 4), e = c % (D / 4);
        const float4 x = *reinterpret_cast<const float4*>(Vraw + 2 * p * LDR + 4 * e);
        const float4 y = *reinterpret_cast<const float4*>(Vraw + (2 * p + 1) * LDR + 4 * e);
        const float xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            u32 h0, m0, l0, h1, m1, l1;
            split3_tf32(xs[u], h0, m0, l0);
            split3_tf32(ys[u], h1, m1, l1);
            uint2* dst = reinterpret_cast<uint2*>(Vp + p * LDVP + 6 * (4 * e + u));
            dst[0] = make_uint2(h0, h1);
            dst[1] = make_uint2(m0, m1);
            dst[2] = make_uint2(l0, l1);
        }
    }
}

// Algorithm 1 of FA2 for one (Q tile i, head bh), float32. D: head dim (multiple of 32); BC: keys per K/V tile;
// NWARPS warps of MT m-tiles (16 rows each): Br = 16 * MT * NWARPS; MINB: blocks per SM the registers must allow;
// SU: unroll of the k loop of S_ij (a smaller unroll holds fewer k steps' operands in registers).
template <int D, int BC, int NWARPS, int MT, int MINB, int SU>
__global__ void __launch_bounds__(NWARPS * 32, MINB)
flash_v2_forward_fp32x3(const __grid_constant__ FwdParams p) {
    const float* __restrict__ q = static_cast<const float*>(p.q);
    const float* __restrict__ k = static_cast<const float*>(p.k);
    const float* __restrict__ v = static_cast<const float*>(p.v);
    float* __restrict__ o = static_cast<float*>(p.o);
    float* __restrict__ lse = p.lse;
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float exp2_scale = p.exp2_scale;  // scale log2(e)
    constexpr int BR = 16 * MT * NWARPS;  // Br: rows of Q_i
    constexpr int NT = NWARPS * 32;       // threads
    constexpr int LDQ = D + 8;            // padded row of Q_i (floats)
    constexpr int LDR = D + 4;            // row of the raw K_j, V_j
    constexpr int LDKP = 2 * D + 16;      // row of K_j's parts (= 16 mod 32 floats: 16-byte loads conflict-free)
    constexpr int LDVP = 6 * D + 24;      // row (key pair) of V_j's parts (= 24 mod 32: 8-byte loads conflict-free)
    constexpr int CH = D / 4;             // 16-byte chunks per row
    static_assert(D % 32 == 0 && D <= 128 && BC % 8 == 0, "head dim 32, 64, 96 or 128; Bc a multiple of 8");
    extern __shared__ __align__(16) float smem[];
    float* Qs = smem;                 // [BR][LDQ]
    float* Kraw = Qs + BR * LDQ;      // [BC][LDR]: K_{j+1} lands here while tile j is computed
    float* Vraw = Kraw + BC * LDR;    // [BC][LDR]
    float* Kp = Vraw + BC * LDR;      // [BC][LDKP]: K_j's TF32 parts
    float* Vp = Kp + BC * LDKP;       // [BC / 2][LDVP]: V_j's TF32 parts

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group g, thread-in-group t
    const int i = gridDim.x - 1 - blockIdx.x;  // the last Q tiles have the most causal work: launch them first
    const long bh = blockIdx.y;
    const float* kh = k + bh * Nk * D;
    const float* vh = v + bh * Nk * D;
    const int row0 = i * BR;    // first row of Q_i
    const int shift = Nk - Nq;  // causal (bottom-right): query r sees key c iff c <= r + shift
    const int n_tiles = visited_kv_tiles<BR, BC>(row0, Nq, Nk, causal);  // loop end: Tc, causal fewer

    // cp.async rows r0.. of a [n][D] matrix into a [rows][ld] shared tile, 16 bytes per thread per step; rows >= n
    // are zero-filled (they are masked out of S, and zeros keep P V free of NaN).
    auto load_tile = [&](float* dst, const float* src, int r0, int rows, int n, int ld) {
        for (int c = tid; c < rows * CH; c += NT) {
            const int r = c / CH, ch = c % CH;
            const bool ok = r0 + r < n;
            cp_async_16(dst + r * ld + ch * 4, ok ? src + (long)(r0 + r) * D + ch * 4 : src, ok);
        }
    };

    // Alg.1 L4: load Q_i; Alg.1 L7 (j = 0): load K_0, V_0. One cp.async group.
    load_tile(Qs, q + bh * Nq * D, row0, BR, Nq, LDQ);
    if (n_tiles > 0) {
        load_tile(Kraw, kh, 0, BC, Nk, LDR);
        load_tile(Vraw, vh, 0, BC, Nk, LDR);
    }
    cp_async_commit();

    // Alg.1 L5: O_i = 0, l_i = 0, m_i = -inf. m-tile m of a thread holds rows g (h = 0) and g + 8 (h = 1).
    float acc_o[MT][D / 8][4];
    float m_i[MT][2], l_i[MT][2];  // running max of S*scale*log2(e); this thread's part of the running row sum
    init_row_state<MT, D>(acc_o, m_i, l_i);

    const int wrow = warp * 16 * MT;  // this warp's first row inside Q_i
    // Per-lane fragment bases (floats). Q (A of S): rows wrow + g (+8), elements 2t, 2t+1 of each 8-wide k step.
    // K's parts (B of S): key g of each n-tile, element pair t. V's parts (B of P V): key pair t (keys 2t, 2t+1) of
    // each k step, column g.
    const float* q_frag = Qs + (wrow + g) * LDQ + 2 * t;
    const float* kj = Kp + g * LDKP + 4 * t;
    const float* vj = Vp + t * LDVP + 6 * g;

    for (int j = 0; j < n_tiles; ++j) {  // Alg.1 L6: loop over K/V tiles
        cp_async_wait<0>();  // this thread's copies of K_j, V_j (and Q_i) have landed ...
        __syncthreads();     // ... everyone's too; and every warp has finished tile j-1, so the parts are free
        split_kv<D, BC, NT, LDR, LDKP, LDVP>(Kraw, Vraw, Kp, Vp, tid);
        __syncthreads();     // the parts of tile j are written; the raw buffers are free
        if (j + 1 < n_tiles) {  // K_{j+1}, V_{j+1} land while tile j is computed
            load_tile(Kraw, kh, (j + 1) * BC, BC, Nk, LDR);
            load_tile(Vraw, vh, (j + 1) * BC, BC, Nk, LDR);
            cp_async_commit();
        }
        const int col0 = j * BC;  // first key of K_j

        auto tile = [&](const bool MASKED) {  // called with a constant: each call inlines its own copy
            // Alg.1 L8, unscaled: Q_i K_j^T (16*MT x BC per warp), fp32 accumulators in the C fragment layout.
            float s[MT][BC / 8][4];
#pragma unroll
            for (int m = 0; m < MT; ++m)
#pragma unroll
                for (int n = 0; n < BC / 8; ++n) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.f;
#pragma unroll SU
            for (int kk = 0; kk < D / 8; ++kk) {  // head-dim elements 8kk..8kk+7
                u32 qb[MT][4], qs[MT][4];  // A fragments of Q_i, split (re-read per tile: registers go to O and S)
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    const float2 x0 = *reinterpret_cast<const float2*>(q_frag + (16 * m) * LDQ + 8 * kk);
                    const float2 x1 = *reinterpret_cast<const float2*>(q_frag + (16 * m + 8) * LDQ + 8 * kk);
                    split_tf32(x0.x, qb[m][0], qs[m][0]);  // (row g,   col t)   = element 2t
                    split_tf32(x1.x, qb[m][1], qs[m][1]);  // (row g+8, col t)
                    split_tf32(x0.y, qb[m][2], qs[m][2]);  // (row g,   col t+4) = element 2t+1
                    split_tf32(x1.y, qb[m][3], qs[m][3]);  // (row g+8, col t+4)
                }
#pragma unroll
                for (int n = 0; n < BC / 8; ++n) {  // keys 8n..8n+7
                    // B fragment of K_j^T: (row t, col g) = K[key g][2t], (row t+4) = K[g][2t+1], big and small parts
                    const uint4 y = *reinterpret_cast<const uint4*>(kj + (8 * n) * LDKP + 16 * kk);
                    const u32 kb[2] = {y.x, y.y}, ks[2] = {y.z, y.w};
                    // A fresh accumulator per k step, then one rounded add into S (tensor-core adds truncate).
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        float c[4];
                        mma_1688_tf32_zero(c, qs[m], kb);  // small products first
                        mma_1688_tf32(c, qb[m], ks);
                        mma_1688_tf32(c, qb[m], kb);
                        s[m][n][0] += c[0], s[m][n][1] += c[1], s[m][n][2] += c[2], s[m][n][3] += c[3];
                    }
                }
            }
            // Masking: the tile holding Nk's tail and tiles crossing the causal diagonal.
            if (MASKED) mask_scores<MT, BC>(s, row0 + wrow, col0, Nk, causal, shift, g, t);
            // Alg.1 L9-10 (first half) in base 2, attention_tiles.cuh: m_new, P~_ij, l_i; O_i = diag(alpha) O_i
            online_softmax_fp32<MT, BC, D>(s, m_i, l_i, acc_o, exp2_scale, MASKED);
            // Alg.1 L10 (second half): O_i += P~_ij V_j, keys 8kk..8kk+7 per k step.
#pragma unroll
            for (int kk = 0; kk < BC / 8; ++kk) {
                // The C fragment of n-tile kk IS the A fragment of P with the permuted k index (col t <-> key 2t,
                // col t+4 <-> key 2t+1): a[0] = P[g][2t], a[1] = P[g+8][2t], a[2] = P[g][2t+1], a[3] = P[g+8][2t+1].
                u32 pb[MT][4], ps[MT][4];
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    split_tf32(s[m][kk][0], pb[m][0], ps[m][0]);
                    split_tf32(s[m][kk][2], pb[m][1], ps[m][1]);
                    split_tf32(s[m][kk][1], pb[m][2], ps[m][2]);
                    split_tf32(s[m][kk][3], pb[m][3], ps[m][3]);
                }
#pragma unroll
                for (int d = 0; d < D / 8; ++d) {
                    // columns 8d..8d+7 of V_j: B = (row t) V[2t][g], (row t+4) V[2t+1][g]
                    const uint2* v3 = reinterpret_cast<const uint2*>(vj + 4 * kk * LDVP + 48 * d);
                    const uint2 h = v3[0], md = v3[1], lo = v3[2];  // V's hi, mid, lo parts of keys 2t, 2t+1
                    const u32 vh[2] = {h.x, h.y}, vm[2] = {md.x, md.y}, vl[2] = {lo.x, lo.y};
                    // P V = P_small V_hi + P_big (V_lo + V_mid + V_hi), smallest first (P_small V_mid dropped): with
                    // P = 1 the sum is V exactly. As for S: a fresh accumulator per k step, one rounded add into O_i.
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        float c[4];
                        mma_1688_tf32_zero(c, ps[m], vh);
                        mma_1688_tf32(c, pb[m], vl);
                        mma_1688_tf32(c, pb[m], vm);
                        mma_1688_tf32(c, pb[m], vh);
                        acc_o[m][d][0] += c[0], acc_o[m][d][1] += c[1], acc_o[m][d][2] += c[2], acc_o[m][d][3] += c[3];
                    }
                }
            }
        };
        // Block-uniform: the tile holds Nk's tail, or keys right of the diagonal of Q_i's first row.
        if ((j + 1) * BC > Nk || (causal && (j + 1) * BC - 1 > row0 + shift))
            tile(true);
        else
            tile(false);
    }
    cp_async_wait<0>();  // with no K/V tile at all (causal, fully masked Q_i) the Q_i copy may still be in flight

    // Alg.1 L12-14: O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i) (attention_tiles.cuh)
    write_rows_fp32<MT, D>(o, lse, acc_o, m_i, l_i, bh, Nq, row0 + wrow, g, t);
}
