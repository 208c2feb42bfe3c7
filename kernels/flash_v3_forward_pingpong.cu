// flash_v3_forward_pingpong.cu: stage 06 version 3 "pingpong": version 2 ("ws") with FlashAttention-3's two
// overlaps (Shah et al., arXiv 2407.08608, Sec. 3.1 and 3.2). In version 2 a consumer warpgroup alternates between
// the tensor cores (S = Q K^T, O += P V) and the multi-function units (exp2 of the softmax), and each waits for the
// other. Here the two consumer warpgroups take turns at the tensor cores, so that one's softmax runs under the
// other's GEMMs, and each issues S_j = Q K_j^T together with O += P_{j-1} V_{j-1}: the main loop,
// hopper_pingpong.cuh. Three launch choices, each its own header or template argument:
//   PERSISTENT  the grid: a block per (Q tile, head) item, or one block per SM striding over the items
//               (hopper_scheduler.cuh; stages/06_hopper/flash_v3.py: persistent_rule);
//   BC          keys a K/V tile: 128 (64 at D = 256), or 192 on long items without a mask at D = 128 (wide_rule);
//   the last K/V tile at D = 128 computed only on its 64-key blocks that hold keys (hopper_tiles.cuh: with_width).
// The same main loop in e4m3 is version fp8 (flash_v3_forward_fp8.cu). Tile steps and epilogue: hopper_tiles.cuh.
// Checked by tests/test_06_hopper_gpu.py.
#include "hopper_pingpong.cuh"

// T: the inputs' type, float16 or bfloat16; O: the output's, the same. The 16-bit Kind: hopper_pingpong.cuh.
template <typename T, int D, int BC, int STAGES, bool PERSISTENT, typename O = T>
__global__ void __launch_bounds__(384, 1) flash_v3_forward_pingpong(const __grid_constant__ HopperFwdParams p) {
    using Smem = PingpongSmem<T, D, BC, STAGES>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[Smem::BARRIERS];
    const Smem sm(smem_raw, bars);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    using Sched = TileScheduler<BC, PERSISTENT>;
    const Sched sched(p);
    if (threadIdx.x == 0) sm.init_barriers();
    __syncthreads();
    if (wg == 0)  // the producer warpgroup
        pingpong_producer<T, D, BC, STAGES, Sched, Sixteen<O, D, BC>>(p, sm, sched);
    else  // consumer warpgroups 0 and 1, plain attention's hooks (variants.cuh)
        pingpong_consumer<T, D, BC, STAGES, Sched, Sixteen<O, D, BC>, CausalMask, PlainScore>(p, p, sm, sched, wg);
}
