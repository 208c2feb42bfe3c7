// backward_dq.cuh: the atomic dQ pass of the tensor-core backward kernel (flash_v2_backward_tc.cu with DQ_ATOMIC),
// Alg.2 L15, dQ_i += dS_ij K_j, and its end, Alg.2 L21, dQ = dQ_accum. The sum runs over the block's Bc key rows (all
// its warps) and over every K/V block j:
//   * dS_ij^T goes through shared memory (store_ds_t; with the warp pairs, WQ = 2, it is there already); the Bc / 16
//     warps split dQ_i (Br x HDP) into tiles of 16 MT x NCOL, one per warp (32 x 32 at d = 64 and 128): dq_tile_atomic;
//   * each lane adds its accumulator's two consecutive columns of a row to the fp32 dQ_accum with one
//     red.global.add.v2.f32 (sm_90; two atomicAdd before), every address one base register plus an immediate;
//   * DEFER_DQ: tile i's step runs at the end of tile i+1 (dS^T double-buffered): one barrier per tile, not two;
//   * the head's last block to finish (a counter per head) writes dQ = dQ_accum (convert_dq_by_last_block), or, on
//     long heads, bwd_convert_dq does after the kernel (the launcher's fuse_dq_rule).
// The deterministic dQ pass has no atomics: flash_v2_backward_dq.cu. red_add_f32x2 also serves the fp32x3 kernel and
// stage 06's backward (hopper_bwd_tiles.cuh).
#pragma once
#include "backward_tiles.cuh"

// row[OFF], row[OFF + 1] += a, b, atomically (8-byte aligned; sm_90: one vector reduction at row + an immediate).
template <int OFF>
__device__ __forceinline__ void red_add_f32x2(float* row, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0+%3], {%1, %2};" ::"l"(row), "f"(a), "f"(b), "n"(4 * OFF) : "memory");
#else
    atomicAdd(row + OFF, a);
    atomicAdd(row + OFF + 1, b);
#endif
}

// One lane's dQ reductions, m-tiles 0..M-1 (NQ n-tiles each): rows q + 16 m (entries 0-1) and q + 16 m + 8 (2-3),
// columns 8 n + 2t.. from `row` (row q, column 2t). A template recursion, so every offset is an immediate. rows: rows
// from q that exist (CHECK = false: the tile has all its rows, no test).
template <int M, int NQ, int HD, bool CHECK>
__device__ __forceinline__ void red_dq(float* row, const float (*dq)[NQ][4], int rows) {
    if constexpr (M > 0) {
        red_dq<M - 1, NQ, HD, CHECK>(row, dq, rows);
        constexpr int m = M - 1;
#pragma unroll
        for (int n = 0; n < NQ; ++n) {  // unrolled: n is a constant in each copy
            if (!CHECK || 16 * m < rows) red_add_f32x2<16 * m * HD>(row + 8 * n, dq[m][n][0], dq[m][n][1]);
            if (!CHECK || 16 * m + 8 < rows) red_add_f32x2<(16 * m + 8) * HD>(row + 8 * n, dq[m][n][2], dq[m][n][3]);
        }
    }
}

// Alg.2 L15 for one Q tile: dQ_i += scale dS_ij K_j, from dS_ij^T in shared memory, for the HDP columns pc.. this
// block adds (HDP = HD unless d = 256 splits the head dim). Warp `warp` takes 16 MT rows x NCOL columns of dQ_i and
// adds them to dQacc with atomics (other K/V blocks add to the same rows).
template <typename T, int HD, int HDP, int Br, int Bc, int MT, int LDK, int LDS>
__device__ __forceinline__ void dq_tile_atomic(const T* dSt, const T* Ks, float* dQacc, int q_tile0, int Nq,
                                               float scale, int pc, int warp, int lane) {
    constexpr int NW = Bc / 16;  // warps in the block
    constexpr int RG = Br / (16 * MT), NCOL = HDP / (NW / RG), NQ = NCOL / 8;  // warp -> rows qr0.., columns dc0..
    static_assert(NW % RG == 0 && NQ % 2 == 0, "dQ_i split: the warps must cover Br / (16 MT) row groups evenly");
    const int g = lane / 4, t = lane % 4, mi = lane / 8;
    const int qr0 = 16 * MT * (warp % RG), dc0 = pc + (warp / RG) * NCOL;
    // this lane's ldmatrix rows as 32-bit shared addresses; the loops below add compile-time byte offsets
    const u32 a_base = smem_u32(dSt + ((mi / 2) * 8 + lane % 8) * LDS + qr0 + (mi % 2) * 8);
    const u32 b_base = smem_u32(Ks + ((mi % 2) * 8 + lane % 8) * LDK + dc0 + (mi / 2) * 8);
    float dq[MT][NQ][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[m][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
        u32 a[MT][4];  // A[q][kv] = dS^T[kv][q]: stored transposed, so ldmatrix .trans
#pragma unroll
        for (int m = 0; m < MT; ++m)
            ldsm_x4_trans(a[m], a_base + 2 * (kk * 16 * LDS + 16 * m));
#pragma unroll
        for (int np = 0; np < NQ / 2; ++np) {
            u32 b[4];  // B[kv][d] = K_j[kv][d]
            ldsm_x4_trans(b, b_base + 2 * (kk * 16 * LDK + np * 16));
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma_16816<T>(dq[m][2 * np], a[m], b);
                mma_16816<T>(dq[m][2 * np + 1], a[m], b + 2);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)  // dQ_i += scale dS_ij K_j: the accumulator holds dQ itself, whoever reads it
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[m][n][e] *= scale;
    const int q = q_tile0 + qr0 + g;  // this lane's first row
    float* row = dQacc + (long)q * HD + dc0 + 2 * t;
    if (q_tile0 + Br <= Nq)  // the same for the whole block
        red_dq<MT, NQ, HD, false>(row, dq, Nq - q);
    else
        red_dq<MT, NQ, HD, true>(row, dq, Nq - q);
}

// WQ = 1: this warp's rows of dS_ij^T (16 warp + g, + 8; columns 8n + 2t, + 1 of the chunk at row), from its packed
// A fragments (n-tiles 2kk, 2kk + 1 in dsa[kk]: c_to_a's layout), to shared memory, where every warp's dQ tile reads
// all Bc rows.
template <int NS, int LD, typename T>
__device__ __forceinline__ void store_ds_t(T* row, const u32 (&dsa)[NS / 2][4]) {
#pragma unroll
    for (int n = 0; n < NS; ++n) store_row_pair<LD>(row + n * 8, dsa[n / 2][(n % 2) * 2], dsa[n / 2][(n % 2) * 2 + 1]);
}

// Alg.2 L21: dQ = dQ_accum cast to TQ (the atomics added scale dS K), n4 groups of 4 values, by the last of the
// head's `blocks` blocks to finish: each block fences its atomics, then counts itself done (done: the head's
// counter); the one completing the count converts the head.
template <int NT, typename TQ>
__device__ __forceinline__ void convert_dq_by_last_block(const float* dQacc, TQ* dQ, int* done, int blocks, long n4,
                                                         int tid) {
    __threadfence();  // this thread's dQ atomics are performed before the block's count below
    __syncthreads();  // ... for every thread of the block
    bool last = false;
    if (tid == 0) last = atomicAdd(done, 1) == blocks - 1;
    if (__syncthreads_or(last)) {
        __threadfence();  // the other blocks' atomics, made visible by their fences, before the reads
        convert_dq<16>(dQacc, dQ, 1.f, n4, tid, NT);  // 16 loads in flight
    }
}
