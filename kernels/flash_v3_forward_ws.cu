// flash_v3_forward_ws.cu: stage 06 version 2 "ws": version 1 with warp specialisation (FlashAttention-3, Shah et al.,
// arXiv 2407.08608, Sec. 3.1). What changes, and why:
//   * a producer warpgroup only issues the copies: one thread waits for a free stage (empty[s]), announces its bytes
//     and starts the copy engine; it keeps 24 registers (setmaxnreg.dec), and the consumers take the rest (inc);
//   * two consumer warpgroups, each on its own 64 rows of a 128-row Q tile, wait for a full stage (full[s]), compute
//     as version 1 does, and release it (empty[s]); the loads of later tiles run while they compute, STAGES ahead,
//     with no __syncthreads in the loop: the mbarriers' phases alone order the two sides
//     (stages/06_hopper/schedules.py simulates this protocol tick by tick);
//   * K/V tiles of BC keys: 128 where the registers allow (D <= 128), so that S = Q K^T is one m64n128 wgmma per K
//     step, which reads Q's slice from shared memory once for 128 keys instead of once per 64.
// Tile step and epilogue: hopper_tiles.cuh. Checked by tests/test_06_hopper_gpu.py.
#include "hopper_tiles.cuh"

template <typename T, int D, int BC, int STAGES>
__global__ void __launch_bounds__(384, 1) flash_v3_forward_ws(const __grid_constant__ HopperFwdParams p) {
    constexpr u32 TILE = (D / 64) * 8192u;     // bytes of one 64-row Q tile (D / 64 panels of 64 rows x 128 bytes)
    constexpr u32 KV = (D / 64) * BC * 128u;   // bytes of one K or V tile of BC rows
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[1 + 2 * STAGES];  // Q; full[s]; empty[s]
    const u32 q_s = aligned_1024(smem_raw);    // Q (two 64-row halves), then stage s: K_j at kv(s), V_j after it
    auto kv = [&](int s) { return q_s + 2 * TILE + 2 * s * KV; };
    auto full = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty = [&](int s) { return smem_addr(&bars[1 + STAGES + s]); };
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0), bh = blockIdx.y, row0 = 128 * blockIdx.x;
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq;
    const int last_row = min(row0 + 127, Nq - 1);
    const int last_key = p.causal ? min(Nk - 1, last_row + shift) : Nk - 1;  // the last key a row of the tile sees
    const int n_tiles = last_key < 0 ? 0 : last_key / BC + 1;

    if (threadIdx.x == 0) {
        mbar_init(smem_addr(&bars[0]), 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);      // the producer's arrival (with the stage's bytes)
            mbar_init(empty(s), 256);   // every consumer thread's
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {  // ---------------- producer
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) {
            mbar_arrive_expect_tx(smem_addr(&bars[0]), 2 * TILE);
            tma_load_rows<D>(q_s, &p.map_q, smem_addr(&bars[0]), row0, bh, 2);  // both 64-row halves
            for (int j = 0; j < n_tiles; ++j) {
                const int s = j % STAGES, round = j / STAGES;
                mbar_wait(empty(s), (round & 1) ^ 1);  // passes at once in round 0: the stages start empty
                mbar_arrive_expect_tx(full(s), 2 * KV);
                for (int c = 0; c < D / 64; ++c) {  // boxes of BC rows x 64 columns
                    tma_load_3d(kv(s) + c * BC * 128u, &p.map_k, full(s), 64 * c, BC * j, bh);
                    tma_load_3d(kv(s) + KV + c * BC * 128u, &p.map_v, full(s), 64 * c, BC * j, bh);
                }
            }
        }
        return;
    }
    // ---------------- consumers: warpgroup wg - 1 owns rows row0 + 64 (wg - 1) .. + 63
    setmaxnreg_inc<240>();
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int first = row0 + 64 * (wg - 1), r0 = first + 16 * warp;
    const u32 q_mine = q_s + (wg - 1) * TILE;
    RowState<D> st;
    st.init();
    mbar_wait(smem_addr(&bars[0]), 0);
    for (int j = 0; j < n_tiles; ++j) {
        const int s = j % STAGES, round = j / STAGES;
        mbar_wait(full(s), round & 1);
        const bool masked = (j + 1) * BC > Nk || (p.causal && (j + 1) * BC - 1 > first + shift);
        consume_tile<T, D, BC>(st, q_mine, kv(s), kv(s) + KV, r0, BC * j, Nk, p.causal, shift, p.scale_log2, masked,
                               g, t);
        mbar_arrive(empty(s));  // this thread is done with the stage (its wgmmas have completed)
    }
    store_rows<T, D>(st, p, bh, 0, p.Nq, r0, g, t);
}
