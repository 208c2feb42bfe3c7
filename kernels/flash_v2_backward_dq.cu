// flash_v2_backward_dq.cu: version tc's deterministic dQ pass (deterministic=True), Alg.2 L15 reordered. The main
// kernel (flash_v2_backward_tc.cu, DQ_ATOMIC = false) writes dK, dV only; this kernel computes
//   dQ_i = scale * sum_j dS_ij K_j
// with a block per (Q tile i, batch*head), 4 warps x 16 rows of Q_i, looping over the K/V tiles j (K_j, V_j
// double-buffered by cp.async) and recomputing S_ij = Q_i K_j^T, dP_ij = dO_i V_j^T, dS_ij; dQ_i stays in registers.
// No atomics: the same summation order every run, so dQ is bit-identical across runs, for one more S and dP.
//
// Run: python stages/03_flash_v2_backward/run.py --version tc --deterministic   (tests: pytest
//      tests/test_03_flash_v2_backward.py)
#include "backward_tiles.cuh"
#include "params.cuh"

// Keys per K/V tile: 64; 32 at d = 256, where a warp's 16 x 256 dQ_i takes 128 registers a thread beside S and dP.
template <int HD>
__host__ __device__ constexpr int dq_bc() { return HD > 128 ? 32 : 64; }

