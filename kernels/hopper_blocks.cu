// hopper_blocks.cu: stage 06's building blocks, each checked alone on an sm_90 GPU against stages/06_hopper/layouts.py
// before the attention kernels use them (stages/06_hopper/blocks.py launches them; tests/test_06_hopper_gpu.py).
//   tile_bytes   the copy engine loads one box of a tensor map with the 128-byte swizzle; the shared-memory bytes
//                are copied out as they are, to be compared with layouts.store_tile (the swizzle as the hardware does it)
//   qk_scores    S = Q K^T for one 64-row Q tile and one 64-row K tile: both loaded by the copy engine, multiplied by
//                wgmma through K-major descriptors (layouts.descriptor), one K step of 16 per instruction
#include "hopper.cuh"

// The one argument of both kernels. Pointer fields first (kernels.Launch writes the arrays of each call there); the
// tensor maps at a multiple of 64 bytes, as CUtensorMap requires. stages/06_hopper/blocks.py mirrors it.
struct BlockParams {
    void* out;        // tile_bytes: rows x 128 bytes; qk_scores: S, 64 x 64 float
    int rows;         // tile_bytes: rows of the box
    int D;            // qk_scores: head dim, a multiple of 64 (the tile is D / 64 panels of 64 columns)
    TensorMap map_a;  // tile_bytes: the tensor; qk_scores: Q
    TensorMap map_b;  // qk_scores: K
};

// The 128-byte swizzle repeats every 1024 bytes: a swizzled tile starts on a 1024-byte boundary of shared memory.
__device__ __forceinline__ u32 aligned_1024(const unsigned char* smem) { return (smem_addr(smem) + 1023u) & ~1023u; }

extern "C" __global__ void tile_bytes(const __grid_constant__ BlockParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 full;  // the mbarrier
    const u32 base = aligned_1024(smem_raw), bar = smem_addr(&full);
    const unsigned char* tile = smem_raw + (base - smem_addr(smem_raw));
    const u32 bytes = p.rows * 128u;
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, bytes);
        tma_load_2d(base, &p.map_a, bar, 0, 0);
    }
    mbar_wait(bar, 0);  // phase 0 completes when the arrival and all the box's bytes have come
    for (u32 i = threadIdx.x; i < bytes / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(p.out)[i] = reinterpret_cast<const uint4*>(tile)[i];
}

// One warpgroup (128 threads). Shared memory: Q's D / 64 panels, then K's, 64 rows x 128 bytes (8 KB) each.
template <typename T>
__global__ void __launch_bounds__(128) qk_scores(const __grid_constant__ BlockParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 full;
    const u32 q_base = aligned_1024(smem_raw), bar = smem_addr(&full);
    const int panels = p.D / 64;
    const u32 k_base = q_base + panels * 8192u;
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, 2u * panels * 8192u);
        for (int c = 0; c < panels; ++c) {  // box (column 64 c, row 0): 64 rows x 64 values
            tma_load_2d(q_base + c * 8192u, &p.map_a, bar, 64 * c, 0);
            tma_load_2d(k_base + c * 8192u, &p.map_b, bar, 64 * c, 0);
        }
    }
    mbar_wait(bar, 0);

    float s[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
    wgmma_fence();
    for (int k = 0; k < p.D / 16; ++k) {  // K step k: panel k / 4, 32 bytes further inside its 128-byte line per step
        const u32 off = (k / 4) * 8192u + (k % 4) * 32u;
        wgmma_64x64x16<T>(s, desc_kmajor_128b(q_base + off), desc_kmajor_128b(k_base + off), k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float* out = static_cast<float*>(p.out);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            out[(16 * warp + g + 8 * (e / 2)) * 64 + 8 * i + 2 * t + (e % 2)] = s[4 * i + e];
}
