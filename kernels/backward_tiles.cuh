// backward_tiles.cuh: what the tensor-core backward kernels (flash_v2_backward_tc.cu, flash_v2_backward_dq.cu) and
// their headers share: Alg.2 L11-13 for one score, the cp.async copies of the tiles Q_i, dO_i, K_j, V_j to shared
// memory, and the store of an accumulator fragment, as 16-bit pairs, to a transposed tile in shared memory.
#pragma once
#include "common.cuh"

// Alg.2 L11-13 for one score: P_ij = exp(scale S_ij - L_i) (0 where the key is masked), dS_ij = P_ij (dP_ij - D_i).
// scale S_ij - L_i is one FMA (one rounding, of a number near 0), then times log2 e for exp2.
__device__ __forceinline__ void p_and_ds(float& p, float& ds, float s, float dp, float L, float D, float scale,
                                         bool visible) {
    p = visible ? fast_exp2(fmaf(s, scale, -L) * LOG2E_F) : 0.f;
    ds = p * (dp - D);
}

// A tile of ROWS rows x HD 16-bit values (rows row0.. of an (N, HD) matrix) to shared memory of row stride LD, 16
// bytes per cp.async; rows >= N are zero-filled (source clamped to row 0). Pass k copies chunk tid % CHUNKS of row
// tid / CHUNKS + k RSTEP: one shared and one global base, compile-time offsets from them. A kernel may issue the
// passes one at a time between other work (flash_v2_backward_tc prefetches Q_{i+1} between the mma of S^T, dP^T).
template <typename T, int ROWS, int HD, int LD, int NTHREADS>
struct TileCopy {
    static constexpr int CHUNKS = HD / 8, RSTEP = NTHREADS / CHUNKS;  // 16-byte chunks per row; rows per pass
    static constexpr int PASSES = (ROWS + RSTEP - 1) / RSTEP;
    static_assert(NTHREADS % CHUNKS == 0, "a pass of the block covers whole rows");
    u32 d0;
    const T* s0;
    const T* src;
    int r0;    // this thread's first row of the tile
    int left;  // rows of the tile from this thread's first row to the end of the matrix
    __device__ __forceinline__ TileCopy(T* dst, const T* src_, int row0, int N, int tid) {
        r0 = tid / CHUNKS;
        const int c = (tid % CHUNKS) * 8;
        d0 = smem_u32(dst + r0 * LD + c);
        s0 = src_ + ((long)row0 + r0) * HD + c;
        src = src_;
        left = row0 + ROWS <= N ? ROWS : N - row0 - r0;  // ROWS: the whole tile is there
    }
    __device__ __forceinline__ void pass(int k) const {
        const int tid_row = RSTEP * k;  // + this thread's first row
        if (ROWS % RSTEP != 0 && r0 + tid_row >= ROWS) return;
        if (left == ROWS) {
            cp_async_16_u32(d0 + 2 * tid_row * LD, s0 + tid_row * HD);
        } else {
            const bool ok = tid_row < left;
            cp_async_16_u32(d0 + 2 * tid_row * LD, ok ? s0 + tid_row * HD : src, ok);
        }
    }
};

// All passes of a TileCopy at once.
template <typename T, int ROWS, int HD, int LD, int NTHREADS>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int row0, int N, int tid) {
    const TileCopy<T, ROWS, HD, LD, NTHREADS> copy(dst, src, row0, N, tid);
#pragma unroll
    for (int k = 0; k < copy.PASSES; ++k) copy.pass(k);
}

// One thread's part of an mma accumulator tile as 16-bit pairs: (row g, columns 2t, 2t + 1) at row, (row g + 8, the
// same columns) at row + 8 LD, of a shared matrix of row stride LD (P_ij^T and dS_ij^T: backward_warp_pairs.cuh,
// backward_dq.cuh).
template <int LD, typename T>
__device__ __forceinline__ void store_row_pair(T* row, u32 lo, u32 hi) {
    *reinterpret_cast<u32*>(row) = lo;
    *reinterpret_cast<u32*>(row + 8 * LD) = hi;
}
