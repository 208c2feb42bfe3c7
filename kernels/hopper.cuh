// hopper.cuh: the sm_90a instructions stage 06 is built from, as inline PTX (compile with --gpu-architecture=sm_90a).
//   mbarrier    a 64-bit shared-memory barrier that counts arrivals and bytes; waiters test the parity of its phase
//   TMA         cp.async.bulk.tensor: the copy engine moves a box of a tensor map into shared memory, swizzled, and
//               reports the bytes to an mbarrier (complete_tx)
//   wgmma       the warpgroup's (4 warps, 128 threads) asynchronous MMA, operands read from shared memory through
//               64-bit matrix descriptors
// Layouts and descriptor fields: stages/06_hopper/swizzle.py (the same arithmetic in numpy) and its README.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

// CUtensorMap: 128 opaque bytes made on the host by cuTensorMapEncodeTiled, passed as a __grid_constant__ kernel
// parameter (the copy engine reads it from the parameter space through its generic address).
struct __align__(64) TensorMap {
    u64 opaque[16];
};

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(u32 bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}
// Make the initialised barriers visible to the copy engine (the async proxy) before any copy uses them.
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// One arrival that also announces `bytes` of copies the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Wait until the phase of this parity has completed (stages/06_hopper/schedules.py: MBarrier.try_wait_parity).
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Shared memory written by ordinary stores that wgmma or the copy engine (the async proxy) reads next: each writing
// thread fences, then a barrier orders the readers after the writers.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// The fence between the two proxies in global memory (it orders both ways): what the copy engine's bulk reductions
// wrote there, complete (bulk_wait_all), comes before this thread's later accesses, among them the fence and atomic
// that publish it to other blocks.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// ---------------------------------------------------------------- counting blocks done (GPU scope)
// *counter += v with acquire-release order; returns the old value. Release: this thread's earlier writes (and, after
// fence_proxy_async_global, the copy engine's) are visible to whoever reads the count after it; acquire: what the
// blocks that counted before released is visible to this thread's later reads. fence_acq_rel_gpu: a thread that
// learnt of the count through a barrier, not the atomic, makes those writes its own before it reads them.
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* counter, int v) {
    int old;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], %2;" : "=r"(old) : "l"(counter), "r"(v) : "memory");
    return old;
}

// ---------------------------------------------------------------- TMA
// Copy the box at element coordinates (c0 = column, c1 = row) of the 2-D tensor map into shared memory at dst; the
// bytes count towards bar's transaction.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
            dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

// A plain bulk copy (no tensor map): `bytes` (a multiple of 16) from global src to shared dst, counted on bar.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(reinterpret_cast<u64>(src)), "r"(bytes), "r"(bar)
                 : "memory");
}

// The same for a 3-D tensor map (c0 = column, c1 = row, c2 = (batch, head)): rows past a head's last are filled
// with zeros, never read from the next head.
__device__ __forceinline__ void tma_load_3d(u32 dst, const TensorMap* map, u32 bar, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];" ::"r"(dst),
        "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
        : "memory");
}

// Rows row0 .. row0 + 64 tiles - 1 of head bh (a tensor map of boxes of 64 rows x 128 bytes over D columns of BYTES
// each): each 64-row tile is D BYTES / 128 panels of 128-byte lines (64 columns of 16 bits, 128 of 8), 8 KB each,
// laid out one after the other from dst, all counted on bar.
template <int D, int BYTES = 2>
__device__ __forceinline__ void tma_load_rows(u32 dst, const TensorMap* map, u32 bar, int row0, int bh, int tiles) {
    constexpr int PANELS = D * BYTES / 128;
    for (int h = 0; h < tiles; ++h)
        for (int c = 0; c < PANELS; ++c)
            tma_load_3d(dst + (h * PANELS + c) * 8192u, map, bar, (128 / BYTES) * c, row0 + 64 * h, bh);
}

