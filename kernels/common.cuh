// common.cuh: plumbing shared by the kernels, and nothing else.
// Warp reductions, tensor-core mma / ldmatrix wrappers (inline PTX), cp.async, fp16/bf16 packing.
// Every algorithm (its loops, tiles and masking) lives in its own kernels/*.cu file.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <stdint.h>: name the 32-bit register type ourselves.
typedef unsigned int u32;

// NVRTC has no <math.h> INFINITY either: +infinity by its bit pattern.
#define INF __int_as_float(0x7f800000)
#define LOG2E_F 1.4426950408889634f  // log2(e): exp(x) = exp2(x log2 e)

// ---------------------------------------------------------------- warp reductions
// Reduce over the `width` lanes of each group (width a power of two <= 32, groups aligned). width = 4 reduces over
// a quad (the lanes 4g..4g+3 below), which holds whole rows of an mma accumulator: the softmax's row max and row sum.
template <int width = 32>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = width / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}
template <int width = 32>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = width / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// ---------------------------------------------------------------- 16-bit element types
// The tensor-core kernels are templates over T = __half or __nv_bfloat16.
template <typename T> struct Half2;
template <> struct Half2<__half> {
    // two floats -> one 32-bit register holding (lo, hi) as fp16
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<u32*>(&h);
    }
    static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <> struct Half2<__nv_bfloat16> {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<u32*>(&h);
    }
    static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// ---------------------------------------------------------------- storing results
// Two adjacent results (columns 2t, 2t+1 of a C fragment row) from fp32 accumulators. TO is the output type:
// __half / __nv_bfloat16 round once here; float keeps the accumulator's value (the ring merges partial
// results in float32 before anything is rounded).
__device__ __forceinline__ void store2(float* p, float lo, float hi) {
    *reinterpret_cast<float2*>(p) = make_float2(lo, hi);
}
__device__ __forceinline__ void store2(__half* p, float lo, float hi) {
    *reinterpret_cast<u32*>(p) = Half2<__half>::pack(lo, hi);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float lo, float hi) {
    *reinterpret_cast<u32*>(p) = Half2<__nv_bfloat16>::pack(lo, hi);
}
// Four adjacent results: one 16-byte store (float) or one 8-byte store (16-bit types).
template <typename TO>
__device__ __forceinline__ void store4(TO* p, float a, float b, float c, float d) {
    uint2 u;
    u.x = Half2<TO>::pack(a, b);
    u.y = Half2<TO>::pack(c, d);
    *reinterpret_cast<uint2*>(p) = u;
}
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
}

// The backward's last step, dQ = scale * dQ_accum cast to TO: groups v = first, first + step, .. < n4 of 4 values
// (the caller's threads split the groups). Loads skip L1 (ld.global.cg): the accumulator was written by atomics,
// which other blocks made in L2. U groups per thread are loaded before any is stored, so U loads are in flight at
// once (the last round's too: each load has its own bound check, no load waits for another): a whole grid has
// enough threads to keep memory busy with a few; one block converting alone needs more.
template <int U, typename TO>
__device__ __forceinline__ void convert_dq(const float* __restrict__ acc, TO* __restrict__ dq, float scale, long n4,
                                           long first, long step) {
    const float4* a4 = reinterpret_cast<const float4*>(acc);
    for (long v = first; v < n4; v += U * step) {
        float4 a[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (v + u * step < n4) a[u] = __ldcg(a4 + v + u * step);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (v + u * step < n4)
                store4(dq + 4 * (v + u * step), scale * a[u].x, scale * a[u].y, scale * a[u].z, scale * a[u].w);
    }
}

// ---------------------------------------------------------------- accumulators
// N accumulator fragments (4 floats each) set to 0 before an mma chain.
template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
}

// ---------------------------------------------------------------- C fragment -> A fragment
// The fp32 accumulator of n-tile n (rows g, g+8; columns 2t, 2t+1; see the layout below) is exactly half of the
// A fragment of k-step n/2 once rounded to 16 bits: a result feeds the next mma without leaving registers.
template <typename T>
__device__ __forceinline__ void c_to_a(u32 (&a)[4], int n, const float c[4]) {
    a[(n % 2) * 2 + 0] = Half2<T>::pack(c[0], c[1]);  // row g
    a[(n % 2) * 2 + 1] = Half2<T>::pack(c[2], c[3]);  // row g + 8
}

// ---------------------------------------------------------------- mma.sync m16n8k16
// D (16x8, fp32) += A (16x16, row-major fragment) * B (16x8, column-major fragment).
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 * group + tid_in_group:
//   A: a[0] = (row g,   cols 2t..2t+1), a[1] = (row g+8, cols 2t..2t+1),
//      a[2] = (row g,   cols 2t+8..),   a[3] = (row g+8, cols 2t+8..)
//   B: b[0] = (rows 2t..2t+1, col g),   b[1] = (rows 2t+8..2t+9, col g)
//   C/D: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g+8, cols 2t, 2t+1)
// The 4 lanes of one group g (lanes 4g..4g+3) are a quad: together they hold all 8 columns of rows g and g+8 of C.
template <typename T>
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], const u32 b[2]);

