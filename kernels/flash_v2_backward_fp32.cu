// flash_v2_backward_fp32.cu: FlashAttention-2 backward, version "fp32": float32 on CUDA cores (the readable one).
//
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 2; L_i = the forward's lse, D_i = rowsum(dO_i * O_i).
//   for j in K/V tiles (one block each):      load K_j, V_j; dK_j = dV_j = 0 on chip           (Alg.2 L5-L7)
//     for i in Q tiles (causal: from the first one that sees K_j):                               (L8)
//       load Q_i, dO_i, L_i, D_i; P_ij = exp(scale Q_i K_j^T - L_i)                              (L9-L11)
//       dV_j += P_ij^T dO_i; dP_ij = dO_i V_j^T; dS_ij = P_ij * (dP_ij - D_i)                    (L12-L14)
//       dQ_i += dS_ij K_j (atomic); dK_j += dS_ij^T Q_i                                          (L15-L16)
//     write dK_j = scale dK_j, dV_j                                                              (L18-L19)
// What changes from stage 01's backward (flash_v1_backward.cu), and why:
//   * one block per (K/V tile, head) instead of one per head: Tc * B * H blocks fill the GPU;
//   * D_i is computed once, by bwd_preprocess (flash_v2_backward_pre.cu), not at every step;
//   * dQ_i is added by atomicAdd into one fp32 buffer (other K/V blocks add to the same rows at the same time).
// flash_bwd_fp32<HD, DQ_ATOMIC>: the loop above (without DQ_ATOMIC it skips dQ); flash_bwd_dq_fp32<HD>: the
// deterministic dQ pass, one block per (Q tile, head) sums dQ_i = scale sum_j dS_ij K_j in a fixed order.
// Br = Bc = 32, 256 threads; shared rows padded to HD+1 floats. Scalar loops; version "tc" is the fast one.
// Each kernel takes one BwdParams (params.cuh) and reads the fields it needs.
// Run: python stages/03_flash_v2_backward/run.py --version fp32   (tests: pytest tests/test_03_flash_v2_backward.py)
#include "common.cuh"
#include "params.cuh"

constexpr int Br = 32;   // query rows per tile (Q_i, dO_i)
constexpr int Bc = 32;   // key rows per tile (K_j, V_j)
constexpr int NT = 256;  // threads per block

// Shared memory (floats): K_j, V_j, Q_i, dO_i padded to HD+1 columns (no bank conflicts on column walks),
// P_ij and dS_ij (Bc x Br, padded), L_i and D_i.
template <int HD>
__host__ __device__ constexpr int smem_floats_main() {
    return 2 * Bc * (HD + 1) + 2 * Br * (HD + 1) + 2 * Bc * (Br + 1) + 2 * Br;
}

