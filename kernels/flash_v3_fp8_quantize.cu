// flash_v3_fp8_quantize.cu: what stage 06's version fp8 computes before its attention kernel. Each head of q, k and v
// is scaled into e4m3's range and rounded: x' = e4m3(x / f) with f = amax / 448 (amax = max |x| over the head; 448 is
// e4m3's largest finite value), and x = f x' up to e4m3's rounding (3 mantissa bits: a relative error of at most
// 2^-4). The attention kernel multiplies the factors back in: S = (f_q f_k) Q' K'^T, O = f_v P V'.
//   fp8_amax      f_x times 448 for every head of q, k and v (one launch, blockIdx.z picks the tensor)
//   fp8_scale_qk  q' and k', row-major as q and k
//   fp8_scale_vt  v'^T: (B H, D, keys) with the keys of each row in the order the kernel packs P's fragments
//                 (kernels/hopper_tiles.cuh: p_fragments; stages/06_hopper/fp8.py: key_order), zero from key
//                 Nk on to the row's end (a multiple of 16 keys, the order's period)
#include "common.cuh"
#include "hopper.cuh"  // pack_e4m3x4

typedef unsigned char u8;

// The largest |x| of a and b that is NaN if either is: a NaN anywhere in a head makes its factor NaN, and every
// output of that head NaN (fmaxf would drop it).
__device__ __forceinline__ float abs_max(float a, float b) { return (a != a || a > b) ? a : b; }

// Eight values of T (16 bytes, one load) as floats.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&x)[8]) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = Half2<T>::to_float(h[e]);
}

// amax[3 bh + z] = max |x_z| over head bh, x_0 = q (n_q values a head), x_1 = k, x_2 = v (n_k each; both multiples of
// 8, read 8 at a time); amax starts at 0. Non-negative floats order as their bits do (a NaN's bits above infinity's),
// so atomicMax on the bits folds each block's maximum in.
template <typename T>
__global__ void fp8_amax(const T* q, const T* k, const T* v, float* amax, long n_q, long n_k) {
    const int bh = blockIdx.y, z = blockIdx.z;
    const long n = z == 0 ? n_q : n_k;
    const T* x = (z == 0 ? q : z == 1 ? k : v) + bh * n;
    float m = 0.f, e8[8];
    for (long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 8L * gridDim.x * blockDim.x) {
        load8(x + i, e8);
#pragma unroll
        for (int e = 0; e < 8; ++e) m = abs_max(fabsf(e8[e]), m);
    }
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

// q' and k' (blockIdx.z = 0, 1): each value of head bh times 448 / amax, rounded to e4m3; 8 values (16 bytes in, 8
// out) a step.
template <typename T>
__global__ void fp8_scale_qk(const T* q, const T* k, const float* amax, u8* q8, u8* k8, long n_q, long n_k) {
    const int bh = blockIdx.y, z = blockIdx.z;
    const long n = z == 0 ? n_q : n_k;
    const T* x = (z == 0 ? q : k) + bh * n;
    u8* y = (z == 0 ? q8 : k8) + bh * n;
    const float inv = inverse_factor(amax[3 * bh + z]);
    float e8[8];
    for (long i = 8 * ((long)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 8L * gridDim.x * blockDim.x) {
        load8(x + i, e8);
        uint2 out;
        out.x = pack_e4m3x4(e8[0] * inv, e8[1] * inv, e8[2] * inv, e8[3] * inv);
        out.y = pack_e4m3x4(e8[4] * inv, e8[5] * inv, e8[6] * inv, e8[7] * inv);
        *reinterpret_cast<uint2*>(y + i) = out;
    }
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
    float e8[8];
    for (int i = 8 * threadIdx.x; i < 64 * D; i += 8 * blockDim.x) {  // 8 values of a row of v a step
        const int key = i / D, d = i % D;
        if (k0 + key < Nk)
            load8(x + (long)(k0 + key) * D + d, e8);
        else
#pragma unroll
            for (int e = 0; e < 8; ++e) e8[e] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) tile[key * (D + 1) + d + e] = e8[e] * inv;
    }
    __syncthreads();
    u8* y = vt + (long)bh * D * row;
    for (int i = 4 * threadIdx.x; i < 64 * D; i += 4 * blockDim.x) {  // 4 keys of a row of v^T a step
        const int d = i / 64, j = i % 64;
        if (k0 + j >= row) continue;  // row is a multiple of 16: the 4 keys are in or out together
        float e4[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) e4[e] = tile[(16 * ((j + e) / 16) + fp8_key_order((j + e) % 16)) * (D + 1) + d];
        *reinterpret_cast<u32*>(y + (long)d * row + k0 + j) = pack_e4m3x4(e4[0], e4[1], e4[2], e4[3]);
    }
}
