// flash_v3_forward_fp8.cu: stage 06 version "fp8": version pingpong's main loop (hopper_pingpong.cuh) on Q', K' and
// V'^T in e4m3 (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3.3), d = 128, K/V tiles of 128 keys, a block
// per (Q tile, head). A pre-pass (flash_v3_fp8_quantize.cu) scales each head of q, k and v into e4m3's range,
// x' = e4m3(x 448 / amax_x), and writes v'^T; this kernel takes the factors f = amax / 448 back (p.amax) and writes O
// in type O (the inputs' float16 or bfloat16). What differs from the 16-bit kernel is this file's Kind:
//   * S = f_q f_k Q' K'^T: the factors go into the softmax's scale, once per head;
//   * V_j^T tiles: the 8-bit wgmma reads its shared-memory operands only K-major, and the K of O += P V is the keys,
//     so V enters transposed, D rows of BC keys (one byte each: a 128-byte line a row), 64 rows a box, its keys in
//     the order the lanes pack P (hopper_tiles.cuh: p_fragments; stages/06_hopper/fp8.py: key_order);
//   * P lifted by 2^8 (LIFT): P in [0, 256], so that its small values keep their bits in e4m3 (smallest normal 2^-6);
//     O_i / l_i is unchanged and L_i takes off LIFT;
//   * alpha = 1 exactly where a row's max did not change (exp2(0)): a warp none of whose 16 rows changed skips the
//     D / 2 multiplies by 1 (the same bits, fewer instructions; stage 02's SKIP). In 8 bits the softmax step bounds
//     the kernel (stages/06_hopper/README.md, FP8);
//   * O = (P V') f_v: v's factor goes into the epilogue's 1 / l_i.
// Launched by stages/06_hopper/fp8.py; checked by tests/test_06_hopper_gpu.py against fp8.reference.
#include "hopper_pingpong.cuh"

template <typename O>
struct Fp8 {
    enum : int { D = 128, BC = 128, LIFT = 8 };
    __device__ static auto scale_log2(const HopperFwdParams& p, int bh) {  // S = (Q' f_q)(K' f_k)^T, once a head
        const float f = p.scale_log2 * (p.amax[3 * bh] / 448.f) * (p.amax[3 * bh + 1] / 448.f);
        return [f] { return f; };
    }
    __device__ static void load_v(u32 v_s, const HopperFwdParams& p, u32 bar, int key, int bh) {
        for (int r = 0; r < D / 64; ++r) tma_load_3d(v_s + r * 64 * 128u, &p.map_v, bar, key, 64 * r, bh);
    }
    __device__ static void rescale(RowState<D>& st, const float (&alpha)[2]) {
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale_o(st, alpha);
    }
    __device__ static void store(RowState<D>& st, const HopperFwdParams& p, const WorkItem& w, int r0, int g, int t) {
        store_rows<O, D>(st, p, w.bh, w.q0, w.Nq, r0, g, t, p.amax[3 * w.bh + 2] / 448.f, LIFT);  // O = P (V' f_v)
    }
};

template <typename O>
__global__ void __launch_bounds__(384, 1) flash_v3_forward_fp8(const __grid_constant__ HopperFwdParams p) {
    using Kind = Fp8<O>;
    using Smem = PingpongSmem<E4M3, Kind::D, Kind::BC, 2>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[Smem::BARRIERS];
    const Smem sm(smem_raw, bars);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    using Sched = TileScheduler<Kind::BC, false>;
    const Sched sched(p);
    if (threadIdx.x == 0) sm.init_barriers();
    __syncthreads();
    if (wg == 0)  // the producer warpgroup
        pingpong_producer<E4M3, Kind::D, Kind::BC, 2, Sched, Kind>(p, sm, sched);
    else  // consumer warpgroups 0 and 1, plain attention's hooks (variants.cuh)
        pingpong_consumer<E4M3, Kind::D, Kind::BC, 2, Sched, Kind, CausalMask, PlainScore>(p, p, sm, sched, wg);
}