// sm_75 (T4) has no m16n8k16 for 16-bit inputs, but it has m16n8k8 for fp16, whose A fragment is a[0..1] above
// (k = 0..7) and whose B fragment is b[0]: one m16n8k16 is the two m16n8k8 of its halves of k, summed into D.
template <>
__device__ __forceinline__ void mma_16816<__half>(float c[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
#pragma unroll
    for (int h = 0; h < 2; ++h)
        asm volatile(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[2 * h]), "r"(a[2 * h + 1]), "r"(b[h]));
#endif
}
// bf16 tensor-core math begins with sm_80; the launchers refuse bf16 below it (stages/common/device.py).
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float c[4], const u32 a[4], const u32 b[2]) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();
#endif
}

// ---------------------------------------------------------------- ldmatrix
// Each lane passes the shared-memory address of one 16-byte row (8 x 16-bit) of an 8x8 tile:
// lanes 0-7 address tile 0, 8-15 tile 1, 16-23 tile 2, 24-31 tile 3. Register r[i] gets tile i
// in the mma fragment layout; .trans transposes each 8x8 tile on the way: lane 4g + t gets row g, columns 2t, 2t+1
// of a tile, and with .trans rows 2t, 2t+1 of column g. Shared addresses (smem_u32) are in bytes.
__device__ __forceinline__ u32 smem_u32(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(smem_row)));
}
// The same on a 32-bit shared address: a kernel that computes one base address per lane and adds
// compile-time offsets saves the registers 64-bit generic pointers would take.
__device__ __forceinline__ void ldsm_x4(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 r[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(u32 r[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(u32 r[2], const void* smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(smem_row)));
}

// ---------------------------------------------------------------- cp.async (sm_80+), plain copies on sm_75
// Copy 16 bytes global -> shared without passing through registers. When `valid` is false the
// 16 shared bytes are zero-filled (src-size 0): rows past the end of the sequence read as zeros.
#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
// The same on a 32-bit shared address, predicated or (for tiles known to be in bounds) always 16 bytes.
__device__ __forceinline__ void cp_async_16_u32(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_16_u32(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most `n` committed groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(n)); }
#else
// sm_75 has no cp.async. The same calls load the 16 bytes into registers and store them to shared memory before
// they return, so every copy has landed by the time a wait is reached (commit and wait do nothing): a synchronous
// copy is one of the orders an asynchronous one may take, and the kernels' barriers stay what makes the stores
// visible to the other threads. What is lost is the overlap of the loads with the math.
__device__ __forceinline__ void st_shared_16(u32 dst, uint4 x) {
    asm volatile("st.shared.v4.b32 [%0], {%1,%2,%3,%4};\n" :: "r"(dst), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w)
                 : "memory");
}
__device__ __forceinline__ void cp_async_16_u32(u32 dst, const void* src, bool valid) {
    st_shared_16(dst, valid ? __ldcg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0));
}
__device__ __forceinline__ void cp_async_16_u32(u32 dst, const void* src) {
    st_shared_16(dst, __ldcg(reinterpret_cast<const uint4*>(src)));
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    cp_async_16_u32(smem_u32(smem), gmem, valid);
}
__device__ __forceinline__ void cp_async_commit() {}
template <int n>
__device__ __forceinline__ void cp_async_wait() {}
#endif

// ---------------------------------------------------------------- fast exp2
// ex2.approx: 2^x in one SFU instruction (the kernels fold log2(e) into the softmax scale).
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// tanh(y) for the backward's softcap, from t = 2 y log2(e): tanh(y) = 1 - 2 / (e^{2y} + 1). e^{2y} is one SFU
// exp2; the reciprocal r = 1 / d runs on the FMA units instead of the SFU, which the backward's exp2 of P and of
// the cap keep busy (two SFU operations a score, not three; the forward's transform_scores, attention_tiles.cuh,
// takes its reciprocal from the SFU, where the forward's FMA units are the busier ones). r starts from a guess
// read off the bit pattern (relative error at most 12%); three of Newton's steps r <- r + r (1 - d r) each square
// the error (12% -> 1.4% -> 2e-4 -> fp32 rounding). d is capped at 2^100 (e^{2y} is inf for y > 44): 2 r is then
// below 1e-30 and tanh = 1 in fp32. Absolute error ~2e-7.
__device__ __forceinline__ float tanh_from_exp2(float t) {
    const float d = fminf(fast_exp2(t) + 1.f, 1.2676506e30f);
    float r = __int_as_float(0x7EF311C3 - __float_as_int(d));
#pragma unroll
    for (int it = 0; it < 3; ++it) r = fmaf(r, fmaf(-d, r, 1.f), r);
    return fmaf(-2.f, r, 1.f);
}
