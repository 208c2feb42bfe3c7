// backward_dq.cuh: the atomic dQ step of the main backward kernel (flash_v2_backward_tc.cu with DQ_ATOMIC), Alg.2
// L15, dQ_i += dS_ij K_j. The sum runs over the block's Bc key rows (all its warps) and over every K/V block j:
//   * dS_ij^T goes through shared memory; the Bc / 16 warps split dQ_i (Br x HDP) into tiles of 16 MT x NCOL,
//     one per warp (32 x 32 at d = 64 and 128);
//   * each lane adds its accumulator's two consecutive columns of a row to the fp32 dQ_accum with one
//     red.global.add.v2.f32 (sm_90; two atomicAdd before), every address one base register plus an immediate;
//   * DEFER_DQ: tile i's step runs at the end of tile i+1 (dS^T double-buffered): one barrier per tile, not two;
//   * the head's last block to finish (a counter per head) writes dQ = dQ_accum (convert_dq, common.cuh), or, on
//     long heads, bwd_convert_dq does after the kernel (the launcher's fuse_dq_rule).
// Deterministic mode has no atomics: flash_v2_backward_dq.cu.
#pragma once
#include "common.cuh"

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
