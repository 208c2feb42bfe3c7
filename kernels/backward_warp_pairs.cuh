// backward_warp_pairs.cuh: the warp-pair layout of the tensor-core backward kernel (flash_v2_backward_tc.cu, WQ = 2;
// FA2's layout). With WQ = 1, warp w owns key rows 16w..16w+15 of K_j, V_j, dK_j, dV_j for all four matmuls of a
// tile pair, and P_ij^T, dS_ij^T stay in its registers. With WQ = 2 the warps work in pairs over 32 key rows:
//   1. each warp of a pair computes S_ij^T, dP_ij^T for the 32 rows x half of the chunk's queries;
//   2. it stores its part of P_ij^T and dS_ij^T to shared memory (store_pt_dst);
//   3. it waits for its partner only: a named barrier for the pair's 64 threads (group_sync);
//   4. it computes dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i for the 32 rows x half of the columns, reading the
//      pair's rows of P_ij^T, dS_ij^T back as A fragments (load_pt_dst).
// A row of Q_i or dO_i read from shared memory then serves 32 key rows, not 16, for one store and one load of P^T
// and dS^T (Bc x (Br + 8) more 16-bit values of shared memory). The two layouts share the kernel's loop (if constexpr
// on WQ there); this header holds the pair layout's steps.
#pragma once
#include "backward_tiles.cuh"

// Step 2: rows kr, kr + 8 of P_ij^T and dS_ij^T, this thread's two query columns (pt, dst: row kr, the first column),
// from one n-tile of fp32 accumulator entries p, ds (e = 0, 1: row kr; 2, 3: row kr + 8), rounded to T.
template <int LD, typename T>
__device__ __forceinline__ void store_pt_dst(T* pt, T* dst, const float (&p)[4], const float (&ds)[4]) {
    store_row_pair<LD>(pt, Half2<T>::pack(p[0], p[1]), Half2<T>::pack(p[2], p[3]));
    store_row_pair<LD>(dst, Half2<T>::pack(ds[0], ds[1]), Half2<T>::pack(ds[2], ds[3]));
}

// Step 3: bar.sync on named barrier `id` (1..15; __syncthreads is 0) for `n` threads: the WQ warps of one key group.
__device__ __forceinline__ void group_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Step 4: the A fragments of k step kk (16 queries) of this warp's MS m-tiles of P_ij^T and dS_ij^T, from this lane's
// ldmatrix addresses pa, da (row, + chunk offset) of the two tiles of row stride LD.
template <int MS, int LD>
__device__ __forceinline__ void load_pt_dst(u32 (&apl)[MS][4], u32 (&adl)[MS][4], u32 pa, u32 da, int kk) {
#pragma unroll
    for (int mt = 0; mt < MS; ++mt) {
        ldsm_x4(apl[mt], pa + 2 * (mt * 16 * LD + kk * 16));
        ldsm_x4(adl[mt], da + 2 * (mt * 16 * LD + kk * 16));
    }
}
