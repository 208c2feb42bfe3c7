// flash_v2_forward_fp32_overlap.cu: FlashAttention-2 forward, version "fp32_overlap": version "fp32" with its
// loads overlapping its math. float32 on CUDA cores.
//
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 1 (as in flash_v2_forward_fp32.cu: the same blocks,
// warps, register tiles and exp2). What changes from version "fp32", and why that is faster:
//   * K_{j+1} is read from HBM into registers while P~_ij V_j is computed, and stored to shared memory after it
//     (Alg.1 L7 one step ahead): no warp waits for K_j at the top of a step;
//   * ASYNC_V (sm_80 on, rows 16-byte aligned): V_{j+1} is copied by cp.async while S_{i,j+1} is computed, and
//     waited for only where P~ V needs it.
// Version "fp32" loads, waits, then computes; here the reads of the next tiles are in flight while the block
// computes, so the latency of global memory hides behind the FMAs. The cost: KN float4 registers a thread for
// K_{j+1}, and separate K_j and V_j buffers in shared memory (no SHARE_KV).
// Layout and shared memory: as flash_v2_forward_fp32.cu.
// Run: python stages/02_flash_v2/run.py --version fp32_overlap   (tests: pytest tests/test_02_flash_v2.py)
#include "attention_tiles.cuh"
#include "params.cuh"


#ifndef HEAD_DIM
#define HEAD_DIM 64  // one module per head dim (-DHEAD_DIM=d), any 1 <= d <= 128
#endif
#ifndef TM
#define TM 4  // rows of Q_i per lane (4 or 8)
#endif
#ifndef NWARPS
#define NWARPS 4  // warps per block
#endif
#define NTHREADS (32 * NWARPS)
#define BR (NWARPS * 4 * TM)               // Br: rows of Q_i
#define BC 64                              // Bc: keys of K_j (8 column groups x 8 keys)
#define DP (((HEAD_DIM + 31) / 32) * 32)   // head dim padded to a multiple of 32
#define DT (DP / 32)                       // float4 column groups of O_i per lane
#define LDP (BR + 4)                       // padded row of P~_ij^T
#define VEC (HEAD_DIM % 4 == 0)            // rows of q, k, v, o are float4-aligned
#ifndef ASYNC_V
#define ASYNC_V VEC  // 1: V_j comes in by cp.async while S_ij is computed (needs 16-byte aligned rows)
#endif
#if ASYNC_V && !VEC
#error "ASYNC_V needs HEAD_DIM % 4 == 0 (16-byte cp.async of whole float4)"
#endif
#define KN (BC * (DP / 4) / NTHREADS)     // float4 of K_j each thread carries from HBM to shared memory
static_assert((BC * (DP / 4)) % NTHREADS == 0, "K_j splits evenly over the threads");
static_assert(HEAD_DIM >= 1 && HEAD_DIM <= 128, "head dim 1..128");
static_assert(TM % 4 == 0, "a lane's rows are read as float4");

// 4 consecutive elements d0..d0+3 of one row of a (n, HEAD_DIM) matrix; zeros past the row's end or when
// the row does not exist (rows past the sequence: they are masked or never stored).
__device__ __forceinline__ float4 load4(const float* __restrict__ row, int d0, bool valid) {
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!valid || d0 >= HEAD_DIM) return x;
    if (VEC) return *reinterpret_cast<const float4*>(row + d0);
    x.x = row[d0];
    if (d0 + 1 < HEAD_DIM) x.y = row[d0 + 1];
    if (d0 + 2 < HEAD_DIM) x.z = row[d0 + 2];
    if (d0 + 3 < HEAD_DIM) x.w = row[d0 + 3];
    return x;
}

// dst[d][r] = src[row0 + r][d] for a ROWS x DP tile (transposed into shared memory). Consecutive threads take
// consecutive rows r, so the four scalar stores of a warp hit 32 consecutive banks.
template <int ROWS>
__device__ __forceinline__ void load_transposed(float* dst, const float* __restrict__ src, int row0, int n) {
    for (int e = threadIdx.x; e < ROWS * (DP / 4); e += NTHREADS) {
        const int r = e % ROWS, dq = e / ROWS;
        const float4 x = load4(src + (size_t)(row0 + r) * HEAD_DIM, 4 * dq, row0 + r < n);
        dst[(4 * dq + 0) * ROWS + r] = x.x;
        dst[(4 * dq + 1) * ROWS + r] = x.y;
        dst[(4 * dq + 2) * ROWS + r] = x.z;
        dst[(4 * dq + 3) * ROWS + r] = x.w;
    }
}

