// backward_warp_pairs.cuh: the warp-pair layout of the main backward kernel (flash_v2_backward_tc.cu, WQ = 2; FA2's
// layout). With WQ = 1, warp w owns key rows 16w..16w+15 of K_j, V_j, dK_j, dV_j for all four matmuls of a tile
// pair, and P_ij^T, dS_ij^T stay in its registers. With WQ = 2 the warps work in pairs over 32 key rows:
//   1. each warp of a pair computes S_ij^T, dP_ij^T for the 32 rows x half of the chunk's queries;
//   2. it stores its part of P_ij^T and dS_ij^T to shared memory (store_row_pair);
//   3. it waits for its partner only: a named barrier for the pair's 64 threads (group_sync);
//   4. it computes dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i for the 32 rows x half of the columns.
// A row of Q_i or dO_i read from shared memory then serves 32 key rows, not 16, for one store and one load of P^T
// and dS^T (Bc x (Br + 8) more 16-bit values of shared memory). The two layouts share the kernel's loop (if constexpr
// on WQ there); this header holds the layout's two primitives.
#pragma once
#include "common.cuh"

// One thread's part of an mma accumulator tile as 16-bit pairs: (row g, columns 2t, 2t + 1) at row, (row g + 8, the
// same columns) at row + 8 LD, of a shared matrix of row stride LD. WQ = 2: P^T and dS^T, for the partner warp;
// WQ = 1: dS^T only, for the dQ step (all warps read it).
template <int LD, typename T>
__device__ __forceinline__ void store_row_pair(T* row, u32 lo, u32 hi) {
    *reinterpret_cast<u32*>(row) = lo;
    *reinterpret_cast<u32*>(row + 8 * LD) = hi;
}

// bar.sync on named barrier `id` (1..15; __syncthreads is 0) for `n` threads: the WQ warps of one key group.
__device__ __forceinline__ void group_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
