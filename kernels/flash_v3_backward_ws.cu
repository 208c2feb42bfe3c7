// flash_v3_backward_ws.cu: stage 06's backward, version "ws": version "wgmma" with warp specialisation and the dQ
// reduction moved to the copy engine (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3.3). What changes, and
// why:
//   * dQ_i += dS K_j was 64 x D single reductions per lane and tile into the fp32 accumulator: the largest cost of
//     version 1. Here dQ_i leaves by bulk reductions: the consumers write it to shared memory (panels of 32 floats,
//     128-byte swizzle, in a lane order free of bank conflicts), one thread hands it to the copy engine
//     (cp.reduce.async.bulk.tensor .add), which adds it to the accumulator while the next tile is computed. The
//     block's K/V tile has 128 keys, and each dQ_i is summed over all of them before it leaves: half as many
//     reductions, and half the bytes to write;
//   * two consumer warpgroups, each on its 64 keys of the tile, share every Q_i and dO_i a producer warpgroup loads
//     (setmaxnreg: 24 registers for it, 240 for each consumer) STAGES tiles ahead on full / empty mbarriers;
//   * Q tiles of BR rows: 64 at D = 128, 128 at D = 64, where the registers allow it (S^T and dP^T of 64 keys x 128
//     queries, 64 registers each, beside dK_j and dV_j of 32 each). Each tile's barriers, softmax bookkeeping and
//     dQ epilogue then serve twice the work, and S^T, dP^T are m64n128 wgmmas;
//   * dQ_i (BR x D) = dS_i (BR x 128 keys) K_j needs both consumers' dS^T: each consumer computes a 64 x 64 part of
//     it over all 128 keys (32 accumulator registers): at D = 128 all 64 rows and columns 64 me..; at D = 64 rows
//     64 me.. and all 64 columns. Two named barriers of both consumers order each tile: both halves of dS^T are
//     written (BAR_DS), all of dQ_i is in shared memory (BAR_DQ; one thread then hands it to the copy engine).
//   * on short heads (the launcher's fuse_dq_rule) the last block of each head to finish converts the head's dQ
//     accumulator to the input type while it is in L2: no third launch and no pass of its own over the accumulator,
//     a fixed cost that weighs most where the GEMMs are fewest. A counter per head, as in stage 03's tc kernel; here
//     one thread counts with an acquire-release atomic while the block's other threads store dK_j, dV_j, so a block
//     that is not last loses almost nothing to the count.
// Head dims 64 and 128 (at 256, K_j and V_j of 128 keys and the Q/dO stages do not fit shared memory: version 1).
// A block of ring attention (stage 04; p.accumulate) adds scale dQ_i through map_dq, a map of the ring's float32 dQ
// at the block's rows, and dK_j, dV_j into its float32 accumulators (hopper_bwd_tiles.cuh: store_dk_dv).
// The main loop (producer, consumers, epilogue) is hopper_bwd_ws.cuh, shared with the variants' kernel
// (flash_v3_backward_variants.cu); here it runs with plain attention's hooks. Tile steps: hopper_bwd_tiles.cuh.
// Checked by tests/test_06_hopper_gpu_backward.py.
#include "hopper_bwd_ws.cuh"

// BR: rows of a Q tile, chosen by the launcher (stages/06_hopper/flash_v3_backward.py: q_tile_rows).
template <typename T, int D, int STAGES, int BR>
__global__ void __launch_bounds__(384, 1) flash_v3_backward_ws(const __grid_constant__ HopperBwdParams p) {
    static_assert(D == 64 || D == 128, "version ws: head dims 64 and 128");
    static_assert(BR * D == 8192, "version ws: each consumer's part of dQ_i is 64 x 64 (BR = 128 at D = 64, 64 at "
                                  "D = 128)");
    using Smem = WsSmem<D, STAGES, BR>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[1 + 2 * STAGES];
    const Smem sm(smem_raw, bars);
    // the warpgroup index through a shuffle: the compiler then knows it is the same in every lane of a warp, and
    // keeps the addresses and wgmma descriptors derived from it in uniform registers instead of recomputing them
    // in every lane and moving them over before each wgmma
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const PlainBlock<BR> blk(p);
    if (threadIdx.x == 0) sm.init_barriers();
    __syncthreads();
    if (wg == 0)  // the producer warpgroup
        ws_producer<T, D, STAGES, BR>(p, sm, blk);
    else  // consumer warpgroups 0 and 1, plain attention's hooks (variants.cuh)
        ws_consumer<T, D, STAGES, BR, PlainBlock<BR>, CausalMask, PlainScore>(p, p, sm, blk, wg);
}
