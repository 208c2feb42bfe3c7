// flash_v2_forward_tc.cu: FlashAttention-2 forward, version "tc": tensor cores, fp16/bf16 in, fp32 accumulate.
//
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 1 (as in flash_v2_forward_fp32.cu), Section 3.3.
// What changes from the CUDA-core versions ("fp32", "fp32_overlap"), and why:
//   * S_ij = Q_i K_j^T and O_i += P~_ij V_j on mma.sync m16n8k16 (inline PTX), fp32 accumulators: one instruction
//     does a 16x8x16 product, 2048 FMAs on CUDA cores; ldmatrix moves fragments out of shared memory (8x8 tiles);
//   * Q_i's A fragments are loaded once into registers and reused for every K/V tile;
//   * P~_ij never touches shared memory: S_ij's C fragments, rounded to 16 bits, are P~_ij V_j's A fragments;
//   * each warp owns 16 rows of Q_i (one m-tile), so its softmax is a 4-lane (quad) shuffle reduction.
// Kept simple so the tensor-core mechanics stand alone (version "pipelined" lifts each limit): K_j, V_j are loaded
// synchronously, shared rows are unpadded (ldmatrix conflicts when a row is a multiple of 128 bytes), the softmax
// uses natural exp, O_i is written straight from the fragments.
// Work split (FA2 Sec. 3.3): grid (Tr, B*H), Br = 64 (4 warps x 16 rows), Bc = 64; shared Q_i, K_j, V_j [rows][D].
// mma.sync fragment layout (lane = 4 g + t): see kernels/common.cuh.
// Run: python stages/02_flash_v2/run.py --version tc   (tests: pytest tests/test_02_flash_v2.py)
#include "attention_tiles.cuh"
#include "params.cuh"


// Algorithm 1 of FA2 for one (Q tile i, head bh). T = __half or __nv_bfloat16; D: head dim (multiple of 16).
template <typename T, typename TO, int D, int BC, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
flash_v2_forward_tc(const __grid_constant__ FwdParams p) {
    const T* __restrict__ q = static_cast<const T*>(p.q);
    const T* __restrict__ k = static_cast<const T*>(p.k);
    const T* __restrict__ v = static_cast<const T*>(p.v);
    TO* __restrict__ o = static_cast<TO*>(p.o);
    float* __restrict__ lse = p.lse;
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float scale = p.scale;
    constexpr int BR = 16 * NWARPS;  // Br: rows of Q_i
    constexpr int NT = NWARPS * 32;  // threads
    constexpr int CH = D / 8;        // 16-byte chunks per row
    __shared__ __align__(16) T Qs[BR][D];  // Q_i
    __shared__ __align__(16) T Ks[BC][D];  // K_j
    __shared__ __align__(16) T Vs[BC][D];  // V_j

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group g, thread-in-group t
    const int i = blockIdx.x;
    const long bh = blockIdx.y;
    q += bh * Nq * D;
    k += bh * Nk * D;
    v += bh * Nk * D;
    o += bh * Nq * D;
    lse += bh * Nq;
    const int row0 = i * BR;    // first row of Q_i
    const int shift = Nk - Nq;  // causal (bottom-right): query r sees key c iff c <= r + shift
    const int n_tiles = visited_kv_tiles<BR, BC>(row0, Nq, Nk, causal);  // loop end: Tc, causal fewer

    // Copy rows r0.. of a [n][D] matrix into a [rows][D] shared tile, 16 bytes per thread per step; rows >= n
    // are filled with zeros (they are masked out of S, and zeros keep P V free of NaN).
    auto load_tile = [&](T* dst, const T* src, int r0, int rows, int n) {
        for (int c = tid; c < rows * CH; c += NT) {
            const int r = c / CH, ch = c % CH;
            uint4 x = make_uint4(0, 0, 0, 0);
            if (r0 + r < n) x = *reinterpret_cast<const uint4*>(src + (long)(r0 + r) * D + ch * 8);
            *reinterpret_cast<uint4*>(dst + r * D + ch * 8) = x;
        }
    };

    load_tile(&Qs[0][0], q, row0, BR, Nq);  // Alg.1 L4: load Q_i
    __syncthreads();                        // all of Q_i is in shared memory before any warp reads it
    const int wrow = warp * 16;             // this warp's first row inside Q_i
    u32 qf[D / 16][4];                      // Q_i's A fragments (rows wrow..+15), kept in registers
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], &Qs[wrow + lane % 16][kk * 16 + (lane / 16) * 8]);

    // Alg.1 L5: O_i = 0, l_i = 0, m_i = -inf. This thread holds rows g (h = 0) and g + 8 (h = 1) of the warp's 16.
    float acc_o[D / 8][4];