// This thread's part of K_j (rows row0.., KN float4): element e = tid + NTHREADS * it is row e % BC, columns
// 4 * (e / BC) .. +3. Only loads: the values stay in registers until store_kt.
__device__ __forceinline__ void fetch_k(float4 (&x)[KN], const float* __restrict__ k, int row0, int n) {
#pragma unroll
    for (int it = 0; it < KN; ++it) {
        const int e = threadIdx.x + NTHREADS * it, r = e % BC, dq = e / BC;
        x[it] = load4(k + (size_t)(row0 + r) * HEAD_DIM, 4 * dq, row0 + r < n);
    }
}
// K_j^T [DP][BC] in shared memory from fetch_k's registers (consecutive threads: consecutive keys, 32 banks).
__device__ __forceinline__ void store_kt(float* Kt, const float4 (&x)[KN]) {
#pragma unroll
    for (int it = 0; it < KN; ++it) {
        const int e = threadIdx.x + NTHREADS * it, r = e % BC, dq = e / BC;
        Kt[(4 * dq + 0) * BC + r] = x[it].x;
        Kt[(4 * dq + 1) * BC + r] = x[it].y;
        Kt[(4 * dq + 2) * BC + r] = x[it].z;
        Kt[(4 * dq + 3) * BC + r] = x[it].w;
    }
}
// V_j [BC][DP] in shared memory, as stored in HBM (consecutive threads: consecutive float4 of a row). With
// ASYNC_V by cp.async (rows past n and columns past HEAD_DIM zero-filled): it lands while the block computes.
__device__ __forceinline__ void load_v(float* Vs, const float* __restrict__ v, int row0, int n) {
    for (int e = threadIdx.x; e < BC * (DP / 4); e += NTHREADS) {
        const int c = e / (DP / 4), dq = e % (DP / 4);
        const bool ok = row0 + c < n && 4 * dq < HEAD_DIM;
#if ASYNC_V
        cp_async_16(&Vs[c * DP + 4 * dq], ok ? v + (size_t)(row0 + c) * HEAD_DIM + 4 * dq : v, ok);
#else
        *reinterpret_cast<float4*>(&Vs[c * DP + 4 * dq]) = load4(v + (size_t)(row0 + c) * HEAD_DIM, 4 * dq, ok);
#endif
    }
#if ASYNC_V
    cp_async_commit();
#endif
}

// q (B,H,Nq,D), k, v (B,H,Nk,D), o (B,H,Nq,D), lse (B,H,Nq); float32, contiguous. Grid (Tr, B*H).
// exp2_scale = scale * log2(e): S_ij is kept in base-2 units, so exp(scale s - m) = exp2(s exp2_scale - m').
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
flash_v2_forward_fp32_overlap(const __grid_constant__ FwdParams p) {
    const float* __restrict__ q = static_cast<const float*>(p.q);
    const float* __restrict__ k = static_cast<const float*>(p.k);
    const float* __restrict__ v = static_cast<const float*>(p.v);
    float* __restrict__ o = static_cast<float*>(p.o);
    float* __restrict__ lse = p.lse;
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float exp2_scale = p.exp2_scale;
    extern __shared__ __align__(16) float smem[];
    float* Qt = smem;            // Q_i^T   [DP][BR]
    float* Kt = Qt + DP * BR;    // K_j^T   [DP][BC]
    float* Vs = Kt + DP * BC;    // V_j     [BC][DP]
    float* Pt = Vs + BC * DP;    // P~_ij^T [BC][LDP]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int rg = lane / 8, cg = lane % 8;
    const int wr0 = warp * 4 * TM + rg * TM;  // this lane's first row inside Q_i
    const int i = gridDim.x - 1 - blockIdx.x;  // the last Q tiles have the most causal work: launch them first
    const size_t bh = blockIdx.y;
    q += bh * Nq * HEAD_DIM; o += bh * Nq * HEAD_DIM;
    k += bh * Nk * HEAD_DIM; v += bh * Nk * HEAD_DIM;
    lse += bh * Nq;
    const int row0 = i * BR;       // first row of Q_i
    const int shift = Nk - Nq;     // causal, bottom-right: query R sees key C iff C <= R + shift

    // Alg.1 L6: which K/V tiles to visit. Causal: the last key row0 + BR - 1 + shift of Q_i's last row bounds
    // them; tiles after it are fully masked and skipped (a Q tile with no visible key visits none).
    const int Tc = visited_kv_tiles<BR, BC>(row0, Nq, Nk, causal);  // the loop's end: Tc = ceil(Nk / Bc), causal fewer

    load_transposed<BR>(Qt, q, row0, Nq);  // Alg.1 L4
    float4 kx[KN];                         // K_j on its way from HBM to shared memory
    if (Tc > 0) {  // Alg.1 L7 for j = 0; later tiles are fetched one step ahead, below
        load_v(Vs, v, 0, Nk);
        fetch_k(kx, k, 0, Nk);
        store_kt(Kt, kx);
    }
    __syncthreads();  // Q_i and K_0 (and V_0 without ASYNC_V) are in shared memory before any warp reads them

    // Alg.1 L5: O_i, l_i, m_i on chip. l_i is this lane's partial row sum over its 8 keys of every tile (all
    // lanes of a row rescale by the same 2^(m_i - m_new)): the 8-lane reduction waits until the end.
    float acc[TM][4 * DT];
    float m_i[TM], l_i[TM];
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        m_i[r] = -INF; l_i[r] = 0.f;
#pragma unroll
        for (int c = 0; c < 4 * DT; ++c) acc[r][c] = 0.f;
    }

    for (int j = 0; j < Tc; ++j) {  // Alg.1 L6: inner loop over K_j, V_j
        // Alg.1 L8, unscaled: Q_i K_j^T for this lane's TM x 8 block: per d, TM/4 + 2 float4 reads, 8*TM FMAs.
        float s[TM][8];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < 8; ++c) s[r][c] = 0.f;
