// flash_v1_backward.cu: FlashAttention backward in fp32 (no dropout), with the loop order of the 2022 paper.
//
// Paper: Dao et al., "FlashAttention", arXiv 2205.14135, Algorithm 4 (appendix B) without its dropout lines; tags
// `Alg.4 Ln` name its lines. P is recomputed, not stored: with L_i = m_i + log(l_i), P_ij = exp(S_ij - L_i).
//   dQ = 0 in HBM                                                                             (L6)
//   for j in 0..Tc-1: load K_j, V_j; dK~_j = dV~_j = 0 on chip                                (L7-L9)
//     for i in 0..Tr-1: load Q_i, O_i, dO_i, L_i                                              (L10-L11)
//       S_ij = scale Q_i K_j^T, masked; P_ij = exp(S_ij - L_i); dV~_j += P_ij^T dO_i          (L12-L17)
//       dP_ij = dO_i V_j^T; D_i = rowsum(dO_i * O_i); dS_ij = P_ij * (dP_ij - D_i)            (L18, L20-L21)
//       dQ_i += scale dS_ij K_j, read-modify-write in HBM; dK~_j += scale dS_ij^T Q_i          (L22-L23)
//     dK_j = dK~_j, dV_j = dV~_j -> HBM                                                       (L25)
// What changes from naive attention's backward, and why: the forward's tiling, so nothing N x N is stored.
// One block owns all of its (batch, head)'s dQ, so the read-modify-write of dQ_i needs no atomics; D_i is
// recomputed at every (i, j) as Algorithm 4 does (stage 03 computes it once and gives each K/V tile a block).
// Work split: one block of 128 threads (4 warps) per (batch, head); Br = Bc = 32; shared rows padded to D+1 floats.
//   row-group (L12-L21): thread t owns row t/4 of S_ij, P_ij, dP_ij, dS_ij and keys t%4 + 4k.
//   warp-row (L11, L22): warp w owns rows w + 4rr of Q_i, dO_i, dQ_i; lane the columns lane + 32kk (coalesced).
//   warp-key (L17, L23, L25): warp w owns keys w + 4cc of dK~_j, dV~_j (registers); lane the columns lane + 32kk.
// Run: python stages/01_flash_v1/run.py            (tests: pytest tests/test_01_flash_v1.py)
#include "common.cuh"


#ifndef HEAD_DIM
#define HEAD_DIM 64  // one module per head dim (-DHEAD_DIM=d), any 1 <= d <= 128
#endif
#ifndef BR
#define BR 32
#endif
#ifndef BC
#define BC 32
#endif
#define NTHREADS 128
#define LD (HEAD_DIM + 1)
#define DK ((HEAD_DIM + 31) / 32)
static_assert(BR == NTHREADS / 4, "row-group layout: 4 threads per row of S_ij");
static_assert(BC % 4 == 0 && BR % 4 == 0, "tiles split over 4 threads / 4 warps");
static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 128, "head dim 1..128");

