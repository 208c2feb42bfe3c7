// flash_v1_forward.cu: FlashAttention forward in fp32, with the loop order of the 2022 paper.
//
// Paper: Dao, Fu, Ermon, Rudra, Re, "FlashAttention", arXiv 2205.14135, Algorithm 1; tags `Alg.1 Ln` name its lines.
//   for j in 0..Tc-1: load K_j, V_j                                  (outer loop over K/V tiles, L5-L6)
//     for i in 0..Tr-1: load Q_i, O_i, l_i, m_i from HBM             (inner loop over Q tiles, L7-L8)
//       S_ij = scale Q_i K_j^T; m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij)   (L9-L10)
//       m_new = max(m_i, m~_ij), l_new = e^(m_i-m_new) l_i + e^(m~_ij-m_new) l~_ij                     (L11)
//       O_i = diag(l_new)^-1 (diag(l_i) e^(m_i-m_new) O_i + e^(m~_ij-m_new) P~_ij V_j); O_i, l_i, m_i -> HBM (L12-13)
//   then L_i = m_i + log(l_i), the lse the backward needs (-inf for a row that sees no key).
// What changes from naive attention (stage 00), and why: S and P exist one Br x Bc tile at a time, so memory is
// O(N), not O(N^2). The paper's loop order keeps O_i, l_i, m_i in HBM between steps, so one block must own a
// whole (batch, head) (the cost: stage 01's README; stage 02 swaps the loops).
// Work split: one block of 128 threads (4 warps) per (batch, head), both loops serial; Br = Bc = 32.
//   row-group layout (L9-L11): thread t owns row t/4 of S_ij and keys t%4 + 4k; a row reduces over 4 lanes.
//   warp-row layout (L8, L12-L13): warp w owns rows w + 4rr, lane the columns lane + 32kk (coalesced O_i).
// Shared-memory rows are padded to D+1 floats: the 8 rows a warp reads in the row-group layout hit 8 banks.
// Run: python stages/01_flash_v1/run.py            (tests: pytest tests/test_01_flash_v1.py)
#include "common.cuh"


#ifndef HEAD_DIM
#define HEAD_DIM 64  // the launcher compiles one module per head dim (-DHEAD_DIM=d), any 1 <= d <= 128
#endif
#ifndef BR
#define BR 32  // Br: rows of a Q tile
#endif
#ifndef BC
#define BC 32  // Bc: keys of a K/V tile
#endif
#define NTHREADS 128
#define LD (HEAD_DIM + 1)             // padded shared-memory row of Q_i, K_j, V_j
#define DK ((HEAD_DIM + 31) / 32)     // columns d = lane + 32*kk a lane owns in the warp-row layout
static_assert(BR == NTHREADS / 4, "row-group layout: 4 threads per row of S_ij");
static_assert(BC % 4 == 0 && BR % 4 == 0, "tiles split over 4 threads / 4 warps");
static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 128, "head dim 1..128");

// Copy rows [row0, row0 + BR_OR_BC) of a (n, D) matrix into shared memory (padded rows of LD floats).
// Consecutive threads read consecutive floats of HBM (coalesced); rows past n are zero.
template <int ROWS>
__device__ __forceinline__ void load_tile(float* dst, const float* __restrict__ src, int row0, int n) {
    for (int e = threadIdx.x; e < ROWS * HEAD_DIM; e += NTHREADS) {
        int r = e / HEAD_DIM, d = e % HEAD_DIM;
        dst[r * LD + d] = (row0 + r < n) ? src[(size_t)(row0 + r) * HEAD_DIM + d] : 0.f;
    }
}