#pragma unroll
    for (int d = 0; d < D / 8; ++d) acc_o[d][0] = acc_o[d][1] = acc_o[d][2] = acc_o[d][3] = 0.f;
    float m_i[2] = {-INF, -INF};  // running max of scale * S (natural units)
    float l_i[2] = {0.f, 0.f};    // this thread's part of the running row sum (the quad's parts add up at the end)
    const int rg[2] = {row0 + wrow + g, row0 + wrow + g + 8};  // the two global rows this thread holds

    for (int j = 0; j < n_tiles; ++j) {  // Alg.1 L6: loop over K/V tiles
        load_tile(&Ks[0][0], k, j * BC, BC, Nk);  // Alg.1 L7: load K_j, V_j
        load_tile(&Vs[0][0], v, j * BC, BC, Nk);
        __syncthreads();  // all of K_j, V_j is in shared memory before any warp reads it

        // Alg.1 L8: Q_i K_j^T (16 x BC per warp; scaled below, with the mask), fp32 accumulators, C fragment layout.
        float s[BC / 8][4];
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
            for (int n = 0; n < BC / 16; ++n) {  // K rows 16n..16n+15 = the B fragments of two n-tiles of 8 keys
                u32 b[4];
                ldmatrix_x4(b, &Ks[n * 16 + lane % 8 + (lane / 16) * 8][kk * 16 + ((lane / 8) % 2) * 8]);
                mma_16816<T>(s[2 * n], qf[kk], b);
                mma_16816<T>(s[2 * n + 1], qf[kk], b + 2);
            }
        // Mask keys past Nk (the last tile) and, when causal, keys right of the diagonal.
#pragma unroll
        for (int n = 0; n < BC / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int c = j * BC + n * 8 + 2 * t + (e & 1);
                const int r = rg[e / 2];
                s[n][e] = (c >= Nk || (causal && c > r + shift)) ? -INF : s[n][e] * scale;
            }
        // Alg.1 L9: m_new = max(m_i, rowmax S_ij), P~_ij = exp(S_ij - m_new), l_i = e^(m_i - m_new) l_i + rowsum P~_ij
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h = 0: row g (fragment entries 0,1); h = 1: row g+8 (entries 2,3)
            float mx = -INF;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
            mx = warp_max<4>(mx);  // the 4 lanes of a quad hold the same row: reduce across them
            const float m_new = fmaxf(m_i[h], mx);
            const float m_use = m_new == -INF ? 0.f : m_new;  // a row with nothing visible yet: P = 0
            const float alpha = __expf(m_i[h] - m_use);       // e^(m_i - m_new): 0 when m_i = -inf
            m_i[h] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) {
                s[n][2 * h] = __expf(s[n][2 * h] - m_use);
                s[n][2 * h + 1] = __expf(s[n][2 * h + 1] - m_use);
                rs += s[n][2 * h] + s[n][2 * h + 1];
            }
            l_i[h] = l_i[h] * alpha + rs;
            // Alg.1 L10 (first half): O_i = diag(e^(m_i - m_new)) O_i (normalisation deferred to the end)
#pragma unroll
            for (int d = 0; d < D / 8; ++d) acc_o[d][2 * h] *= alpha, acc_o[d][2 * h + 1] *= alpha;
        }
        // Alg.1 L10 (second half): O_i += P~_ij V_j.
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {  // keys 16kk..16kk+15
            // The C fragments of n-tiles 2kk, 2kk+1 ARE the A fragment of P for k-step kk (rounded to T).
            u32 pa[4];
            c_to_a<T>(pa, 2 * kk, s[2 * kk]);
            c_to_a<T>(pa, 2 * kk + 1, s[2 * kk + 1]);
#pragma unroll
            for (int d = 0; d < D / 16; ++d) {  // V rows 16kk.., cols 16d..16d+15, transposed into B fragments
                u32 b[4];
                ldmatrix_x4_trans(b, &Vs[kk * 16 + lane % 16][d * 16 + (lane / 16) * 8]);
                mma_16816<T>(acc_o[2 * d], pa, b);
                mma_16816<T>(acc_o[2 * d + 1], pa, b + 2);
            }
        }
        __syncthreads();  // every warp is done with K_j, V_j before the next iteration overwrites them
    }

    // Alg.1 L12-14: O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i), written straight from the fragments.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l;
        const float inv_l = inverse_row_sum(l_i[h], l);  // fully masked row: O = 0
        if (rg[h] >= Nq) continue;
        if (t == 0) lse[rg[h]] = l != 0.f ? m_i[h] + logf(l) : -INF;  // Alg.1 L13 (NaN in: NaN out)
#pragma unroll
        for (int d = 0; d < D / 8; ++d)
            store2(o + (long)rg[h] * D + d * 8 + 2 * t, acc_o[d][2 * h] * inv_l, acc_o[d][2 * h + 1] * inv_l);
    }
}
