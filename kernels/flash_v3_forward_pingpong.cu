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

// The 16-bit kernel's part of the main loop: S scaled by the softmax scale, O rescaled by alpha on every tile, V_j
// loaded in panels of 64 columns (BC rows x 128 bytes each), O_i stored in type O and L_i (or both merged into the
// running float32 O, L: a ring block).
template <typename O, int D, int BC>
struct Sixteen {
    enum : int { LIFT = 0 };
    __device__ static auto scale_log2(const HopperFwdParams& p, int) {
        return [&p] { return p.scale_log2; };
    }
    __device__ static void load_v(u32 v_s, const HopperFwdParams& p, u32 bar, int key, int bh) {
        for (int c = 0; c < D / 64; ++c) tma_load_3d(v_s + c * BC * 128u, &p.map_v, bar, 64 * c, key, bh);
    }
    __device__ static void rescale(RowState<D>& st, const float (&alpha)[2]) { rescale_o(st, alpha); }
    __device__ static void store(RowState<D>& st, const HopperFwdParams& p, const WorkItem& w, int r0, int g, int t) {
        store_rows<O, D>(st, p, w.bh, w.q0, w.Nq, r0, g, t);
    }
};

// T: the inputs' type, float16 or bfloat16; O: the output's, the same.
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