// Grid: one block per (batch, head). q (B,H,Nq,D), k, v (B,H,Nk,D), o (B,H,Nq,D), all fp32 contiguous.
// l, m: (B,H,Nq) scratch in HBM (the paper's l and m); lse: (B,H,Nq) output.
extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_v1_forward(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 float* __restrict__ o, float* __restrict__ l, float* __restrict__ m, float* __restrict__ lse,
                 int Nq, int Nk, float scale, int causal) {
    extern __shared__ float smem[];
    float* Qs = smem;                  // Q_i  (Br, D+1)
    float* Ks = Qs + BR * LD;          // K_j  (Bc, D+1)
    float* Vs = Ks + BC * LD;          // V_j  (Bc, D+1)
    float* Ps = Vs + BC * LD;          // P~_ij (Br, Bc+1)
    float* m_s = Ps + BR * (BC + 1);   // m_i  (Br) on chip for this step
    float* l_s = m_s + BR;             // l_i  (Br)
    float* a_s = l_s + BR;             // a_r = l_i e^(m_i - m_new) / l_new   (Br): the old O_i's weight
    float* b_s = a_s + BR;             // b_r = e^(m~_ij - m_new) / l_new     (Br): P~_ij V_j's weight

    const size_t bh = blockIdx.x;
    q += bh * Nq * HEAD_DIM; o += bh * Nq * HEAD_DIM;
    k += bh * Nk * HEAD_DIM; v += bh * Nk * HEAD_DIM;
    l += bh * Nq; m += bh * Nq; lse += bh * Nq;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int r_g = tid / 4, t4 = tid % 4;   // row-group layout
    const int Tr = (Nq + BR - 1) / BR, Tc = (Nk + BC - 1) / BC;
    const int shift = Nk - Nq;               // causal, bottom-right: query R sees key C iff C <= R + shift

    // Alg.1 L2: O = 0, l = 0, m = -inf in HBM. Each element is written by the thread that will read it
    // (warp-row layout), so no barrier is needed for O; l and m are read by lane 0 of the same warp.
    for (int R = warp; R < Nq; R += 4) {
#pragma unroll
        for (int kk = 0; kk < DK; ++kk) {
            int d = lane + 32 * kk;
            if (d < HEAD_DIM) o[(size_t)R * HEAD_DIM + d] = 0.f;
        }
        if (lane == 0) { l[R] = 0.f; m[R] = -INF; }
    }

    for (int j = 0; j < Tc; ++j) {                                   // Alg.1 L5: outer loop over K_j, V_j
        __syncthreads();  // every thread is done reading the previous K_j, V_j before they are overwritten
        load_tile<BC>(Ks, k, j * BC, Nk);                            // Alg.1 L6
        load_tile<BC>(Vs, v, j * BC, Nk);
        // Causal: query tiles that end before the first visible row of K_j are fully masked: skip them.
        // Key j*Bc is first seen by query j*Bc - shift.
        const int i0 = causal ? max(0, j * BC - shift) / BR : 0;
        for (int i = i0; i < Tr; ++i) {                              // Alg.1 L7: inner loop over Q_i
            // Alg.1 L8: load Q_i to shared memory, l_i and m_i too (warp-row layout, lane 0 of each row's warp).
            __syncthreads();  // the previous step's readers of Q_i, P~_ij, a_s, b_s are done
            load_tile<BR>(Qs, q, i * BR, Nq);
            for (int r = warp; r < BR; r += 4) {
                int R = i * BR + r;
                if (lane == 0) { m_s[r] = R < Nq ? m[R] : -INF; l_s[r] = R < Nq ? l[R] : 0.f; }
            }
            __syncthreads();  // Q_i, K_j, V_j, m_i, l_i are all in shared memory before anyone reads them

            // Alg.1 L9: S_ij = scale * Q_i K_j^T, row r_g, keys c = t4 + 4kc. Masked entries are -inf.
            const int R = i * BR + r_g;
            float s[BC / 4];
            float m_tile = -INF;  // m~_ij = rowmax(S_ij), Alg.1 L10
#pragma unroll
            for (int kc = 0; kc < BC / 4; ++kc) {
                int c = t4 + 4 * kc, C = j * BC + c;
                float acc = 0.f;
#pragma unroll 8
                for (int d = 0; d < HEAD_DIM; ++d) acc = fmaf(Qs[r_g * LD + d], Ks[c * LD + d], acc);
                bool visible = R < Nq && C < Nk && (!causal || C <= R + shift);
                s[kc] = visible ? scale * acc : -INF;
                m_tile = fmaxf(m_tile, s[kc]);
            }
            m_tile = warp_max<4>(m_tile);  // the 4 threads of row r_g agree on m~_ij
            // Alg.1 L10: P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij); a row with no visible key has P~ = 0. A NaN
            // score (a NaN in q or k; fmaxf passes it over) stays NaN in P~ and l~, so the row comes out NaN.
            float l_tile = 0.f;
#pragma unroll
            for (int kc = 0; kc < BC / 4; ++kc) {
                float p = m_tile == -INF ? (isnan(s[kc]) ? s[kc] : 0.f) : expf(s[kc] - m_tile);
                Ps[r_g * (BC + 1) + t4 + 4 * kc] = p;
                l_tile += p;
            }
            l_tile = warp_sum<4>(l_tile);
            if (t4 == 0) {
                // Alg.1 L11: m_new = max(m_i, m~_ij), l_new = e^(m_i - m_new) l_i + e^(m~_ij - m_new) l~_ij
                float m_i = m_s[r_g], l_i = l_s[r_g];
                float m_new = fmaxf(m_i, m_tile);
                if (m_new == -INF && l_tile == 0.f) {  // nothing visible yet in this row: O_i stays 0
                    a_s[r_g] = 1.f; b_s[r_g] = 0.f;
                } else {
                    float alpha = expf(m_i - m_new), beta = expf(m_tile - m_new);  // exp(-inf) = 0
                    float l_new = alpha * l_i + beta * l_tile;                         // > 0
                    a_s[r_g] = l_i * alpha / l_new;
                    b_s[r_g] = beta / l_new;
                    m_s[r_g] = m_new; l_s[r_g] = l_new;
                }
            }
            __syncthreads();  // all of P~_ij and the row weights a, b are in shared memory

            // Alg.1 L12-13 (warp-row layout): O_i = a O_i + b P~_ij V_j, read from and written back to HBM.
            for (int r = warp; r < BR; r += 4) {
                int Rw = i * BR + r;
                if (Rw >= Nq) break;  // rows past the end of the sequence (the tail tile)
                float pv[DK];
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) pv[kk] = 0.f;
                for (int c = 0; c < BC; ++c) {
                    float p = Ps[r * (BC + 1) + c];  // one address for the whole warp: a broadcast
#pragma unroll
                    for (int kk = 0; kk < DK; ++kk) {
                        int d = lane + 32 * kk;
                        if (d < HEAD_DIM) pv[kk] = fmaf(p, Vs[c * LD + d], pv[kk]);  // (P~_ij V_j)[r, d]
                    }
                }
                float a = a_s[r], b = b_s[r];
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) {
                    int d = lane + 32 * kk;
                    if (d < HEAD_DIM) {
                        float* op = o + (size_t)Rw * HEAD_DIM + d;
                        *op = a * *op + b * pv[kk];  // O_i = diag(l_new)^-1 (diag(l_i) e^.. O_i + e^.. P~ V)
                    }
                }
                if (lane == 0) { m[Rw] = m_s[r]; l[Rw] = l_s[r]; }  // Alg.1 L13
            }
        }
    }
    __syncthreads();  // the last step's writes of l, m are visible to every thread of the block

    // L_i = m_i + log(l_i): the log-sum-exp the backward recomputes P from; -inf when l_i = 0 (NaN stays NaN).
    for (int R = tid; R < Nq; R += NTHREADS) lse[R] = l[R] != 0.f ? m[R] + logf(l[R]) : -INF;
}