// grid = (BH, ceil(Nq / 64)), 128 threads; warp w owns rows 16w..16w+15 of Q_i. One BwdParams (params.cuh): q, dO
// (BH, Nq, HD); k, v (BH, Nk, HD); L_i, D_i (BH, Nq_pad) from bwd_preprocess; dQ (BH, Nq, HD) of TO, written once.
template <typename T, typename TO, int HD>
__global__ void __launch_bounds__(128) flash_v2_backward_dq_tc(const __grid_constant__ BwdParams p) {
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float scale = p.scale;
    constexpr int Br = 64, Bc = dq_bc<HD>(), NT = 128, LDK = HD + 8, NS = Bc / 8, ND = HD / 8;
    // dynamic shared memory: Q_i, dO_i once, K_j and V_j double-buffered (the launcher's smem_bytes adds it up)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);
    T* dOs = Qs + Br * LDK;
    T* Ks = dOs + Br * LDK;      // [2][Bc][LDK]
    T* Vs = Ks + 2 * Bc * LDK;   // [2][Bc][LDK]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, mi = lane / 8;
    // grid = (BH, Tr); under causal the last Q tiles see the most keys: start them first
    const int i = gridDim.y - 1 - blockIdx.y;
    const long bh = blockIdx.x;
    const int off = Nk - Nq;
    const T* __restrict__ Q = static_cast<const T*>(p.q) + bh * Nq * HD;  // this head's rows
    const T* __restrict__ dO = static_cast<const T*>(p.dO) + bh * Nq * HD;
    TO* __restrict__ dQ = static_cast<TO*>(p.dQ) + bh * Nq * HD;
    const T* __restrict__ K = static_cast<const T*>(p.k) + bh * Nk * HD;
    const T* __restrict__ V = static_cast<const T*>(p.v) + bh * Nk * HD;
    const float* __restrict__ L2g = p.L_i + bh * p.Nq_pad;
    const float* __restrict__ Dg = p.D_i + bh * p.Nq_pad;

    // this thread's two query rows (g, g+8 of the warp's 16): L_i * log2 e and D_i in registers
    const int q_lo = i * Br + 16 * warp + g;
    const float L_row[2] = {L2g[q_lo], L2g[q_lo + 8]}, D_row[2] = {Dg[q_lo], Dg[q_lo + 8]};

    const int Tc = (Nk + Bc - 1) / Bc;
    const int last_kv = min(Nq - 1, i * Br + Br - 1) + off;  // causal: no K tile past the last row's keys
    const int j_end = !causal ? Tc : (last_kv < 0 ? 0 : min(Tc, last_kv / Bc + 1));

    load_tile_async<T, Br, HD, LDK, NT>(Qs, Q, i * Br, Nq, tid);
    load_tile_async<T, Br, HD, LDK, NT>(dOs, dO, i * Br, Nq, tid);
    if (j_end > 0) {
        load_tile_async<T, Bc, HD, LDK, NT>(Ks, K, 0, Nk, tid);
        load_tile_async<T, Bc, HD, LDK, NT>(Vs, V, 0, Nk, tid);
    }
    cp_async_commit();

    float dq[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[n][e] = 0.f;
    // this lane's ldmatrix rows as 32-bit shared addresses (as in flash_v2_backward_tc): A operands, this warp's
    // rows of Q_i, dO_i; B operands, rows of K_j, V_j as they are (S, dP) and through .trans (dQ), in buffer 0
    const u32 qa_base = smem_u32(Qs + (16 * warp + lane % 16) * LDK + (lane / 16) * 8);
    const u32 oa_base = smem_u32(dOs + (16 * warp + lane % 16) * LDK + (lane / 16) * 8);
    const u32 kb_base = smem_u32(Ks + ((mi / 2) * 8 + lane % 8) * LDK + (mi % 2) * 8);
    const u32 vb_base = smem_u32(Vs + ((mi / 2) * 8 + lane % 8) * LDK + (mi % 2) * 8);
    const u32 kt_base = smem_u32(Ks + ((mi % 2) * 8 + lane % 8) * LDK + (mi / 2) * 8);

    for (int j = 0; j < j_end; ++j) {
        const int buf = j & 1;
        cp_async_wait<0>();  // K_j, V_j (and Q_i, dO_i) have landed for this thread
        __syncthreads();     // ... for every thread; and every warp is done with K_{j-1}, V_{j-1}
        if (j + 1 < j_end) {  // prefetch K_{j+1}, V_{j+1} into the buffer tile j-1 used
            load_tile_async<T, Bc, HD, LDK, NT>(Ks + (buf ^ 1) * Bc * LDK, K, (j + 1) * Bc, Nk, tid);
            load_tile_async<T, Bc, HD, LDK, NT>(Vs + (buf ^ 1) * Bc * LDK, V, (j + 1) * Bc, Nk, tid);
        }
        cp_async_commit();
        const u32 tile = 2 * buf * Bc * LDK;  // byte offset of K_j, V_j's buffer

        // S_ij = Q_i K_j^T, dP_ij = dO_i V_j^T for this warp's 16 query rows
        float s[NS][4], dp[NS][4];
        zero(s), zero(dp);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 aq[4], ao[4];
            ldsm_x4(aq, qa_base + 2 * kk * 16);
            ldsm_x4(ao, oa_base + 2 * kk * 16);
#pragma unroll
            for (int np = 0; np < Bc / 16; ++np) {
                u32 bk[4], bv[4];
                ldsm_x4(bk, kb_base + tile + 2 * (np * 16 * LDK + kk * 16));
                ldsm_x4(bv, vb_base + tile + 2 * (np * 16 * LDK + kk * 16));
                mma_16816<T>(s[2 * np], aq, bk);
                mma_16816<T>(s[2 * np + 1], aq, bk + 2);
                mma_16816<T>(dp[2 * np], ao, bv);
                mma_16816<T>(dp[2 * np + 1], ao, bv + 2);
            }
        }
        // Alg.2 L11-13: P_ij, dS_ij (p_and_ds), dS_ij packed as A fragments
        const bool need_mask = (j * Bc + Bc > Nk) || (causal && i * Br + off < j * Bc + Bc - 1);
        u32 dsa[Bc / 16][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kv = j * Bc + n * 8 + 2 * t + (e % 2), q = q_lo + (e / 2) * 8;
                const bool visible = !need_mask || !(kv >= Nk || (causal && kv > q + off));
                float p;
                p_and_ds(p, ds[e], s[n][e], dp[n][e], L_row[e / 2], D_row[e / 2], scale, visible);
            }
            c_to_a<T>(dsa[n / 2], n, ds);
        }
        // dQ_i += dS_ij K_j, B[kv][d] = K_j[kv][d] through ldmatrix .trans
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < HD / 16; ++np) {
                u32 b[4];
                ldsm_x4_trans(b, kt_base + tile + 2 * (kk * 16 * LDK + np * 16));
                mma_16816<T>(dq[2 * np], dsa[kk], b);
                mma_16816<T>(dq[2 * np + 1], dsa[kk], b + 2);
            }
        }
    }
    // dQ_i = scale * sum_j dS_ij K_j
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int q = q_lo + 8 * h;
        if (q < Nq) {
#pragma unroll
            for (int n = 0; n < ND; ++n)
                store2(dQ + (long)q * HD + n * 8 + 2 * t, scale * dq[n][2 * h], scale * dq[n][2 * h + 1]);
        }
    }
}
