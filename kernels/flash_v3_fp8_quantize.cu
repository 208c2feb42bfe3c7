// flash_v3_fp8_quantize.cu: what stage 06's version fp8 computes before its attention kernel. Each head of q, k and v
// is scaled into e4m3's range and rounded: x' = e4m3(x / f) with f = amax / 448 (amax = max |x| over the head; 448 is
// e4m3's largest finite value), and x = f x' up to e4m3's rounding (3 mantissa bits: a relative error of at most
// 2^-4). The attention kernel multiplies the factors back in: S = (f_q f_k) Q' K'^T, O = f_v P V'.
//   fp8_amax      f_x times 448 for every head of q, k and v (one launch, blockIdx.z picks the tensor)
//   fp8_scale_qk  q' and k', row-major as q and k
//   fp8_scale_vt  v'^T: (B H, D, keys) with the keys of each row in the order the kernel packs P's fragments
//                 (kernels/hopper_tiles.cuh: p_fragments; stages/06_hopper/layouts.py: fp8_key_order), zero from key
//                 Nk on to the row's end (a multiple of 16 keys, the order's period)
#include "common.cuh"

typedef unsigned char u8;

// The largest |x| of a and b that is NaN if either is: a NaN anywhere in a head makes its factor NaN, and every
// output of that head NaN (fmaxf would drop it).
__device__ __forceinline__ float abs_max(float a, float b) { return (a != a || a > b) ? a : b; }

// Rounded to e4m3 (to nearest even, saturating at +-448), one byte.
__device__ __forceinline__ u8 to_e4m3(float x) {
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(two) : "f"(x));
    return (u8)two;
}

// amax[3 bh + z] = max |x_z| over head bh, x_0 = q (n_q values a head), x_1 = k, x_2 = v (n_k each); amax starts at 0.
// Non-negative floats order as their bits do (a NaN's bits above infinity's), so atomicMax on the bits folds each
// block's maximum in.
template <typename T>
__global__ void fp8_amax(const T* q, const T* k, const T* v, float* amax, long n_q, long n_k) {
    const int bh = blockIdx.y, z = blockIdx.z;
    const long n = z == 0 ? n_q : n_k;
    const T* x = (z == 0 ? q : z == 1 ? k : v) + bh * n;
    float m = 0.f;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        m = abs_max(fabsf(Half2<T>::to_float(x[i])), m);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) m = abs_max(__shfl_xor_sync(0xffffffffu, m, o), m);
    __shared__ float warp_max[32];
    if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)blockDim.x / 32; ++w) m = abs_max(warp_max[w], m);
        atomicMax(reinterpret_cast<unsigned*>(amax) + 3 * bh + z, __float_as_uint(m));
    }
}

// x / f of head bh in float32, f = amax / 448: x times 448 / amax (a head of zeros: 0).
__device__ __forceinline__ float inverse_factor(float amax) { return amax > 0.f ? 448.f / amax : 1.f; }

// q' and k' (blockIdx.z = 0, 1): each value of head bh times 448 / amax, rounded to e4m3.
template <typename T>
__global__ void fp8_scale_qk(const T* q, const T* k, const float* amax, u8* q8, u8* k8, long n_q, long n_k) {
    const int bh = blockIdx.y, z = blockIdx.z;
    const long n = z == 0 ? n_q : n_k;
    const T* x = (z == 0 ? q : k) + bh * n;
    u8* y = (z == 0 ? q8 : k8) + bh * n;
    const float inv = inverse_factor(amax[3 * bh + z]);
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = to_e4m3(Half2<T>::to_float(x[i]) * inv);
}

// The key that position L (0 .. 15) of a 16-key group of V'^T holds: a lane t of the quad packs keys 2 t, 2 t + 1,
// 8 + 2 t, 9 + 2 t of its S registers into A-fragment positions 4 t .. 4 t + 3.
__device__ __forceinline__ int fp8_key_order(int L) { return 8 * ((L % 4) / 2) + 2 * (L / 4) + L % 2; }

// v'^T for one head and 64 keys a block (grid: key blocks, B H): vt[bh][d][j] = v'[bh][key(j)][d] for j < row (the
// row length, Nk rounded up to 16), key(j) = 16 (j / 16) + fp8_key_order(j % 16), zero where key(j) >= Nk. The block
// reads its 64 x D values row by row into shared memory and writes D rows of 64 keys.
template <typename T>
__global__ void fp8_scale_vt(const T* v, const float* amax, u8* vt, int Nk, int D, int row) {
    extern __shared__ float tile[];  // 64 x (D + 1): one float of padding a row keeps the column reads apart
    const int bh = blockIdx.y, k0 = 64 * blockIdx.x;
    const float inv = inverse_factor(amax[3 * bh + 2]);
    const T* x = v + (long)bh * Nk * D;
    for (int i = threadIdx.x; i < 64 * D; i += blockDim.x) {
        const int key = i / D, d = i % D;
        tile[key * (D + 1) + d] = k0 + key < Nk ? Half2<T>::to_float(x[(long)(k0 + key) * D + d]) * inv : 0.f;
    }
    __syncthreads();
    u8* y = vt + (long)bh * D * row;
    for (int i = threadIdx.x; i < 64 * D; i += blockDim.x) {
        const int d = i / 64, j = i % 64;
        const int key = 16 * (j / 16) + fp8_key_order(j % 16);
        if (k0 + j < row) y[(long)d * row + k0 + j] = to_e4m3(tile[key * (D + 1) + d]);
    }
}
