// dropout.cuh: dropout's keep mask Z, drawn where it is used (the forward's P~_ij, the backward's P_ij^T) from a
// counter-based generator, so nothing is stored between the passes: the backward regenerates the forward's bits.
// The definition (and its numpy twin, which the tests compare bit for bit) is stages/common/variants.py:
// dropout_keep.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): ten rounds of two 32 x 32
// -> 64-bit multiplies and xors on a 128-bit counter under a 64-bit key (the seed); each call gives four
// independent 32-bit draws u, and P_ij is kept when u < threshold = round((1 - p) 2^32).
//
// Counter layout: one call draws the four bits of queries {i, i + 8} x keys {j, j + 8} of a 16 x 16 block
// (i % 16 < 8, j % 16 < 8), counter (ci, cj, b * H + h, 0) with ci = (i / 16) * 8 + i % 8, cj the same for j,
// outputs in the order (i, j), (i, j + 8), (i + 8, j), (i + 8, j + 8). An mma thread (lane = 4 g + t) holds rows g,
// g + 8 and columns 2t, 2t + 1, 2t + 8, 2t + 9 of every 16 x 16 block of its fragments: two calls give it exactly
// its eight bits, in the forward's S (rows = queries) and in the backward's S^T (rows = keys) alike.
#pragma once
#include "common.cuh"

// The dropout of one launch: off when keep == 0 (p = 0); seed as two 32-bit halves; rp = 1 / (1 - p); q_off, k_off:
// the global indices of the launch's query row 0 and key 0 (0, 0 unless it computes one block of a larger problem:
// the ring, stages/common/variants.py: origin).
struct Dropout {
    u32 keep;  // threshold: a draw u < keep keeps its probability
    u32 seed_lo, seed_hi;
    float rp;
    int q_off, k_off;
};

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
        const u32 lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

// The four draws of local queries {i, i + 8} x keys {j, j + 8} (i % 16 < 8, j % 16 < 8) of head bh = b * H + h, in
// the order (i, j), (i, j + 8), (i + 8, j), (i + 8, j + 8): one Philox call at the global indices q_off + i, k_off + j.
// The offsets are multiples of 16 (the launchers check it), so the four stay one 16 x 16 block's call. (A block
// starting mid-tile would need up to four calls for a thread's four entries; its registers would spill.)
__device__ __forceinline__ uint4 dropout_draws(const Dropout& dp, int i, int j, long bh) {
    const int gi = i + dp.q_off, gj = j + dp.k_off;
    const u32 ci = (u32)(gi / 16) * 8u + (u32)(gi % 8), cj = (u32)(gj / 16) * 8u + (u32)(gj % 8);
    return philox4x32_10(make_uint4(ci, cj, (u32)bh, 0u), dp.seed_lo, dp.seed_hi);
}