#pragma unroll 4
        for (int d = 0; d < DP; ++d) {
            float a[TM], b[8];
#pragma unroll
            for (int r4 = 0; r4 < TM / 4; ++r4) {
                const float4 x = *reinterpret_cast<const float4*>(&Qt[d * BR + wr0 + 4 * r4]);  // broadcast
                a[4 * r4] = x.x; a[4 * r4 + 1] = x.y; a[4 * r4 + 2] = x.z; a[4 * r4 + 3] = x.w;
            }
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const float4 x = *reinterpret_cast<const float4*>(&Kt[d * BC + 32 * t + 4 * cg]);
                b[4 * t] = x.x; b[4 * t + 1] = x.y; b[4 * t + 2] = x.z; b[4 * t + 3] = x.w;
            }
#pragma unroll
            for (int r = 0; r < TM; ++r)
#pragma unroll
                for (int c = 0; c < 8; ++c) s[r][c] = fmaf(a[r], b[c], s[r][c]);
        }

        // Scale to base 2 (S_ij * scale * log2 e, rounded once); mask only the diagonal tile(s) and the ragged
        // last tile (keys >= Nk): a block-wide condition, no divergence.
        const bool need_mask = (causal && (j + 1) * BC - 1 > row0 + shift) || (j + 1) * BC > Nk;
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                s[r][c] *= exp2_scale;
                if (need_mask) {
                    const int R = row0 + wr0 + r, C = j * BC + 32 * (c / 4) + 4 * cg + c % 4;
                    if (C >= Nk || (causal && C > R + shift)) s[r][c] = -INF;
                }
            }

        // Alg.1 L9-L10: online softmax, normalisation deferred. A row with no visible key so far has m_new = -inf:
        // subtracting 0 gives P~ = 0 and alpha = 0, never NaN. s was rounded before m is subtracted: P~(row max) = 1.
#pragma unroll
        for (int r = 0; r < TM; ++r) {
            float mx = s[r][0];
#pragma unroll
            for (int c = 1; c < 8; ++c) mx = fmaxf(mx, s[r][c]);
            mx = warp_max<8>(mx);  // the 8 lanes of the row group agree on rowmax(S_ij)
            const float m_new = fmaxf(m_i[r], mx);
            const float m_use = m_new == -INF ? 0.f : m_new;
            const float alpha = fast_exp2(m_i[r] - m_use);  // 2^(m_i - m_new): rescales the old l_i and O_i
            float rowsum = 0.f;
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                s[r][c] = fast_exp2(s[r][c] - m_use);  // P~_ij (ex2.approx: 2^-inf = 0)
                rowsum += s[r][c];
            }
            l_i[r] = alpha * l_i[r] + rowsum;
            m_i[r] = m_new;
