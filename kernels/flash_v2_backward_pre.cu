// flash_v2_backward_pre.cu: the two small kernels around the FlashAttention-2 backward.
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 2 (backward pass).
//
//   bwd_preprocess<T>: D_i = rowsum(dO_i * O_i) (Alg.2 L4) and the saved L_i rescaled for the main kernel.
//   bwd_convert_dq<T>: dQ = scale * dQ_accum, cast to T (the fp32 atomic accumulator -> the output dtype).
//
// Used by both versions (fp32 and tc) in stages/03_flash_v2_backward/flash_v2_backward.py.
//   python stages/03_flash_v2_backward/run.py
#include "common.cuh"

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_f(float& y, float x) { y = x; }
__device__ __forceinline__ void from_f(__half& y, float x) { y = __float2half_rn(x); }
__device__ __forceinline__ void from_f(__nv_bfloat16& y, float x) { y = __float2bfloat16_rn(x); }

// One warp per query row. grid = (ceil(Nq_pad / 8), B*H), block = 256 (8 warps).
// o, dO: (BH, Nq, D) contiguous; lse: (BH, Nq) natural log.
// Dvec, Lout: (BH, Nq_pad); rows Nq..Nq_pad-1 are padding (D = 0, L = +inf: their P is exp(-inf) = 0).
// Lout = lse * lse_mult (the launcher passes 1: both backward kernels take L_i in natural units).
// A fully masked row has lse = -inf; we store +inf so that P = exp(S - L) = 0 there, never NaN.
// zero_dq: also zero this row of the fp32 dQ accumulator (BH, Nq, D) the main kernel's atomics add to
// (saves a separate memset launch); 0 in deterministic mode, which has no accumulator.
template <typename T>
__global__ void bwd_preprocess(const T* __restrict__ o, const T* __restrict__ dO, const float* __restrict__ lse,
                               float* __restrict__ Dvec, float* __restrict__ Lout, float* __restrict__ dQacc,
                               int Nq, int Nq_pad, int D, float lse_mult, int zero_dq) {
    const int row = blockIdx.x * 8 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long bh = blockIdx.y;
    if (row >= Nq_pad) return;
    float acc = 0.f;
    if (row < Nq) {
        const T* o_row = o + (bh * Nq + row) * D;
        const T* do_row = dO + (bh * Nq + row) * D;
        for (int d = lane; d < D; d += 32) acc += to_f(o_row[d]) * to_f(do_row[d]);  // dO_i * O_i
        if (zero_dq)
            for (int d = lane; d < D; d += 32) dQacc[(bh * Nq + row) * D + d] = 0.f;
    }
    acc = warp_sum(acc);  // D_i = rowsum(dO_i * O_i)
    if (lane == 0) {
        Dvec[bh * Nq_pad + row] = acc;
        const float inf = __int_as_float(0x7f800000);  // NVRTC has no INFINITY macro
        float L = row < Nq ? lse[bh * Nq + row] : -inf;
        Lout[bh * Nq_pad + row] = (L == -inf) ? inf : L * lse_mult;
    }
}

// dQ = scale * dQ_accum, elementwise over n = BH * Nq * D values, 4 per step (n is a multiple of 4: D is).
template <typename T>
__global__ void bwd_convert_dq(const float* __restrict__ acc, T* __restrict__ dq, float scale, long n) {
    for (long v = blockIdx.x * (long)blockDim.x + threadIdx.x; v < n / 4; v += (long)gridDim.x * blockDim.x) {
        const float4 a = reinterpret_cast<const float4*>(acc)[v];  // one 16-byte load
        from_f(dq[4 * v + 0], scale * a.x);
        from_f(dq[4 * v + 1], scale * a.y);
        from_f(dq[4 * v + 2], scale * a.z);
        from_f(dq[4 * v + 3], scale * a.w);
    }
}