// Grid: one block per (batch, head). q, o, do_, dq: (B,H,Nq,D); k, v, dk, dv: (B,H,Nk,D); lse: (B,H,Nq).
extern "C" __global__ void __launch_bounds__(NTHREADS)
flash_v1_backward(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ o, const float* __restrict__ lse, const float* __restrict__ do_,
                  float* __restrict__ dq, float* __restrict__ dk, float* __restrict__ dv,
                  int Nq, int Nk, float scale, int causal) {
    extern __shared__ float smem[];
    float* Qs = smem;                  // Q_i   (Br, D+1)
    float* dOs = Qs + BR * LD;         // dO_i  (Br, D+1)
    float* Ks = dOs + BR * LD;         // K_j   (Bc, D+1)
    float* Vs = Ks + BC * LD;          // V_j   (Bc, D+1)
    float* Ps = Vs + BC * LD;          // P_ij  (Br, Bc+1)
    float* dSs = Ps + BR * (BC + 1);   // dS_ij (Br, Bc+1)
    float* L_s = dSs + BR * (BC + 1);  // L_i   (Br)
    float* D_s = L_s + BR;             // D_i   (Br)

    const size_t bh = blockIdx.x;
    q += bh * Nq * HEAD_DIM; o += bh * Nq * HEAD_DIM; do_ += bh * Nq * HEAD_DIM; dq += bh * Nq * HEAD_DIM;
    k += bh * Nk * HEAD_DIM; v += bh * Nk * HEAD_DIM; dk += bh * Nk * HEAD_DIM; dv += bh * Nk * HEAD_DIM;
    lse += bh * Nq;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int r_g = tid / 4, t4 = tid % 4;
    const int Tr = (Nq + BR - 1) / BR, Tc = (Nk + BC - 1) / BC;
    const int shift = Nk - Nq;  // causal, bottom-right: query R sees key C iff C <= R + shift

    // Alg.4 L6: dQ = 0 in HBM, by the thread (warp-row layout) that later read-modify-writes it.
    for (int R = warp; R < Nq; R += 4) {
#pragma unroll
        for (int kk = 0; kk < DK; ++kk)
            if (lane + 32 * kk < HEAD_DIM) dq[(size_t)R * HEAD_DIM + lane + 32 * kk] = 0.f;
    }

    for (int j = 0; j < Tc; ++j) {                                   // Alg.4 L7: outer loop over K_j, V_j
        __syncthreads();  // every thread is done reading the previous K_j, V_j before they are overwritten
        // Alg.4 L8: load K_j, V_j (coalesced; rows past Nk are zero).
        for (int e = tid; e < BC * HEAD_DIM; e += NTHREADS) {
            int c = e / HEAD_DIM, d = e % HEAD_DIM, C = j * BC + c;
            Ks[c * LD + d] = C < Nk ? k[(size_t)C * HEAD_DIM + d] : 0.f;
            Vs[c * LD + d] = C < Nk ? v[(size_t)C * HEAD_DIM + d] : 0.f;
        }
        // Alg.4 L9: dK~_j = 0, dV~_j = 0 on chip (registers, warp-key layout: key w + 4cc, column lane + 32kk).
        float dK_acc[BC / 4][DK], dV_acc[BC / 4][DK];
#pragma unroll
        for (int cc = 0; cc < BC / 4; ++cc)
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) dK_acc[cc][kk] = dV_acc[cc][kk] = 0.f;

        // Causal: Q tiles that end before key j*Bc's first visible query (j*Bc - shift) are fully masked.
        const int i0 = causal ? max(0, j * BC - shift) / BR : 0;
        for (int i = i0; i < Tr; ++i) {                              // Alg.4 L10: inner loop over Q_i
            __syncthreads();  // the previous step's readers of Q_i, dO_i, P_ij, dS_ij are done
            // Alg.4 L11 (warp-row layout): Q_i, dO_i to shared memory, L_i; O_i is only needed for
            // D_i = rowsum(dO_i * O_i) (Alg.4 L20), so it is reduced on the way in and never stored.
            for (int r = warp; r < BR; r += 4) {
                int R = i * BR + r;
                float dot = 0.f;
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) {
                    int d = lane + 32 * kk;
                    if (d < HEAD_DIM) {
                        size_t at = (size_t)R * HEAD_DIM + d;
                        float qv = R < Nq ? q[at] : 0.f, gv = R < Nq ? do_[at] : 0.f;
                        Qs[r * LD + d] = qv;
                        dOs[r * LD + d] = gv;
                        dot += R < Nq ? gv * o[at] : 0.f;
                    }
                }
                dot = warp_sum(dot);  // D_i for row r
                if (lane == 0) {
                    float L = R < Nq ? lse[R] : INF;
                    L_s[r] = L == -INF ? INF : L;  // a row that saw no key: exp(S - inf) = 0, not NaN
                    D_s[r] = dot;
                }
            }
            __syncthreads();  // Q_i, dO_i, L_i, D_i (and K_j, V_j) are in shared memory

            // Alg.4 L12-14, L18, L20-21 (row-group layout): row r_g, keys c = t4 + 4kc.
            const int R = i * BR + r_g;
#pragma unroll
            for (int kc = 0; kc < BC / 4; ++kc) {
                int c = t4 + 4 * kc, C = j * BC + c;
                float s = 0.f, dp = 0.f;
#pragma unroll 8
                for (int d = 0; d < HEAD_DIM; ++d) {
                    s = fmaf(Qs[r_g * LD + d], Ks[c * LD + d], s);    // (Q_i K_j^T)[r, c]
                    dp = fmaf(dOs[r_g * LD + d], Vs[c * LD + d], dp);  // dP_ij[r, c] = (dO_i V_j^T)[r, c]
                }
                bool visible = R < Nq && C < Nk && (!causal || C <= R + shift);
                float p = visible ? expf(scale * s - L_s[r_g]) : 0.f;  // P_ij = exp(S_ij - L_i), masked -> 0
                Ps[r_g * (BC + 1) + c] = p;
                dSs[r_g * (BC + 1) + c] = p * (dp - D_s[r_g]);         // dS_ij = P_ij * (dP_ij - D_i)
            }
            __syncthreads();  // all of P_ij and dS_ij are in shared memory

            // Alg.4 L17, L23 (warp-key layout): dV~_j += P_ij^T dO_i, dK~_j += dS_ij^T Q_i (scale at L25).
            for (int r = 0; r < BR; ++r) {
                float g[DK], x[DK];
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) {
                    int d = min(lane + 32 * kk, HEAD_DIM - 1);  // lanes past D compute garbage they never store
                    g[kk] = dOs[r * LD + d];
                    x[kk] = Qs[r * LD + d];
                }
#pragma unroll
                for (int cc = 0; cc < BC / 4; ++cc) {
                    int c = warp + 4 * cc;
                    float p = Ps[r * (BC + 1) + c], ds = dSs[r * (BC + 1) + c];  // broadcasts
#pragma unroll
                    for (int kk = 0; kk < DK; ++kk) {
                        dV_acc[cc][kk] = fmaf(p, g[kk], dV_acc[cc][kk]);
                        dK_acc[cc][kk] = fmaf(ds, x[kk], dK_acc[cc][kk]);
                    }
                }
            }
            // Alg.4 L22 (warp-row layout): dQ_i += scale dS_ij K_j, read-modify-write in HBM.
            for (int r = warp; r < BR; r += 4) {
                int Rw = i * BR + r;
                if (Rw >= Nq) break;
                float acc[DK];
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) acc[kk] = 0.f;
                for (int c = 0; c < BC; ++c) {
                    float ds = dSs[r * (BC + 1) + c];
#pragma unroll
                    for (int kk = 0; kk < DK; ++kk)
                        acc[kk] = fmaf(ds, Ks[c * LD + min(lane + 32 * kk, HEAD_DIM - 1)], acc[kk]);
                }
#pragma unroll
                for (int kk = 0; kk < DK; ++kk) {
                    int d = lane + 32 * kk;
                    if (d < HEAD_DIM) dq[(size_t)Rw * HEAD_DIM + d] += scale * acc[kk];
                }
            }
        }
        // Alg.4 L25: dK_j = scale dK~_j, dV_j = dV~_j to HBM (every key tile is visited, so all are written).
#pragma unroll
        for (int cc = 0; cc < BC / 4; ++cc) {
            int C = j * BC + warp + 4 * cc;
#pragma unroll
            for (int kk = 0; kk < DK; ++kk) {
                int d = lane + 32 * kk;
                if (C < Nk && d < HEAD_DIM) {
                    dk[(size_t)C * HEAD_DIM + d] = scale * dK_acc[cc][kk];
                    dv[(size_t)C * HEAD_DIM + d] = dV_acc[cc][kk];
                }
            }
        }
    }
}
