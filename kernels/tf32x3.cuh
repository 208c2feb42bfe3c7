// tf32x3.cuh: the 3xTF32 split and the TF32 mma of the float32 tensor-core kernels (versions fp32x3 of the forward,
// flash_v2_forward_fp32x3.cu, and of the backward, flash_v2_backward_fp32x3.cu).
// TF32 keeps 10 of fp32's 23 mantissa bits. A float x = big + small, both TF32, holds 21 of them; a product
// a b = a_small b_big + a_big b_small + a_big b_big (a_small b_small, below fp32's last bit, dropped) is then three
// tensor-core mma with close to fp32 accuracy (PyTorch's float32 attention on tensor cores does the same).
// mma.sync m16n8k8 .tf32 fragments (PTX ISA), lane = 4 g + t, (row, col):
//   A 16x8: a[0] = (g, t), a[1] = (g+8, t), a[2] = (g, t+4), a[3] = (g+8, t+4);   B 8x8: b[0] = (t, g), b[1] = (t+4, g)
//   C 16x8: c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
#pragma once
#include "common.cuh"

// x = big + small, both TF32 (10 explicit mantissa bits): big = x rounded to TF32 (its low 13 bits cleared, so
// x - big is exact), small = the rest rounded to TF32.
__device__ __forceinline__ void split_tf32(float x, u32& big, u32& small) {
    u32 b;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(b) : "f"(x));
    b &= 0xffffe000u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(small) : "f"(x - __uint_as_float(b)));
    big = b;
}

// D (16x8 fp32) += A (16x8 TF32) * B (8x8 TF32).
__device__ __forceinline__ void mma_1688_tf32(float c[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A * B with a zero accumulator (no register to clear).
__device__ __forceinline__ void mma_1688_tf32_zero(float c[4], const u32 a[4], const u32 b[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.f));
}

// x = hi + mid + lo exactly, all TF32: V's three-part split (two parts hold only 22 of fp32's 24 significant bits),
// so that a one-hot row of P gives that row of V exactly, as fp32 attention does.
__device__ __forceinline__ void split3_tf32(float x, u32& hi, u32& mid, u32& lo) {
    u32 b;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(b) : "f"(x));
    b &= 0xffffe000u;
    const float r = x - __uint_as_float(b);  // exact, at most 12 significant bits
    u32 m;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(m) : "f"(r));
    m &= 0xffffe000u;
    hi = b, mid = m, lo = __float_as_uint(r - __uint_as_float(m));  // r - mid: exact, one significant bit
}