#pragma unroll
            for (int c = 0; c < 4 * DT; ++c) acc[r][c] *= alpha;
        }

        // P~_ij to shared memory, transposed, so P V can read 4 rows of one key as one float4. The rows are this
        // warp's own: only the warp's lanes write and read them.
        __syncwarp();  // this warp's lanes are done reading P~_{i,j-1} (the P V below) before it is overwritten
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
            for (int r4 = 0; r4 < TM / 4; ++r4)
                *reinterpret_cast<float4*>(&Pt[(32 * (c / 4) + 4 * cg + c % 4) * LDP + wr0 + 4 * r4]) =
                    make_float4(s[4 * r4][c], s[4 * r4 + 1][c], s[4 * r4 + 2][c], s[4 * r4 + 3][c]);
        __syncwarp();  // all of this warp's P~_ij rows are written before its lanes read them
        if (j + 1 < Tc) fetch_k(kx, k, (j + 1) * BC, Nk);  // Alg.1 L7 for j + 1: in flight during P~_ij V_j
#if ASYNC_V
        cp_async_wait<0>();  // this thread's part of V_j has landed ...
        __syncthreads();     // ... and so has every other thread's: all of V_j is there for every warp
#endif

        // Alg.1 L10: O_i += P~_ij V_j for this lane's TM x 4*DT block: per key, TM/4 + DT float4 reads.
#pragma unroll 2
        for (int c = 0; c < BC; ++c) {
            float a[TM];
#pragma unroll
            for (int r4 = 0; r4 < TM / 4; ++r4) {
                const float4 x = *reinterpret_cast<const float4*>(&Pt[c * LDP + wr0 + 4 * r4]);  // broadcast
                a[4 * r4] = x.x; a[4 * r4 + 1] = x.y; a[4 * r4 + 2] = x.z; a[4 * r4 + 3] = x.w;
            }
#pragma unroll
            for (int t = 0; t < DT; ++t) {
                const float4 x = *reinterpret_cast<const float4*>(&Vs[c * DP + 32 * t + 4 * cg]);
#pragma unroll
                for (int r = 0; r < TM; ++r) {
                    acc[r][4 * t + 0] = fmaf(a[r], x.x, acc[r][4 * t + 0]);
                    acc[r][4 * t + 1] = fmaf(a[r], x.y, acc[r][4 * t + 1]);
                    acc[r][4 * t + 2] = fmaf(a[r], x.z, acc[r][4 * t + 2]);
                    acc[r][4 * t + 3] = fmaf(a[r], x.w, acc[r][4 * t + 3]);
                }
            }
        }
        if (j + 1 < Tc) {  // the same for the whole block: the barriers are reached by every thread
            __syncthreads();  // every warp is done reading K_j (S_ij) and V_j (P~_ij V_j): they may be overwritten
            load_v(Vs, v, (j + 1) * BC, Nk);  // with ASYNC_V it lands while S_{i,j+1} is computed
            store_kt(Kt, kx);
            __syncthreads();  // K_{j+1} (and V_{j+1} without ASYNC_V) is in shared memory before any warp reads it
        }
    }

    // Alg.1 L12-L15: O_i = diag(l_i)^-1 O_i and L_i = m_i + log(l_i), written once. m_i is in base-2 units:
    // L_i = ln2 * (m_i + log2 l_i). A row that saw no key (l_i = 0) gets O_i = 0, L_i = -inf.
#pragma unroll
    for (int r = 0; r < TM; ++r) {
        const float l = warp_sum<8>(l_i[r]);  // the 8 lanes' partial row sums
        const int R = row0 + wr0 + r;
        if (R >= Nq) continue;  // rows past the end of the sequence (the last Q tile)
        const float inv = l > 0.f ? 1.f / l : 0.f;
        float* orow = o + (size_t)R * HEAD_DIM;
#pragma unroll
        for (int t = 0; t < DT; ++t) {
            const int d0 = 32 * t + 4 * cg;
            if (d0 >= HEAD_DIM) continue;
            const float4 x = make_float4(acc[r][4 * t] * inv, acc[r][4 * t + 1] * inv, acc[r][4 * t + 2] * inv,
                                         acc[r][4 * t + 3] * inv);
            if (VEC) {
                *reinterpret_cast<float4*>(orow + d0) = x;  // 8 lanes: 128 consecutive bytes of the row
            } else {
                orow[d0] = x.x;
                if (d0 + 1 < HEAD_DIM) orow[d0 + 1] = x.y;
                if (d0 + 2 < HEAD_DIM) orow[d0 + 2] = x.z;
                if (d0 + 3 < HEAD_DIM) orow[d0 + 3] = x.w;
            }
        }
        if (cg == 0) lse[R] = l != 0.f ? m_i[r] * 0.6931471805599453f + logf(l) : -INF;  // NaN in: NaN out
    }
}
