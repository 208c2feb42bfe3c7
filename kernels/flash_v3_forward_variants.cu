// flash_v3_forward_variants.cu: stage 06's forward with the attention variants real models use: version pingpong's
// main loop (hopper_pingpong.cuh: warp specialisation, the two overlaps) with stage 02's hooks (variants.cuh) in
// place of plain attention's, and a scheduler that knows heads, sequences and windows (hopper_variants.cuh):
//   * grouped-query / multi-query k and v: query head h reads k / v head h / group; nothing else changes (the tensor
//     map's head coordinate of K_j and V_j);
//   * packed variable-length batches: one launch for every sequence; a block's item is (Q tile, sequence, head), its
//     rows and keys start at cu_q[s] and cu_k[s] in the maps, and its mask ends at the sequence's own Nq, Nk. A tile
//     that crosses a sequence's end reads the next sequence's first rows: masked (S = -inf, so P = 0), and not stored;
//   * a sliding window (left, right) around the diagonal (causal is (-1, 0)): Mask = WindowMask. The scheduler gives
//     each item only the band of K/V tiles holding a key one of its rows sees, so the producer never loads, and the
//     consumers never compute, the tiles outside it; inside the band the mask hook applies only to tiles that need it
//     (part_masked: the band's edges);
//   * softcap and ALiBi: Score = ModScore: S_ij -> x = scale S_ij, c tanh(x / c), x - slope |diag - j| before the
//     online softmax, which then takes exp2 of x log2 e (scale_log2 = log2 e).
// One block per (Q tile, head) item, K/V tiles of 128 keys (64 at D = 256), two stages; the output in the inputs'
// type, or merged into a ring's running float32 (O, L) (p.merge). Launched by stages/06_hopper/flash_v3_variants.py;
// checked by tests/test_06_hopper_gpu_variants.py.
#include "hopper_pingpong.cuh"
#include "hopper_variants.cuh"

// T: float16 or bfloat16; Mask: WindowMask (or CausalMask); Score: PlainScore or ModScore (variants.cuh).
template <typename T, int D, int BC, typename Mask, typename Score>
__global__ void __launch_bounds__(384, 1) flash_v3_forward_variants(const __grid_constant__ HopperVarFwdParams p) {
    using Smem = PingpongSmem<T, D, BC, 2>;
    using Sched = VariantScheduler<BC, Mask>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[Smem::BARRIERS];
    const Smem sm(smem_raw, bars);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const Sched sched(p);
    if (threadIdx.x == 0) sm.init_barriers();
    __syncthreads();
    if (wg == 0)  // the producer warpgroup
        pingpong_producer<T, D, BC, 2, Sched, Sixteen<T, D, BC>>(p, sm, sched);
    else  // consumer warpgroups 0 and 1; the hooks read the variants' fields, p.var
        pingpong_consumer<T, D, BC, 2, Sched, Sixteen<T, D, BC>, Mask, Score>(p, p.var, sm, sched, wg);
}
