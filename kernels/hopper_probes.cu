// hopper_probes.cu: stage 06's probes of Hopper's data paths, each checked alone on an sm_90 GPU against
// stages/06_hopper/swizzle.py before the attention kernels rely on them (stages/06_hopper/probes.py launches them;
// tests/test_06_hopper_gpu.py).
//   tile_bytes   the copy engine loads one box of a tensor map with the 128-byte swizzle; the shared-memory bytes
//                are copied out as they are, to be compared with swizzle.store_tile (the swizzle as the hardware
//                does it)
//   qk_scores    S = Q K^T for one 64-row Q tile and one 64-row K tile: both loaded by the copy engine, multiplied by
//                wgmma through K-major descriptors (swizzle.descriptor), one K step of 16 per instruction
//   pv_product   O = P V for a 64 x 64 P held in registers (the A fragments S's accumulators become) and a 64-key V
//                tile loaded by the copy engine and read as an MN-major operand (swizzle.read_operand_mn)
#include "hopper.cuh"

// The one argument of the three kernels. Pointer fields first (kernels.Launch writes the arrays of each call there);
// the tensor maps at a multiple of 64 bytes, as CUtensorMap requires. stages/06_hopper/probes.py mirrors it.
struct ProbeParams {
    void* out;        // tile_bytes: rows x 128 bytes; qk_scores: S, 64 x 64 float; pv_product: O, 64 x D float
    const void* in;   // pv_product: P, 64 x 64 (the 16-bit input type)
    int rows;         // tile_bytes: rows of the box
    int D;            // qk_scores, pv_product: head dim, a multiple of 64 (tiles are D / 64 panels of 64 columns)
    TensorMap map_a;  // tile_bytes: the tensor; qk_scores: Q
    TensorMap map_b;  // qk_scores: K; pv_product: V
};

extern "C" __global__ void tile_bytes(const __grid_constant__ ProbeParams p) {
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
__global__ void __launch_bounds__(128) qk_scores(const __grid_constant__ ProbeParams p) {
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

// One warpgroup. Shared memory: V's D / 64 panels, 64 keys x 128 bytes each. D <= 128 (two 32-register accumulators).
template <typename T>
__global__ void __launch_bounds__(128) pv_product(const __grid_constant__ ProbeParams p) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 full;
    const u32 v_base = aligned_1024(smem_raw), bar = smem_addr(&full);
    const int panels = p.D / 64;
    if (threadIdx.x == 0) {
        mbar_init(bar, 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_expect_tx(bar, panels * 8192u);
        for (int c = 0; c < panels; ++c) tma_load_2d(v_base + c * 8192u, &p.map_b, bar, 64 * c, 0);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const T* P = static_cast<const T*>(p.in);
    const int r0 = 16 * warp + g;  // this thread's rows r0 and r0 + 8 of P and O
    u32 a[4][4];                    // A fragments of the 4 K steps (keys 16 ks .. 16 ks + 15)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // q: (row r0 or r0 + 8) x (columns 2 t or 8 + 2 t)
            const int r = r0 + 8 * (q % 2), c = 16 * ks + 8 * (q / 2) + 2 * t;
            a[ks][q] = *reinterpret_cast<const u32*>(P + r * 64 + c);  // two consecutive 16-bit values
        }
    mbar_wait(bar, 0);

    float o[2][32];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[n][i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        if (n >= panels) break;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)  // K step: 16 keys further is 2048 bytes (two groups of 8 rows)
            wgmma_64x64x16_rs<T>(o[n], a[ks], desc_mnmajor_128b(v_base + n * 8192u + ks * 2048u, 8192u), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();

    float* out = static_cast<float*>(p.out);
    for (int n = 0; n < panels; ++n)
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                out[(r0 + 8 * (e / 2)) * p.D + 64 * n + 8 * i + 2 * t + (e % 2)] = o[n][4 * i + e];
}
