// flash_v2_backward_pre.cu: the two small kernels around the FlashAttention-2 backward (versions fp32 and tc).
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 2 (backward pass).
//
//   bwd_preprocess<T>: D_i = rowsum(dO_i * O_i) (Alg.2 L4), once per row before the main kernel instead of at every
//     step (stage 01), and L_i for the main kernel (+inf where the lse is -inf, so that P_ij = 0 there).
//   bwd_convert_dq<T>: dQ = scale * dQ_accum cast to T: the fp32 buffer the main kernel's atomics add to becomes the
//     output. The last launch of version fp32 (scale: it adds dS K) and of version tc on long heads (scale 1: it adds
//     scale dS K); on short heads the tc kernel's last block of each head does it (flash_v2_backward_tc.cu; the
//     launcher's fuse_dq_rule picks).
// Launched by stages/03_flash_v2_backward/fp32.py, tc.py, fp32x3.py.   Run: python stages/03_flash_v2_backward/run.py
#include "common.cuh"
#include "params.cuh"

__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// 8 consecutive values of a row as floats: one 16-byte load (16-bit types) or two (float).
__device__ __forceinline__ void load8(float (&v)[8], const float* p) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <typename T>
__device__ __forceinline__ void load8(float (&v)[8], const T* p) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* h = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = to_f(h[e]);
}

// D / 8 lanes per query row, 8 consecutive columns each (16-byte loads); a block of 8 warps takes 2048 / D rows.
// grid = (Nq_pad * D / 2048, B*H), block = 256; D (BwdParams.head_dim) a multiple of 8, at most 256.
// BwdParams (params.cuh): o, dO (BH, ldq, D), rows 0..Nq-1 read (ldq = Nq; a ring block: pointers at its shard's
// first row, ldq its length); lse (BH, ldq), natural log. D_i, L_i (BH, Nq_pad); rows Nq.. are padding (D = 0,
// L = +inf: P = 0). L_i = lse, and +inf where lse = -inf (a fully masked row: P = 0, never NaN).
// zero_dq: also zero this row of the fp32 dQ accumulator (BH, ldq, D) and the tc kernel's n_done block counters
// (no separate memset launch); 0 in deterministic mode, which has no accumulator, and for a ring block.
template <typename T>
__global__ void bwd_preprocess(const __grid_constant__ BwdParams p) {
    const T* __restrict__ o = static_cast<const T*>(p.o);
    const T* __restrict__ dO = static_cast<const T*>(p.dO);
    const int Nq = p.Nq, ldq = p.ldq, Nq_pad = p.Nq_pad, D = p.head_dim;
    if (p.zero_dq) {  // the counters: one per thread of the grid, from the first
        const long first = ((long)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
        for (long c = first; c < p.n_done; c += (long)gridDim.x * gridDim.y * blockDim.x) p.done[c] = 0;
    }
    const int lpr = D / 8;  // lanes per row
    const int row = blockIdx.x * (2048 / D) + threadIdx.x / lpr, c = (threadIdx.x % lpr) * 8;
    const long bh = blockIdx.y;
    float acc = 0.f;
    if (row < Nq) {
        const long at = (bh * ldq + row) * D + c;
        float a[8], b[8];
        load8(a, o + at);
        load8(b, dO + at);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += a[e] * b[e];  // dO_i * O_i
        if (p.zero_dq) {
            const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            reinterpret_cast<float4*>(p.dQ_accum + at)[0] = z;
            reinterpret_cast<float4*>(p.dQ_accum + at)[1] = z;
        }
    }
    for (int m = lpr / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);  // D_i = rowsum(dO_i * O_i)
    if (c == 0 && row < Nq_pad) {
        p.D_i[bh * Nq_pad + row] = acc;
        const float L = row < Nq ? p.lse[bh * ldq + row] : -INF;
        p.L_i[bh * Nq_pad + row] = (L == -INF) ? INF : L;
    }
}

// dQ = scale * dQ_accum, elementwise over n = BH * Nq * D values, 4 per step (n is a multiple of 4: D is), by every
// thread of the grid (common.cuh's convert_dq). The last launch of version fp32, and of version tc on long heads.
template <typename T>
__global__ void bwd_convert_dq(const float* __restrict__ acc, T* __restrict__ dq, float scale, long n) {
    convert_dq<4>(acc, dq, scale, n / 4, blockIdx.x * (long)blockDim.x + threadIdx.x, (long)gridDim.x * blockDim.x);
}
