// flash_v3_forward_fp32x3.cu: stage 06 version "fp32x3": the float32 forward of stage 02's fp32x3 (3xTF32, each k
// step into a fresh accumulator, V in three parts) on Hopper's wgmma instead of mma.sync.
//   * S_ij = Q_i K_j^T: wgmma m64nBCk8 .tf32 with both operands' TF32 parts in shared memory (K-major, 128-byte
//     swizzle), three per k step (small products first) into a fresh accumulator, then one rounded add into S;
//   * O_i += P_ij V_j: wgmma m64n64k8 .tf32 with P's parts in registers (S's accumulators, split) and V_j^T's three
//     parts in shared memory, keys permuted inside each k step (column t <-> key 2t, t + 4 <-> 2t + 1) so that S's C
//     fragments are P's A fragments, as in stage 02; four per k step and 64 columns, a fresh accumulator, one add;
//   * a tensor core reads no fragment a warp loaded: the shared-memory traffic that bounds stage 02's kernel at
//     d = 128 (one m-tile per warp) is gone; two fresh accumulators alternate, so one's adds run under the other's
//     wgmmas.
// NWG warpgroups (64 rows of Q_i each) share one K/V buffer. The threads read tiles ahead into registers and split
// them into the parts under the wgmmas: V_j's parts while S = Q_i K_j^T runs, K_{j+1}'s while O_i += P V_j runs, so
// the tensor cores do not wait for the splits; a warpgroup skips a tile none of its rows sees. Alg.1 of
// FlashAttention-2, grid (Tr, B*H), last Q tiles first. Launcher: stages/06_hopper/fp32x3.py.
#include "attention_tiles.cuh"
#include "hopper.cuh"
#include "params.cuh"
#include "tf32x3.cuh"

// Byte offset of 16-byte chunk c of row r inside a K-major panel of 128-byte rows with the 128-byte swizzle.
__device__ __forceinline__ u32 swz(int r, int c) { return (u32)(r * 128 + ((c ^ (r & 7)) << 4)); }

// D (64 x N, fp32) = or += A (64 x 8) B^T (N x 8), TF32, both K-major in shared memory; scale_d = 0: D = A B^T.
template <int N>
__device__ __forceinline__ void wgmma_tf32_ss(float (&d)[N / 2], u64 da, u64 db, int scale_d);
template <>
__device__ __forceinline__ void wgmma_tf32_ss<32>(float (&d)[16], u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
                 "%11, %12, %13, %14, %15}, %16, %17, p, 1, 1;\n}\n"
                 : WGMMA_F8(0), WGMMA_F8(8)
                 : "l"(da), "l"(db), "r"(scale_d));
}
template <>
__device__ __forceinline__ void wgmma_tf32_ss<64>(float (&d)[32], u64 da, u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " WGMMA_D32 ", %32, %33, p, 1, 1;\n}\n"
                 : WGMMA_OUTS
                 : "l"(da), "l"(db), "r"(scale_d));
}

// D (64 x 64, fp32) = or += A (64 x 8, TF32 in registers: mma.m16n8k8's A fragment of the warp's 16 rows) B^T, B
// (64 x 8) K-major in shared memory.
__device__ __forceinline__ void wgmma_tf32_rs64(float (&d)[32], const u32 (&a)[4], u64 db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 " WGMMA_D32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
                 : WGMMA_OUTS
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

template <int N>
__device__ __forceinline__ void add_into(float (&acc)[N], const float (&c)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] += c[i];
}