// q, dO: (BH, Nq, HD); k, v: (BH, Nk, HD); L_i, D_i: (BH, Nq_pad) from bwd_preprocess (natural log, +inf for
// masked rows); dQ_accum: (BH, Nq, HD) fp32, zeroed; dK, dV: (BH, Nk, HD). grid = (Tc, BH), block = 256.
template <int HD, bool DQ_ATOMIC>
__global__ void __launch_bounds__(NT) flash_bwd_fp32(const __grid_constant__ BwdParams p) {
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float scale = p.scale;
    extern __shared__ float smem[];
    constexpr int LD = HD + 1, LS = Br + 1, U = HD / 8;
    float* Ks = smem;
    float* Vs = Ks + Bc * LD;
    float* Qs = Vs + Bc * LD;
    float* dOs = Qs + Br * LD;
    float* Ps = dOs + Br * LD;   // P_ij^T: Ps[c * LS + r]
    float* dSs = Ps + Bc * LS;   // dS_ij^T
    float* Ls = dSs + Bc * LS;
    float* Ds = Ls + Br;

    const int tid = threadIdx.x, j = blockIdx.x;
    const long bh = blockIdx.y;
    const int off = Nk - Nq;  // bottom-right causal alignment: query q sees key kv iff kv <= q + off
    const float* __restrict__ Q = static_cast<const float*>(p.q) + bh * Nq * HD;  // this head's rows
    const float* __restrict__ dO = static_cast<const float*>(p.dO) + bh * Nq * HD;
    float* __restrict__ dQacc = p.dQ_accum + bh * Nq * HD;
    const float* __restrict__ K = static_cast<const float*>(p.k) + bh * Nk * HD;
    const float* __restrict__ V = static_cast<const float*>(p.v) + bh * Nk * HD;
    float* __restrict__ dK = static_cast<float*>(p.dK) + bh * Nk * HD;
    float* __restrict__ dV = static_cast<float*>(p.dV) + bh * Nk * HD;
    const float* __restrict__ Lg = p.L_i + bh * p.Nq_pad;
    const float* __restrict__ Dg = p.D_i + bh * p.Nq_pad;

    // Alg.2 L6: load K_j, V_j (rows past Nk read as 0)
    for (int e = tid; e < Bc * HD; e += NT) {
        const int c = e / HD, d = e % HD, kv = j * Bc + c;
        Ks[c * LD + d] = kv < Nk ? K[(long)kv * HD + d] : 0.f;
        Vs[c * LD + d] = kv < Nk ? V[(long)kv * HD + d] : 0.f;
    }
    // Alg.2 L7: dK_j = dV_j = 0. This thread owns row c = tid / 8, columns d = tid % 8 + 8u.
    const int c = tid / 8, d0 = tid % 8;
    float dk[U], dv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) dk[u] = dv[u] = 0.f;

    // Causal: Q rows q < j*Bc - off see none of K_j; start at the first Q tile that sees some of it.
    const int Tr = (Nq + Br - 1) / Br;
    const int i_begin = causal ? max(0, j * Bc - off) / Br : 0;
    for (int i = i_begin; i < Tr; ++i) {  // Alg.2 L8
        __syncthreads();  // every thread is done with the previous Q_i, dO_i, P_ij, dS_ij (and K_j, V_j are stored)
        // Alg.2 L9: load Q_i, dO_i, L_i, D_i
        for (int e = tid; e < Br * HD; e += NT) {
            const int r = e / HD, d = e % HD, q = i * Br + r;
            Qs[r * LD + d] = q < Nq ? Q[(long)q * HD + d] : 0.f;
            dOs[r * LD + d] = q < Nq ? dO[(long)q * HD + d] : 0.f;
        }
        if (tid < Br) { Ls[tid] = Lg[i * Br + tid]; Ds[tid] = Dg[i * Br + tid]; }
        __syncthreads();  // Q_i, dO_i, L_i, D_i are in shared memory before anyone reads them

        // Alg.2 L10-13: entries (c, r) of the Bc x Br tile, r = tid % 8 + 8u
#pragma unroll
        for (int u = 0; u < Br / 8; ++u) {
            const int r = d0 + 8 * u, q = i * Br + r, kv = j * Bc + c;
            // S_ij summed in double: at huge logits an fp32 sum's rounding would move the exponent, and P with it
            double s = 0.0;
            float dp = 0.f;
            for (int d = 0; d < HD; ++d) {
                s += (double)Ks[c * LD + d] * (double)Qs[r * LD + d];  // S_ij = Q_i K_j^T (unscaled)
                dp += Vs[c * LD + d] * dOs[r * LD + d];                // dP_ij = dO_i V_j^T
            }
            const bool visible = q < Nq && kv < Nk && (!causal || kv <= q + off);
            const float p = visible ? expf((float)(s * scale - Ls[r])) : 0.f;  // P_ij = exp(scale S_ij - L_i)
            Ps[c * LS + r] = p;
            dSs[c * LS + r] = p * (dp - Ds[r]);  // dS_ij = P_ij * (dP_ij - D_i)
        }
        __syncthreads();  // all of P_ij and dS_ij are written before the products read whole columns

        // Alg.2 L11, L14: dV_j += P_ij^T dO_i;  dK_j += dS_ij^T Q_i (scale applied at the end)
        for (int r = 0; r < Br; ++r) {
            const float p = Ps[c * LS + r], ds = dSs[c * LS + r];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                dv[u] += p * dOs[r * LD + d0 + 8 * u];
                dk[u] += ds * Qs[r * LD + d0 + 8 * u];
            }
        }
        if (DQ_ATOMIC) {
            // Alg.2 L15: dQ_i += dS_ij K_j, entry (r = tid / 8, d0 + 8u); other K/V blocks add to the
            // same rows at the same time, hence atomicAdd on the fp32 accumulator.
            const int r = tid / 8, q = i * Br + r;
            if (q < Nq) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    float acc = 0.f;
                    for (int cc = 0; cc < Bc; ++cc) acc += dSs[cc * LS + r] * Ks[cc * LD + d0 + 8 * u];
                    atomicAdd(&dQacc[(long)q * HD + d0 + 8 * u], acc);
                }
            }
        }
    }
    // Alg.2 L19: write dK_j = scale * dS^T Q, dV_j
    const int kv = j * Bc + c;
    if (kv < Nk) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            dK[(long)kv * HD + d0 + 8 * u] = scale * dk[u];
            dV[(long)kv * HD + d0 + 8 * u] = dv[u];
        }
    }
}

template <int HD>
__host__ __device__ constexpr int smem_floats_dq() {
    return 2 * Bc * (HD + 1) + 2 * Br * (HD + 1) + Br * (Bc + 1) + 2 * Br;
}

