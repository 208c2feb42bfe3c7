// flash_v3_forward_wgmma.cu: stage 06 version 1 "wgmma": the FlashAttention-2 forward (Dao, arXiv 2307.08691,
// Algorithm 1) with Hopper's two new data paths (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3.1):
//   * Q_i, K_j, V_j reach shared memory by the copy engine (TMA), 64 x 64 boxes with the 128-byte swizzle; a ring of
//     two K/V stages, each with an mbarrier that completes when its bytes have landed (phase parity = round & 1);
//   * S_ij = Q_i K_j^T by wgmma from shared memory (both K-major), O_i += P_ij V_j by wgmma with P_ij in registers
//     (the accumulators of S_ij rounded to 16 bits are its A fragments) and V_j read as an MN-major operand.
// One warpgroup (4 warps, 128 threads) per (Q tile i of 64 rows, head); warp w owns rows 16 w .. 16 w + 15 and, as in
// stage 02, its softmax is its own. No warp specialisation yet: thread 0 issues the copies.
// The tile step and the epilogue: hopper_tiles.cuh. Layouts and descriptors: stages/06_hopper/swizzle.py.
// Checked by tests/test_06_hopper_gpu.py.
#include "hopper_tiles.cuh"

template <typename T, int D>
__global__ void __launch_bounds__(128, 1) flash_v3_forward_wgmma(const __grid_constant__ HopperFwdParams p) {
    constexpr int PANELS = D / 64;           // 64-column panels of a tile (one TMA box and 8 KB each)
    constexpr u32 TILE = PANELS * 8192u;     // bytes of one 64-row tile
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[3];     // Q_i; K/V stage 0; K/V stage 1
    const u32 q_s = aligned_1024(smem_raw);  // Q_i, then stage s: K at q_s + (1 + 2 s) TILE, V at q_s + (2 + 2 s) TILE
    const u32 bar_q = smem_addr(&bars[0]);
    const int i = blockIdx.x, bh = blockIdx.y, row0 = 64 * i;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq;
    const int last_row = min(row0 + 63, Nq - 1);
    const int last_key = p.causal ? min(Nk - 1, last_row + shift) : Nk - 1;  // the last key a row of Q_i sees
    const int n_tiles = last_key < 0 ? 0 : last_key / 64 + 1;                  // K/V tiles 0 .. n_tiles - 1

    auto load_kv = [&](int j) {  // thread 0: tile j into stage j & 1, both K_j and V_j on the stage's barrier
        const int stage = j & 1;
        const u32 bar = smem_addr(&bars[1 + stage]), k_s = q_s + (1 + 2 * stage) * TILE, v_s = k_s + TILE;
        mbar_arrive_expect_tx(bar, 2 * TILE);
        for (int c = 0; c < PANELS; ++c) {
            tma_load_3d(k_s + c * 8192u, &p.map_k, bar, 64 * c, 64 * j, bh);
            tma_load_3d(v_s + c * 8192u, &p.map_v, bar, 64 * c, 64 * j, bh);
        }
    };
    if (threadIdx.x == 0) {
        for (int b = 0; b < 3; ++b) mbar_init(smem_addr(&bars[b]), 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // Alg.1 L4: Q_i; L6 (j = 0): K_0, V_0
        mbar_arrive_expect_tx(bar_q, TILE);
        tma_load_rows<D>(q_s, &p.map_q, bar_q, row0, bh, 1);
        if (n_tiles > 0) load_kv(0);
    }

    RowState<D> st;  // Alg.1 L5: this warp's 16 rows of O_i, m_i, l_i
    st.init();
    const int r0 = row0 + 16 * warp;
    mbar_wait(bar_q, 0);

    for (int j = 0; j < n_tiles; ++j) {  // Alg.1 L6
        const int stage = j & 1;
        if (j > 0) __syncthreads();  // every warp is done with tile j - 1, whose stage the next copy refills
        if (threadIdx.x == 0 && j + 1 < n_tiles) load_kv(j + 1);
        mbar_wait(smem_addr(&bars[1 + stage]), (j >> 1) & 1);  // round j / 2 of this stage
        const u32 k_s = q_s + (1 + 2 * stage) * TILE;
        const bool masked = (j + 1) * 64 > Nk || (p.causal && (j + 1) * 64 - 1 > row0 + shift);
        consume_tile<T, D, 64>(st, q_s, k_s, k_s + TILE, r0, 64 * j, Nk, p.causal, shift, p.scale_log2, masked, g, t);
    }
    store_rows<T, D>(st, p, bh, 0, p.Nq, r0, g, t);
}