// Algorithm 1 of FA2 for one (Q tile i of 64 NWG rows, head bh), float32 in and out. D: 64 or 128; BC: keys per tile.
template <int D, int BC, int NWG>
__global__ void __launch_bounds__(128 * NWG, 1) flash_v3_forward_fp32x3(const __grid_constant__ FwdParams p) {
    constexpr int BR = 64 * NWG, NT = 128 * NWG;
    constexpr int PANELS = D / 32;        // 128-byte panels of a K-major row of D TF32 values
    constexpr u32 QP = BR * 128u;         // bytes of one panel of Q_i (BR rows)
    constexpr u32 KP = BC * 128u;         // bytes of one panel of K_j (BC rows)
    constexpr u32 VPANEL = D * 128u;      // bytes of one 32-key panel of V_j^T (D rows)
    constexpr u32 QBYTES = PANELS * QP, KBYTES = PANELS * KP, VBYTES = (BC / 32) * VPANEL;
    constexpr int CH = D / 4;                     // 16-byte chunks of a row of Q, K, V
    constexpr int KCH = (BC * CH + NT - 1) / NT;  // chunks of K_j a thread loads
    constexpr int VIT = (BC / 8 * D + NT - 1) / NT;  // (k step, column) items of V_j a thread loads: 8 keys each
    static_assert((D == 64 || D == 128) && BC % 32 == 0 && (BC == 32 || BC == 64), "d 64 or 128; Bc 32 or 64");
    const float* __restrict__ q = static_cast<const float*>(p.q);
    const float* __restrict__ k = static_cast<const float*>(p.k);
    const float* __restrict__ v = static_cast<const float*>(p.v);
    float* __restrict__ o = static_cast<float*>(p.o);
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float scale_log2 = p.exp2_scale;

    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 base = aligned_1024(smem_raw);  // Q big, Q small, K big, K small, V hi, V mid, V lo
    const u32 qb_s = base, qs_s = qb_s + QBYTES, kb_s = qs_s + QBYTES, ks_s = kb_s + KBYTES;
    const u32 vh_s = ks_s + KBYTES, vm_s = vh_s + VBYTES, vl_s = vm_s + VBYTES;
    unsigned char* gen = smem_raw + (base - smem_addr(smem_raw));  // the same bytes, for ordinary stores
    auto st16 = [&](u32 addr, uint4 x) { *reinterpret_cast<uint4*>(gen + (addr - base)) = x; };

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
    const int g = lane / 4, t = lane % 4;
    const int i = gridDim.x - 1 - blockIdx.x;
    const long bh = blockIdx.y;
    const float* kh = k + bh * Nk * D;
    const float* vh = v + bh * Nk * D;
    const int row0 = i * BR, shift = Nk - Nq;
    const int n_tiles = visited_kv_tiles<BR, BC>(row0, Nq, Nk, causal);

    // A row chunk (elements 4e..4e+3 of row r) -> its big and small parts at (row r, chunk e) of two K-major tiles.
    auto store_pairs = [&](u32 big_s, u32 small_s, u32 panel, int r, int e, float4 x) {
        u32 b[4], s[4];
        split_tf32(x.x, b[0], s[0]);
        split_tf32(x.y, b[1], s[1]);
        split_tf32(x.z, b[2], s[2]);
        split_tf32(x.w, b[3], s[3]);
        const u32 off = (e / 8) * panel + swz(r, e % 8);
        st16(big_s + off, make_uint4(b[0], b[1], b[2], b[3]));
        st16(small_s + off, make_uint4(s[0], s[1], s[2], s[3]));
    };
    auto row4 = [&](const float* src, int r, int n, int e) {
        return r < n ? __ldg(reinterpret_cast<const float4*>(src + (long)r * D) + e) : make_float4(0.f, 0.f, 0.f, 0.f);
    };
    // K_j: chunk c = tid + NT u (key c / CH, elements 4 (c % CH)..); V_j: item c = tid + NT u (k step c / D: keys
    // 8 (c / D) .. + 7, column c % D), its 8 values in key order.
    static_assert(BC * CH % NT == 0 && BC / 8 * D % NT == 0 && BR * CH % NT == 0, "whole chunks per thread");
    float4 kr[KCH];
    float vr[VIT][8];
    auto load_k = [&](int j, int u) { const int c = tid + NT * u; kr[u] = row4(kh, j * BC + c / CH, Nk, c % CH); };
    auto load_v = [&](int j, int u) {
        const int c = tid + NT * u, key0 = j * BC + 8 * (c / D), col = c % D;
#pragma unroll
        for (int x = 0; x < 8; ++x) vr[u][x] = key0 + x < Nk ? __ldg(vh + (long)(key0 + x) * D + col) : 0.f;
    };
    auto store_k = [&](int u) { const int c = tid + NT * u; store_pairs(kb_s, ks_s, KP, c / CH, c % CH, kr[u]); };
    // Half h of V item u: its even (h = 0) or odd keys, which go to positions 0-3 or 4-7 of the step's k index
    // (keys 0, 2, 4, 6, 1, 3, 5, 7): one 16-byte chunk of V_j^T row `col` in each of the three parts.
    auto store_v = [&](int u, int h) {
        const int c = tid + NT * u, kk = c / D, col = c % D;
        u32 hi[4], mid[4], lo[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) split3_tf32(vr[u][2 * x + h], hi[x], mid[x], lo[x]);
        const u32 off = (kk / 4) * VPANEL + swz(col, 2 * (kk % 4) + h);
        st16(vh_s + off, make_uint4(hi[0], hi[1], hi[2], hi[3]));
        st16(vm_s + off, make_uint4(mid[0], mid[1], mid[2], mid[3]));
        st16(vl_s + off, make_uint4(lo[0], lo[1], lo[2], lo[3]));
    };

    // Alg.1 L4: Q_i split into its parts; L6 (j = 0): K_0 split into its parts, V_0 read (it is split under the first
    // S), K_1 read. Every load is issued before the first store.
    const float* qh = q + bh * Nq * D;
    {
        constexpr int QCH = BR * CH / NT;  // chunks of Q_i a thread loads
        float4 xq[QCH];
#pragma unroll
        for (int u = 0; u < QCH; ++u) {
            const int c = tid + NT * u;
            xq[u] = row4(qh, row0 + c / CH, Nq, c % CH);
        }
        if (n_tiles > 0) {
#pragma unroll
            for (int u = 0; u < KCH; ++u) load_k(0, u);
#pragma unroll
            for (int u = 0; u < VIT; ++u) load_v(0, u);
        }
#pragma unroll
        for (int u = 0; u < QCH; ++u) {
            const int c = tid + NT * u;
            store_pairs(qb_s, qs_s, QP, c / CH, c % CH, xq[u]);
        }
    }
    if (n_tiles > 0) {
#pragma unroll
        for (int u = 0; u < KCH; ++u) {
            store_k(u);
            if (n_tiles > 1) load_k(1, u);
        }
    }
    fence_proxy_async();  // the generic-proxy stores above, before the wgmmas (async proxy) read them
    __syncthreads();

    float acc_o[1][D / 8][4];
    float m_i[1][2], l_i[1][2];
    init_row_state<1, D>(acc_o, m_i, l_i);
    const int r0 = row0 + 16 * warp;                 // this warp's first row
    const u32 q_row = (u32)(64 * wg) * 128u;         // this warpgroup's 64 rows inside each panel of Q_i
    constexpr int S_STEPS = D / 8, PV_STEPS = BC / 8 * (D / 64);
    static_assert(S_STEPS % (2 * VIT) == 0 && PV_STEPS % KCH == 0, "the stores spread evenly over the steps");

    // One K/V buffer, two barriers a tile. At the top of iteration j, K_j's parts are in shared memory and V_j is in
    // registers: V_j's parts are stored while S = Q_i K_j^T runs (every warpgroup finished reading V_{j-1}), and
    // K_{j+1}'s while O_i += P V_j runs (every warpgroup finished reading K_j). Each store is followed by the read of
    // the tile after it into the registers it freed.
    for (int j = 0; j < n_tiles; ++j) {
        const bool next = j + 1 < n_tiles, next2 = j + 2 < n_tiles;
        auto put_v = [&](int unit) {  // half unit % 2 of V item unit / 2 of V_j; after the second half, V_{j+1}'s
            store_v(unit / 2, unit % 2);
            if (unit % 2 == 1 && next) load_v(j + 1, unit / 2);
        };
        auto put_k = [&](int u) {
            if (next) {
                store_k(u);
                if (next2) load_k(j + 2, u);
            }
        };
        const int col0 = j * BC;
        const bool masked = (j + 1) * BC > Nk || (causal && (j + 1) * BC - 1 > row0 + shift);
        // The tiles' addresses, opaque to the compiler in each iteration: it makes each step's descriptors from them
        // where they are used instead of keeping dozens of 64-bit descriptors live across the loop.
        u32 qb = qb_s, qs = qs_s, kb = kb_s, ks = ks_s, vhi = vh_s, vmid = vm_s, vlo = vl_s;
        asm volatile("" : "+r"(qb), "+r"(qs), "+r"(kb), "+r"(ks), "+r"(vhi), "+r"(vmid), "+r"(vlo));
        // A warpgroup none of whose rows sees a key of this tile (causal, or rows past Nq) skips its matmuls: all its
        // scores would be masked, P = 0, and O_i, m_i, l_i would not change. The same for all 128 threads of the
        // warpgroup; it still stores its share of the tiles.
        const bool active = row0 + 64 * wg < Nq && (!causal || col0 <= min(row0 + 64 * wg + 63, Nq - 1) + shift);
        float s[1][BC / 8][4];
        if (active) {
            // Alg.1 L8: S = Q_i K_j^T, k step kk into accumulator c[kk & 1]; its add waits one step.
            float c[2][BC / 2];
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) s[0][n][0] = s[0][n][1] = s[0][n][2] = s[0][n][3] = 0.f;
            float(&sf)[BC / 2] = reinterpret_cast<float(&)[BC / 2]>(s);
#pragma unroll
            for (int kk = 0; kk < S_STEPS; ++kk) {
                const u32 qo = (kk / 4) * QP + q_row + (kk % 4) * 32u, ko = (kk / 4) * KP + (kk % 4) * 32u;
                wgmma_fence();
                wgmma_tf32_ss<BC>(c[kk & 1], desc_kmajor_128b(qs + qo), desc_kmajor_128b(kb + ko), 0);
                wgmma_tf32_ss<BC>(c[kk & 1], desc_kmajor_128b(qb + qo), desc_kmajor_128b(ks + ko), 1);
                wgmma_tf32_ss<BC>(c[kk & 1], desc_kmajor_128b(qb + qo), desc_kmajor_128b(kb + ko), 1);
                wgmma_commit();
                if (kk % (S_STEPS / (2 * VIT)) == 0) put_v(kk / (S_STEPS / (2 * VIT)));
                if (kk > 0) {
                    wgmma_wait<1>();
                    fence_operands(c[(kk - 1) & 1]);
                    add_into(sf, c[(kk - 1) & 1]);
                }
            }
            wgmma_wait<0>();
            fence_operands(c[(S_STEPS - 1) & 1]);
            add_into(sf, c[(S_STEPS - 1) & 1]);
        } else {
#pragma unroll
            for (int unit = 0; unit < 2 * VIT; ++unit) put_v(unit);
        }
        fence_proxy_async();
        __syncthreads();  // every warpgroup is done with K_j; V_j's parts are stored

        if (active) {
            if (masked) mask_scores<1, BC>(s, r0, col0, Nk, causal, shift, g, t);
            // Alg.1 L9-10 (first half) as stage 02's fp32x3 (attention_tiles.cuh)
            online_softmax_fp32<1, BC, D>(s, m_i, l_i, acc_o, scale_log2, masked);

            // Alg.1 L10: O_i += P V_j, per k step kk (8 keys) and 64-column half hh: four wgmmas, a fresh accumulator.
            float cv[2][32];
#pragma unroll
            for (int kk = 0; kk < BC / 8; ++kk) {
                u32 pb[4], ps[4];
                split_tf32(s[0][kk][0], pb[0], ps[0]);
                split_tf32(s[0][kk][2], pb[1], ps[1]);
                split_tf32(s[0][kk][1], pb[2], ps[2]);
                split_tf32(s[0][kk][3], pb[3], ps[3]);
#pragma unroll
                for (int hh = 0; hh < D / 64; ++hh) {
                    const int step = kk * (D / 64) + hh;
                    const u32 vo = (kk / 4) * VPANEL + (u32)(64 * hh) * 128u + (kk % 4) * 32u;
                    wgmma_fence();
                    wgmma_tf32_rs64(cv[step & 1], ps, desc_kmajor_128b(vhi + vo), 0);
                    wgmma_tf32_rs64(cv[step & 1], pb, desc_kmajor_128b(vlo + vo), 1);
                    wgmma_tf32_rs64(cv[step & 1], pb, desc_kmajor_128b(vmid + vo), 1);
                    wgmma_tf32_rs64(cv[step & 1], pb, desc_kmajor_128b(vhi + vo), 1);
                    wgmma_commit();
                    if (step % (PV_STEPS / KCH) == 0) put_k(step / (PV_STEPS / KCH));
                    if (step > 0) {
                        wgmma_wait<1>();
                        const int prev = step - 1, ph = prev % (D / 64);
                        fence_operands(cv[prev & 1]);
                        add_into(reinterpret_cast<float(&)[32]>(acc_o[0][8 * ph]), cv[prev & 1]);
                    }
                }
            }
            wgmma_wait<0>();
            {
                constexpr int last = PV_STEPS - 1;
                fence_operands(cv[last & 1]);
                add_into(reinterpret_cast<float(&)[32]>(acc_o[0][8 * (last % (D / 64))]), cv[last & 1]);
            }
        } else {
#pragma unroll
            for (int u = 0; u < KCH; ++u) put_k(u);
        }
        fence_proxy_async();
        __syncthreads();  // every warpgroup is done with V_j; K_{j+1}'s parts are stored
    }

    // Alg.1 L12-14, as stage 02's fp32x3 (attention_tiles.cuh)
    write_rows_fp32<1, D>(o, p.lse, acc_o, m_i, l_i, bh, Nq, r0, g, t);
}
