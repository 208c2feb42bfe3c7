// flash_v3_backward_variants.cu: stage 06's backward with the attention variants: version ws's main loop
// (hopper_bwd_ws.cuh: a producer warpgroup, two consumers on a K/V tile of 128 keys, dQ_i by the copy engine's bulk
// reductions) with stage 02's hooks (variants.cuh) and the variants' Block (hopper_variants.cuh: KeyBlock):
//   * grouped-query / multi-query k and v: a block per (K/V tile, k / v head) walks the Q tiles of each query head of
//     the group in turn, so dK_j, dV_j are summed over the group in the consumers' registers and written once: no
//     float32 copy per query head, no atomics, no pass of their own (stage 03's tc kernel adds them with red.add).
//     The price is parallelism: group times fewer blocks, each group times longer;
//   * packed variable-length batches: a block per (K/V tile of the longest sequence, sequence, k / v head); rows and
//     keys start at cu_q[s], cu_k[s] in the maps, L_i, D_i come by unswizzled tensor maps (KeyBlock::load_l_d: any
//     first row; rows past the sequence's end hold the next sequence's values, and the mask hook hides them:
//     WindowMask::hidden, rows from Nq on, so P = 0), and dQ_i's reductions into rows past its end add zeros;
//   * a sliding window: only the Q tiles with a row that sees one of the block's keys (KeyBlock), the mask hook on
//     the parts at the band's edges (WindowMask: part_masked, hidden);
//   * softcap and ALiBi (ModScore): P^T = exp(x - L_i) of the hook's x, dS^T times the softcap's derivative
//     (hopper_bwd_tiles.cuh: probabilities_ds_t).
// Head dims 64 and 128 (version ws's). Launched by stages/06_hopper/flash_v3_backward_variants.py after stage 03's
// preprocess; checked by tests/test_06_hopper_gpu_variants.py.
#include "hopper_bwd_ws.cuh"
#include "hopper_variants.cuh"

// BR: rows of a Q tile (flash_v3_backward.q_tile_rows); Mask: WindowMask; Score: PlainScore or ModScore.
template <typename T, int D, int BR, typename Mask, typename Score>
__global__ void __launch_bounds__(384, 1) flash_v3_backward_variants(const __grid_constant__ HopperVarBwdParams p) {
    static_assert((D == 64 || D == 128) && BR * D == 8192, "version ws's head dims and Q tiles");
    constexpr int STAGES = 2;
    using Smem = WsSmem<D, STAGES, BR>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[1 + 2 * STAGES];
    const Smem sm(smem_raw, bars);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const KeyBlock<BR> blk(p);
    if (threadIdx.x == 0) sm.init_barriers();
    __syncthreads();
    if (wg == 0)  // the producer warpgroup
        ws_producer<T, D, STAGES, BR>(p, sm, blk);
    else  // consumer warpgroups 0 and 1; the hooks read the variants' fields, p.var
        ws_consumer<T, D, STAGES, BR, KeyBlock<BR>, Mask, Score>(p, p.var, sm, blk, wg);
}