// Deterministic dQ pass: grid = (Tr, BH), block = 256. dQ: (BH, Nq, HD), written once, no atomics.
template <int HD>
__global__ void __launch_bounds__(NT) flash_bwd_dq_fp32(const __grid_constant__ BwdParams p) {
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float scale = p.scale;
    extern __shared__ float smem[];
    constexpr int LD = HD + 1, LS = Bc + 1, U = HD / 8;
    float* Qs = smem;
    float* dOs = Qs + Br * LD;
    float* Ks = dOs + Br * LD;
    float* Vs = Ks + Bc * LD;
    float* dSs = Vs + Bc * LD;  // dS_ij: dSs[r * LS + c]
    float* Ls = dSs + Br * LS;
    float* Ds = Ls + Br;

    const int tid = threadIdx.x, i = blockIdx.x;
    const long bh = blockIdx.y;
    const int off = Nk - Nq;
    const float* __restrict__ Q = static_cast<const float*>(p.q) + bh * Nq * HD;  // this head's rows
    const float* __restrict__ dO = static_cast<const float*>(p.dO) + bh * Nq * HD;
    float* __restrict__ dQ = static_cast<float*>(p.dQ) + bh * Nq * HD;
    const float* __restrict__ K = static_cast<const float*>(p.k) + bh * Nk * HD;
    const float* __restrict__ V = static_cast<const float*>(p.v) + bh * Nk * HD;
    const float* __restrict__ Lg = p.L_i + bh * p.Nq_pad;
    const float* __restrict__ Dg = p.D_i + bh * p.Nq_pad;

    for (int e = tid; e < Br * HD; e += NT) {  // Q_i, dO_i
        const int r = e / HD, d = e % HD, q = i * Br + r;
        Qs[r * LD + d] = q < Nq ? Q[(long)q * HD + d] : 0.f;
        dOs[r * LD + d] = q < Nq ? dO[(long)q * HD + d] : 0.f;
    }
    if (tid < Br) { Ls[tid] = Lg[i * Br + tid]; Ds[tid] = Dg[i * Br + tid]; }
    // This thread owns dQ_i row r = tid / 8, columns d0 + 8u.
    const int r = tid / 8, d0 = tid % 8, q = i * Br + r;
    float dq[U];
#pragma unroll
    for (int u = 0; u < U; ++u) dq[u] = 0.f;

    // Causal: the last row of this tile sees keys up to q_last + off; later K tiles are skipped.
    const int Tc = (Nk + Bc - 1) / Bc;
    const int last_kv = min(Nq - 1, i * Br + Br - 1) + off;
    const int j_end = !causal ? Tc : (last_kv < 0 ? 0 : min(Tc, last_kv / Bc + 1));
    for (int j = 0; j < j_end; ++j) {
        __syncthreads();  // the previous K_j, V_j, dS_ij are no longer read (and Q_i, dO_i are stored)
#pragma unroll 1  // rolled: unrolled, each copy's indices would hold registers through the j loop
        for (int e = tid; e < Bc * HD; e += NT) {
            const int cc = e / HD, d = e % HD, kv = j * Bc + cc;
            Ks[cc * LD + d] = kv < Nk ? K[(long)kv * HD + d] : 0.f;
            Vs[cc * LD + d] = kv < Nk ? V[(long)kv * HD + d] : 0.f;
        }
        __syncthreads();  // K_j, V_j are in shared memory
        // dS_ij entries (r, c = d0 + 8u)
#pragma unroll
        for (int u = 0; u < Bc / 8; ++u) {
            const int cc = d0 + 8 * u, kv = j * Bc + cc;
            double s = 0.0;  // in double, as in flash_bwd_fp32
            float dp = 0.f;
            for (int d = 0; d < HD; ++d) {
                s += (double)Qs[r * LD + d] * (double)Ks[cc * LD + d];  // S_ij
                dp += dOs[r * LD + d] * Vs[cc * LD + d];                // dP_ij
            }
            const bool visible = q < Nq && kv < Nk && (!causal || kv <= q + off);
            const float p = visible ? expf((float)(s * scale - Ls[r])) : 0.f;
            dSs[r * LS + cc] = p * (dp - Ds[r]);  // dS_ij = P_ij * (dP_ij - D_i)
        }
        __syncthreads();  // row r of dS_ij is complete (written by the 8 threads that share r)
        // dQ_i += dS_ij K_j, in the same order every run
        for (int cc = 0; cc < Bc; ++cc) {
            const float ds = dSs[r * LS + cc];
#pragma unroll
            for (int u = 0; u < U; ++u) dq[u] += ds * Ks[cc * LD + d0 + 8 * u];
        }
    }
    if (q < Nq) {
#pragma unroll
        for (int u = 0; u < U; ++u) dQ[(long)q * HD + d0 + 8 * u] = scale * dq[u];
    }
}
