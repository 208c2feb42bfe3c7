// common_cuh_check.cu: instantiates every helper in common.cuh so the compile test (tests/test_00_naive.py)
// catches a broken header even before any algorithm kernel uses it. Not a kernel anyone runs.
#include "common.cuh"

template <typename T>
__device__ void exercise(float* out, const T* g) {
    __shared__ __align__(16) T s[32 * 8];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    u32 a[4], b[2];
    cp_async_16(s + 8 * (threadIdx.x % 32), g + 8 * (threadIdx.x % 32), threadIdx.x < 16);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();  // the copies are in shared memory before ldmatrix reads them
    ldmatrix_x4(a, s + 8 * (threadIdx.x % 32));
    ldmatrix_x2_trans(b, s + 8 * (threadIdx.x % 16));
    mma_16816<T>(acc, a, b);
    ldmatrix_x4_trans(a, s + 8 * (threadIdx.x % 32));
    ldmatrix_x2(b, s + 8 * (threadIdx.x % 16));
    mma_16816<T>(acc, a, b);
    float x = warp_sum(acc[0]) + warp_max<4>(acc[1]) + fast_exp2(acc[2]);
    out[threadIdx.x] = x + Half2<T>::to_float(Half2<T>::from_float(acc[3])) + (float)Half2<T>::pack(x, x);
}

extern "C" __global__ void check_fp16(float* out, const __half* g) { exercise(out, g); }
extern "C" __global__ void check_bf16(float* out, const __nv_bfloat16* g) { exercise(out, g); }