// The 128-byte swizzle repeats every 1024 bytes: a swizzled tile starts on a 1024-byte boundary of shared memory.
__device__ __forceinline__ u32 aligned_1024(const unsigned char* smem) { return (smem_addr(smem) + 1023u) & ~1023u; }

// Bulk reduction by the copy engine: the box at (c0, c1, c2) of a 3-D tensor map += the shared-memory tile at src,
// laid out as the map's swizzle says; elements outside the tensor (rows past a head's last) are skipped. Many blocks
// may add to the same rows at once (the backward's dQ). A bulk group of the issuing thread tracks it: wait_read<0>
// before src is written again, wait_all<0> before the block exits.
__device__ __forceinline__ void tma_reduce_add_3d(const TensorMap* map, u32 src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }

// ---------------------------------------------------------------- setmaxnreg
// Move registers between warpgroups (all 128 threads of a warpgroup execute it): a producer that only issues copies
// gives registers back (dec), the consumers that hold S and O take them (inc). N: registers per thread, a multiple
// of 8 in 24 .. 256.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }

// ---------------------------------------------------------------- wgmma
// Matrix descriptor of a K-major operand in the 128-byte swizzle (swizzle.descriptor): start >> 4, LBO 16 bytes
// (unused), SBO 1024 bytes (8 rows of 128 bytes), swizzle code 1 in bits 62-63.
__device__ __forceinline__ u64 desc_kmajor_128b(u32 smem_byte_addr) {
    return (u64)((smem_byte_addr & 0x3FFFF) >> 4) | (u64)(16 >> 4) << 16 | (u64)(1024 >> 4) << 32 | (u64)1 << 62;
}
// Matrix descriptor of an MN-major operand in the 128-byte swizzle (swizzle.read_operand_mn): rows of 64 N values
// (128 bytes), SBO 1024 bytes between groups of 8 K rows, LBO between panels of 64 N values.
__device__ __forceinline__ u64 desc_mnmajor_128b(u32 smem_byte_addr, u32 panel_bytes) {
    return (u64)((smem_byte_addr & 0x3FFFF) >> 4) | (u64)((panel_bytes & 0x3FFFF) >> 4) << 16 |
           (u64)(1024 >> 4) << 32 | (u64)1 << 62;
}
// The descriptor of the operand `bytes` (a multiple of 16) further on: only the start address field (bits 0-13,
// address >> 4) changes, and a shared-memory address (below 2^18) never carries out of it, so the low word alone
// takes the step: one add, where a descriptor built from the new address would take a mask, a shift and an or.
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 bytes) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (bytes >> 4));
}
// Order the registers' writes before wgmma reads them (accumulators), and group and wait for issued wgmmas.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

// The accumulator registers of an m64n64 wgmma (32), an m64n128 one (64) and an m64n192 one (96) as inline-asm
// operands %0 .. %31 (%0 .. %63, %0 .. %95), and their lists in PTX: each D list is the operands %0 .. %31
// (WGMMA_R32) or %0 .. %63 (WGMMA_R64), and for 96 the rest, in braces.
#define WGMMA_R32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_R64 WGMMA_R32 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, " \
    "%54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_D32 "{" WGMMA_R32 "}"
#define WGMMA_D64 "{" WGMMA_R64 "}"
#define WGMMA_D96 "{" WGMMA_R64 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, " \
    "%86, %87, %88, %89, %90, %91, %92, %93, %94, %95}"
// The accumulators d[i] .. d[i + 7] as asm operands with constraint C: "+f" (read and written, D += A B) or "=f"
// (written only, D = A B); then 32, 64 and 96 of them.
#define WGMMA_8(C, i) C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define WGMMA_N32(C) WGMMA_8(C, 0), WGMMA_8(C, 8), WGMMA_8(C, 16), WGMMA_8(C, 24)
#define WGMMA_N64(C) WGMMA_N32(C), WGMMA_8(C, 32), WGMMA_8(C, 40), WGMMA_8(C, 48), WGMMA_8(C, 56)
#define WGMMA_N96(C) WGMMA_N64(C), WGMMA_8(C, 64), WGMMA_8(C, 72), WGMMA_8(C, 80), WGMMA_8(C, 88)
#define WGMMA_F8(i) WGMMA_8("+f", i)
#define WGMMA_OUTS WGMMA_N32("+f")
#define WGMMA_OUTS64 WGMMA_N64("+f")
#define WGMMA_OUTS96 WGMMA_N96("+f")

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<__nv_bfloat16> { static constexpr bool value = true; };

// One wgmma of SHAPE for T = __nv_bfloat16 or __half (the instruction names the input type, so each is its own asm
// string): the scale-d predicate p from operand PRED (0: D = A B, else D += A B), then the instruction with ARGS.
#define WGMMA_ASM(T, SHAPE, PRED, ARGS, OUTS, ...)                                                                    \
    do {                                                                                                              \
        if constexpr (IsBf16<T>::value)                                                                               \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                            \
                         "wgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 " ARGS "}\n"                           \
                         : OUTS                                                                                       \
                         : __VA_ARGS__);                                                                              \
        else                                                                                                          \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                            \
                         "wgmma.mma_async.sync.aligned." SHAPE ".f32.f16.f16 " ARGS "}\n"                             \
                         : OUTS                                                                                       \
                         : __VA_ARGS__);                                                                              \
    } while (0)

// D (64 x 64, fp32) += A (64 x 16) B^T (64 x 16), A and B K-major in shared memory (descriptors), 16-bit inputs.
// scale_d = 0: D = A B^T. TA, TB = 1: that operand is MN-major instead (imm-trans; the backward's dQ = dS K reads
// dS^T and K_j as they lie). Accumulator layout (as mma.m16n8's C fragment, repeated): warp w of the warpgroup holds
// rows 16 w .. 16 w + 15; lane = 4 g + t holds, for each n-block i of 8 columns, d[4 i + e]: row 16 w + g + 8 (e / 2),
// column 8 i + 2 t + (e % 2).
template <typename T, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], u64 desc_a, u64 desc_b, int scale_d) {
    static_assert(sizeof(T) == 2, "16-bit inputs");
    WGMMA_ASM(T, "m64n64k16", "%34", WGMMA_D32 ", %32, %33, p, 1, 1, %35, %36;\n", WGMMA_OUTS, "l"(desc_a),
              "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));
}

// D (64 x 128, fp32) += A (64 x 16) B^T (128 x 16), both K-major in shared memory: S for a tile of 128 keys in one
// instruction. Against two m64n64 halves it reads A from shared memory once instead of twice: at N = 64 the two
// operands' 4 KB per instruction take as many shared-memory cycles (128 bytes a cycle) as the tensor cores take to
// multiply them, at N = 128 the 6 KB take three quarters. Accumulator layout: as above, n-blocks i = 0 .. 15.
template <typename T, int TA = 0, int TB = 0>
__device__ __forceinline__ void wgmma_64x128x16(float (&d)[64], u64 desc_a, u64 desc_b, int scale_d) {
    WGMMA_ASM(T, "m64n128k16", "%66", WGMMA_D64 ", %64, %65, p, 1, 1, %67, %68;\n", WGMMA_OUTS64, "l"(desc_a),
              "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));
}

// D (64 x 192, fp32) += A (64 x 16) B^T (192 x 16), both K-major in shared memory: S for the wide K/V tiles of
// 192 keys (stages/06_hopper/flash_v3.py: WIDE_BC). Accumulator layout: as above, n-blocks i = 0 .. 23.
template <typename T>
__device__ __forceinline__ void wgmma_64x192x16(float (&d)[96], u64 desc_a, u64 desc_b, int scale_d) {
    WGMMA_ASM(T, "m64n192k16", "%98", WGMMA_D96 ", %96, %97, p, 1, 1, 0, 0;\n", WGMMA_OUTS96, "l"(desc_a),
              "l"(desc_b), "r"(scale_d));
}

// D (64 x N, fp32) = A (64 x 16) B^T (N x 16), both K-major in shared memory, N = 64, 128 or 192: the first K step of
// a GEMM, which does not read D (scale-d 0). D's registers are the asm's outputs only ("=f", where the functions
// above read and write them, "+f"), so the compiler sees their old values die here. A GEMM that fills only part of a
// register array (the first 64 or 128 columns of S for a ragged last K/V tile, hopper_tiles.cuh: with_width) starts
// with it: with "+f" the columns it does not write stay live across the asynchronous wgmma, and ptxas serializes
// every wgmma of the kernel (its warning C7511, "insufficient register resources for the wgmma pipeline"). GEMMs of
// whole tiles start with the functions above and scale_d = 0.
template <typename T, int N>
__device__ __forceinline__ void wgmma_64xNx16_set(float (&d)[N / 2], u64 desc_a, u64 desc_b) {
    static_assert(N == 64 || N == 128 || N == 192, "m64n64, m64n128 or m64n192");
    if constexpr (N == 64)
        WGMMA_ASM(T, "m64n64k16", "0", WGMMA_D32 ", %32, %33, p, 1, 1, 0, 0;\n", WGMMA_N32("=f"), "l"(desc_a),
                  "l"(desc_b));
    else if constexpr (N == 128)
        WGMMA_ASM(T, "m64n128k16", "0", WGMMA_D64 ", %64, %65, p, 1, 1, 0, 0;\n", WGMMA_N64("=f"), "l"(desc_a),
                  "l"(desc_b));
    else
        WGMMA_ASM(T, "m64n192k16", "0", WGMMA_D96 ", %96, %97, p, 1, 1, 0, 0;\n", WGMMA_N96("=f"), "l"(desc_a),
                  "l"(desc_b));
}

// D (64 x 64, fp32) += A (64 x 16, registers) B (16 x 64, MN-major in shared memory: imm-trans-b = 1). A's fragment
// (four registers of two 16-bit values) is mma.m16n8k16's A fragment of the warp's 16 rows: a[0] row g, columns
// 2 t, 2 t + 1; a[1] row g + 8; a[2] row g, columns 8 + 2 t, 9 + 2 t; a[3] row g + 8, those columns. It is exactly
// what the accumulator of S holds for n-blocks 2 kk and 2 kk + 1 once rounded to 16 bits (P from S in registers).
template <typename T>
__device__ __forceinline__ void wgmma_64x64x16_rs(float (&d)[32], const u32 (&a)[4], u64 desc_b, int scale_d) {
    WGMMA_ASM(T, "m64n64k16", "%37", WGMMA_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n", WGMMA_OUTS, "r"(a[0]),
              "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// D (64 x 128, fp32) += A (64 x 16, registers) B (16 x 128, MN-major in shared memory): O += P V for D = 128 in one
// instruction per K step; B spans two 64-column panels, LBO bytes apart. A's fragment as above; accumulator layout
// as wgmma_64x128x16's.
template <typename T>
__device__ __forceinline__ void wgmma_64x128x16_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b, int scale_d) {
    WGMMA_ASM(T, "m64n128k16", "%69", WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n", WGMMA_OUTS64,
              "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// ---------------------------------------------------------------- wgmma on FP8
// E4M3: the 8-bit float (1 sign, 4 exponent, 3 mantissa bits; largest finite 448) of the FP8 forward. A tag: the
// kernels hold such values only as bytes in shared memory and packed four to a register. Bytes<T>: a value's size.
struct E4M3 {};
template <typename T> struct Bytes { enum : int { value = sizeof(T) }; };
template <> struct Bytes<E4M3> { enum : int { value = 1 }; };

// The 8-bit wgmma multiplies K = 32 values a step (32 bytes, as 16 values of 16 bits) and reads its shared-memory
// operands only K-major: there is no imm-trans, so V enters O += P V as V^T (stages/06_hopper/fp8.py).
#define WGMMA_E4M3(SHAPE, PRED, ARGS, OUTS, ...)                                                                      \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                                  \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32.e4m3.e4m3 " ARGS "}\n"                                  \
                 : OUTS                                                                                               \
                 : __VA_ARGS__)

// D (64 x N, fp32) (+)= A (64 x 32) B^T (N x 32), e4m3, both K-major in shared memory, N = 64 or 128; scale_d = 0:
// D = A B^T. Accumulator layout: as wgmma_64x64x16's.
template <int N>
__device__ __forceinline__ void wgmma_e4m3_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, int scale_d) {
    static_assert(N == 64 || N == 128, "m64n64k32 or m64n128k32");
    if constexpr (N == 64)
        WGMMA_E4M3("m64n64k32", "%34", WGMMA_D32 ", %32, %33, p, 1, 1;\n", WGMMA_OUTS, "l"(desc_a), "l"(desc_b),
                   "r"(scale_d));
    else
        WGMMA_E4M3("m64n128k32", "%66", WGMMA_D64 ", %64, %65, p, 1, 1;\n", WGMMA_OUTS64, "l"(desc_a), "l"(desc_b),
                   "r"(scale_d));
}
// The same with D's registers outputs only (D = A B^T): the first K step of a GEMM on part of a register array
// (wgmma_64xNx16_set says why).
template <int N>
__device__ __forceinline__ void wgmma_e4m3_ss_set(float (&d)[N / 2], u64 desc_a, u64 desc_b) {
    static_assert(N == 64 || N == 128, "m64n64k32 or m64n128k32");
    if constexpr (N == 64)
        WGMMA_E4M3("m64n64k32", "0", WGMMA_D32 ", %32, %33, p, 1, 1;\n", WGMMA_N32("=f"), "l"(desc_a), "l"(desc_b));
    else
        WGMMA_E4M3("m64n128k32", "0", WGMMA_D64 ", %64, %65, p, 1, 1;\n", WGMMA_N64("=f"), "l"(desc_a),
                   "l"(desc_b));
}
// D (64 x 128, fp32) += A (64 x 32, registers) B^T (128 x 32, K-major in shared memory), e4m3. A's fragment, four
// registers of four bytes (the lowest byte the lowest column): a[0] row g, columns 4 t .. 4 t + 3; a[1] row g + 8;
// a[2] row g, columns 16 + 4 t .. 16 + 4 t + 3; a[3] row g + 8, those columns (mma.m16n8k32's A fragment).
__device__ __forceinline__ void wgmma_e4m3_64x128_rs(float (&d)[64], const u32 (&a)[4], u64 desc_b, int scale_d) {
    WGMMA_E4M3("m64n128k32", "%69", WGMMA_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n", WGMMA_OUTS64, "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
}

// Four floats rounded to e4m3 (to nearest, saturating at +-448) and packed into one register, x0 in the lowest byte.
// cvt.e4m3x2 puts its first source in the upper byte.
__device__ __forceinline__ u32 pack_e4m3x4(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
    return (u32)lo | (u32)hi << 16;
}

// The compiler does not know that an issued wgmma writes its accumulators later, at the wait: without a fence it may
// move an ordinary read or write of those registers (the softmax reading S, the rescaling of O) across the
// wgmma.wait. An empty asm that "modifies" each register pins them: nothing that uses them moves across it.
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operands(u32 (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// ---------------------------------------------------------------- named barriers
// bar.sync id, n waits until n threads have arrived at barrier id (1 .. 15; 0 is __syncthreads); bar.arrive counts
// this thread's arrival without waiting. Two warpgroups take turns with two of them (the ping-pong schedule).
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
