// flash_v2_backward_fp32x3.cu: FlashAttention-2 backward, version "fp32x3": float32 on TF32 tensor cores (3xTF32).
//
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 2, as in flash_v2_backward_fp32.cu: a block per
// (K/V tile j, batch*head) keeps dK_j, dV_j on chip and loops over the Q tiles i; dQ_i is added atomically.
// What changes from version "fp32", and why: the five matmuls run on the tensor cores, with the 3xTF32 split of the
// forward's version fp32x3 (tf32x3.cuh) for close to fp32 accuracy; the warp layout is version tc's:
//   * warp w owns keys 16w..16w+15 of K_j: S^T = K_j Q_i^T and dP^T = V_j dO_i^T are 16 x BR per warp, and their C
//     fragments, split, are the A fragments of dV_j += P^T dO_i and dK_j += dS^T Q_i (k index permuted: column t
//     <-> query 2t, t+4 <-> 2t+1), so P^T and dS^T need no trip through shared memory;
//   * S^T, dP^T: each k step into a fresh accumulator, then one rounded fp32 add (tensor-core adds truncate, and S
//     feeds an exponential); dV_j, dK_j, dQ_i: one tensor-core chain per Q tile, then one rounded add;
//   * P_ij = exp(scale S_ij - L_i): one FMA and expf (log2 e folded into the scale would round once more);
//   * dQ_i += dS_ij K_j: dS^T through shared memory, warp w adds D / NW columns of dQ_i to the fp32 accumulator;
//   * Q_i, dO_i, L_i, D_i by cp.async, one buffer: tile i+1 lands during tile i's dQ step (which reads only dS^T and
//     K_j), so the shared memory of a second buffer goes to a larger BR instead.
// Shared (floats): K_j, V_j [BC][D+4]; Q_i, dO_i [BR][D+4]; dS^T [BC][BR+4]; L_i, D_i [BR]. The
// +4 makes every fragment load conflict-free: rows g, columns t / t+4 (4g + t) and rows 2t / 2t+1, column g (8t + g).
// Run: python stages/03_flash_v2_backward/run.py --version fp32x3   (tests: pytest tests/test_03_flash_v2_backward.py)
#include "tf32x3.cuh"
#include "backward_dq.cuh"
#include "params.cuh"

// The A fragments (16 x 8, TF32 big and small parts) of rows r, r + 8 of a [.][LD] float tile at columns c + t,
// c + t + 4; `at` points at row r + g, column c + t.
template <int LD>
__device__ __forceinline__ void load_a_split(const float* at, u32 (&big)[4], u32 (&small)[4]) {
    split_tf32(at[0], big[0], small[0]);
    split_tf32(at[8 * LD], big[1], small[1]);
    split_tf32(at[4], big[2], small[2]);
    split_tf32(at[8 * LD + 4], big[3], small[3]);
}

// acc (16 x BR, NS = BR / 8 n-tiles) += A B^T for this warp's 16 rows A (a_at: row g, column t of a [.][LD] tile) and
// the BR rows B of a [BR][LD] tile (b_at: row g, column t), over D columns: S^T = K_j Q_i^T, dP^T = V_j dO_i^T.
// Each k step goes to a fresh accumulator, then one rounded add.
template <int D, int NS, int LD>
__device__ __forceinline__ void rows_times_rows_t(const float* a_at, const float* b_at, float (&acc)[NS][4]) {
#pragma unroll
    for (int n = 0; n < NS; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < D / 8; ++kk) {  // columns 8kk..8kk+7
        u32 ab[4], as[4];
        load_a_split<LD>(a_at + 8 * kk, ab, as);
#pragma unroll
        for (int n = 0; n < NS; ++n) {  // B rows 8n..8n+7: b[0] = (column t, row g), b[1] = (column t+4, row g)
            const float* b = b_at + 8 * n * LD + 8 * kk;
            u32 bb[2], bs[2];
            split_tf32(b[0], bb[0], bs[0]);
            split_tf32(b[4], bb[1], bs[1]);
            float c[4];
            mma_1688_tf32_zero(c, as, bb);  // small products first
            mma_1688_tf32(c, ab, bs);
            mma_1688_tf32(c, ab, bb);
            acc[n][0] += c[0], acc[n][1] += c[1], acc[n][2] += c[2], acc[n][3] += c[3];
        }
    }
}

// acc (16 x D, D / 8 n-tiles) += A B for A = the 16 x BR C fragments c (NS = BR / 8 k steps, this warp's P^T or
// dS^T) and B = a [BR][LD] tile (dO_i or Q_i; b_at: row 2t, column g). The C fragment of n-tile kk is the A fragment
// of k step kk with the permuted k index: a = (c[0], c[2], c[1], c[3]), and B's rows 2t, 2t+1 match it.
template <int D, int NS, int LD>
__device__ __forceinline__ void tile_t_times_rows(const float (&c)[NS][4], const float* b_at, float (&acc)[D / 8][4]) {
    u32 ab[NS][4], as[NS][4];
#pragma unroll
    for (int kk = 0; kk < NS; ++kk) {
        split_tf32(c[kk][0], ab[kk][0], as[kk][0]);
        split_tf32(c[kk][2], ab[kk][1], as[kk][1]);
        split_tf32(c[kk][1], ab[kk][2], as[kk][2]);
        split_tf32(c[kk][3], ab[kk][3], as[kk][3]);
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {  // columns 8n..8n+7
        float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int kk = 0; kk < NS; ++kk) {  // rows 8kk + 2t, 8kk + 2t + 1 of B
            const float* b = b_at + 8 * kk * LD + 8 * n;
            u32 bb[2], bs[2];
            split_tf32(b[0], bb[0], bs[0]);
            split_tf32(b[LD], bb[1], bs[1]);
            mma_1688_tf32(s, as[kk], bb);
            mma_1688_tf32(s, ab[kk], bs);
            mma_1688_tf32(s, ab[kk], bb);
        }
        acc[n][0] += s[0], acc[n][1] += s[1], acc[n][2] += s[2], acc[n][3] += s[3];
    }
}

// One BwdParams (params.cuh): q, dO (BH, Nq, D); k, v, dK, dV (BH, Nk, D); L_i, D_i (BH, Nq_pad) from bwd_preprocess
// (natural log; +inf for masked and padding rows, D = 0 there); dQ_accum (BH, Nq, D) fp32, zeroed: it receives dS K
// (the conversion scales). grid = (ceil(Nk / BC), BH), 32 NW threads; BC = 16 NW keys per block, BR queries per Q
// tile.
template <int D, int NW, int BR, int MINB>
__global__ void __launch_bounds__(32 * NW, MINB) flash_bwd_fp32x3(const __grid_constant__ BwdParams p) {
    const int Nq = p.Nq, Nk = p.Nk, causal = p.causal;
    const float scale = p.scale;
    constexpr int BC = 16 * NW, NT = 32 * NW;
    constexpr int LD = D + 4, LDS = BR + 4, CH = D / 4;  // padded rows (floats); 16-byte chunks per row
    constexpr int NS = BR / 8;          // n-tiles of S^T (queries): the k steps of dV_j, dK_j
    constexpr int NQ = D / NW / 8;      // n-tiles of this warp's columns of dQ_i
    constexpr int MQ = BR / 16;         // m-tiles of dQ_i
    static_assert(D % (8 * NW) == 0 && BR % 16 == 0 && 128 % BR == 0 && BR / 2 <= NT,
                  "D: a multiple of 8 NW; BR: a multiple of 16 dividing the preprocess's 128-row padding");
    extern __shared__ __align__(16) float smem[];
    float* Ks = smem;                   // [BC][LD]
    float* Vs = Ks + BC * LD;           // [BC][LD]
    float* Qs = Vs + BC * LD;           // [BR][LD]
    float* dOs = Qs + BR * LD;          // [BR][LD]
    float* dSs = dOs + BR * LD;         // [BC][LDS]: dS_ij^T
    float* Ls = dSs + BC * LDS;         // [BR]
    float* Ds = Ls + BR;                // [BR]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int j = blockIdx.x;
    const long bh = blockIdx.y;
    const int off = Nk - Nq;  // bottom-right causal alignment: query q sees key kv iff kv <= q + off
    const float* __restrict__ Q = static_cast<const float*>(p.q) + bh * Nq * D;  // this head's rows
    const float* __restrict__ dO = static_cast<const float*>(p.dO) + bh * Nq * D;
    float* __restrict__ dQacc = p.dQ_accum + bh * Nq * D;
    const float* __restrict__ K = static_cast<const float*>(p.k) + bh * Nk * D;
    const float* __restrict__ V = static_cast<const float*>(p.v) + bh * Nk * D;
    float* __restrict__ dK = static_cast<float*>(p.dK) + bh * Nk * D;
    float* __restrict__ dV = static_cast<float*>(p.dV) + bh * Nk * D;
    const float* __restrict__ Lg = p.L_i + bh * p.Nq_pad;
    const float* __restrict__ Dg = p.D_i + bh * p.Nq_pad;

    // rows r0.. of a [n][D] matrix into a [rows][LD] tile by cp.async; rows >= n read as zeros
    auto load_rows = [&](float* dst, const float* src, int r0, int rows, int n) {
        for (int c = tid; c < rows * CH; c += NT) {
            const int r = c / CH, ch = c % CH;
            const bool ok = r0 + r < n;
            cp_async_16(dst + r * LD + ch * 4, ok ? src + (long)(r0 + r) * D + ch * 4 : src, ok);
        }
    };
    // Q_i, dO_i, L_i, D_i (L_i, D_i are padded: always in range)
    auto load_q_tile = [&](int i) {
        load_rows(Qs, Q, i * BR, BR, Nq);
        load_rows(dOs, dO, i * BR, BR, Nq);
        if (tid < BR / 4) cp_async_16(Ls + 4 * tid, Lg + i * BR + 4 * tid, true);
        else if (tid < BR / 2) cp_async_16(Ds + 4 * (tid - BR / 4), Dg + i * BR + 4 * (tid - BR / 4), true);
    };

    const int Tr = (Nq + BR - 1) / BR;
    const int i_begin = causal ? max(0, j * BC - off) / BR : 0;  // earlier Q tiles see none of K_j
    // Alg.2 L6: load K_j, V_j, with the first Q tile
    load_rows(Ks, K, j * BC, BC, Nk);
    load_rows(Vs, V, j * BC, BC, Nk);
    if (i_begin < Tr) load_q_tile(i_begin);
    cp_async_commit();

    // Alg.2 L7: dK_j = dV_j = 0: this warp's 16 rows, entries (g, 2t..2t+1) and (g+8, ..) of n-tile n
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) dk[n][r] = dv[n][r] = 0.f;
    const int key0 = 16 * warp;                    // this warp's first key in K_j
    const float* k_at = Ks + (key0 + g) * LD + t;  // A fragments of K_j, V_j: row g, column t
    const float* v_at = Vs + (key0 + g) * LD + t;
    const int dc0 = warp * (D / NW);               // this warp's first column of dQ_i

    for (int i = i_begin; i < Tr; ++i) {  // Alg.2 L8
        cp_async_wait<0>();
        __syncthreads();  // tile i has landed; every warp is done with tile i-1 (its dQ step read dS^T)
        const int q0 = i * BR;

        // Alg.2 L10-L13: S^T = K_j Q_i^T, dP^T = V_j dO_i^T (unscaled), this warp's 16 keys x BR queries
        float s[NS][4], dp[NS][4];
        rows_times_rows_t<D, NS, LD>(k_at, Qs + g * LD + t, s);
        rows_times_rows_t<D, NS, LD>(v_at, dOs + g * LD + t, dp);
        // P^T = exp(scale S^T - L), dS^T = P^T * (dP^T - D_i). Entry e of n-tile n: key key0 + g + 8 (e / 2),
        // query 8n + 2t + e % 2. Masked: keys past Nk (zero rows of K_j give S = 0, not P = 0) and, causal, keys
        // right of the diagonal; queries past Nq have L = +inf (P = 0) and D = 0.
        const bool masked = (j + 1) * BC > Nk || (causal && j * BC + BC - 1 > q0 + off);
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            const float2 l = *reinterpret_cast<const float2*>(Ls + 8 * n + 2 * t);
            const float2 d = *reinterpret_cast<const float2*>(Ds + 8 * n + 2 * t);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float p = expf(fmaf(s[n][e], scale, -(e % 2 ? l.y : l.x)));
                if (masked) {
                    const int kv = j * BC + key0 + g + 8 * (e / 2), q = q0 + 8 * n + 2 * t + e % 2;
                    if (kv >= Nk || (causal && kv > q + off)) p = 0.f;
                }
                s[n][e] = p;
                dp[n][e] = p * (dp[n][e] - (e % 2 ? d.y : d.x));
            }
            // dS^T to shared memory for the dQ step: rows key0 + g, key0 + g + 8, columns 8n + 2t..
            *reinterpret_cast<float2*>(dSs + (key0 + g) * LDS + 8 * n + 2 * t) = make_float2(dp[n][0], dp[n][1]);
            *reinterpret_cast<float2*>(dSs + (key0 + g + 8) * LDS + 8 * n + 2 * t) = make_float2(dp[n][2], dp[n][3]);
        }
        // Alg.2 L11: dV_j += P^T dO_i;  L14: dK_j += dS^T Q_i (scaled at the end)
        tile_t_times_rows<D, NS, LD>(s, dOs + 2 * t * LD + g, dv);
        tile_t_times_rows<D, NS, LD>(dp, Qs + 2 * t * LD + g, dk);
        __syncthreads();  // dS^T is complete; Q_i, dO_i are no longer read
        if (i + 1 < Tr) {  // tile i+1 lands during the dQ step
            load_q_tile(i + 1);
            cp_async_commit();
        }

        // Alg.2 L15: dQ_i += dS_ij K_j over the block's BC keys; this warp's NQ n-tiles of columns dc0.., MQ m-tiles.
        // A = dS (query rows, keys 2t / 2t+1 with the permuted k index) read from dS^T; B = K_j rows 2t, 2t+1.
        float acc[MQ][NQ][4];
#pragma unroll
        for (int m = 0; m < MQ; ++m)
#pragma unroll
            for (int n = 0; n < NQ; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.f;
#pragma unroll 2
        for (int kk = 0; kk < BC / 8; ++kk) {  // keys 8kk..8kk+7
            u32 ab[MQ][4], as[MQ][4];
            const float* a = dSs + (8 * kk + 2 * t) * LDS + g;
#pragma unroll
            for (int m = 0; m < MQ; ++m) {
                split_tf32(a[16 * m], ab[m][0], as[m][0]);            // (query g,   key 2t)
                split_tf32(a[16 * m + 8], ab[m][1], as[m][1]);        // (query g+8, key 2t)
                split_tf32(a[LDS + 16 * m], ab[m][2], as[m][2]);      // (query g,   key 2t+1)
                split_tf32(a[LDS + 16 * m + 8], ab[m][3], as[m][3]);  // (query g+8, key 2t+1)
            }
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                const float* b = Ks + (8 * kk + 2 * t) * LD + dc0 + 8 * n + g;
                u32 bb[2], bs[2];
                split_tf32(b[0], bb[0], bs[0]);
                split_tf32(b[LD], bb[1], bs[1]);
#pragma unroll
                for (int m = 0; m < MQ; ++m) {
                    mma_1688_tf32(acc[m][n], as[m], bb);
                    mma_1688_tf32(acc[m][n], ab[m], bs);
                    mma_1688_tf32(acc[m][n], ab[m], bb);
                }
            }
        }
        // other K/V blocks add to the same rows at the same time: vector reductions into the fp32 accumulator
#pragma unroll
        for (int m = 0; m < MQ; ++m) {
            const int r = q0 + 16 * m + g;
            float* row = dQacc + (long)r * D + dc0 + 2 * t;
#pragma unroll
            for (int n = 0; n < NQ; ++n) {
                if (r < Nq) red_add_f32x2<0>(row + 8 * n, acc[m][n][0], acc[m][n][1]);
                if (r + 8 < Nq) red_add_f32x2<8 * D>(row + 8 * n, acc[m][n][2], acc[m][n][3]);
            }
        }
    }
    cp_async_wait<0>();  // a block with no Q tile (causal, K_j past every row's diagonal) still loaded K_j, V_j

    // Alg.2 L19: dK_j = scale dS^T Q, dV_j; rows key0 + g, key0 + g + 8
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int kv = j * BC + key0 + g + 8 * h;
        if (kv >= Nk) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const long at = (long)kv * D + 8 * n + 2 * t;
            *reinterpret_cast<float2*>(dK + at) = make_float2(scale * dk[n][2 * h], scale * dk[n][2 * h + 1]);
            *reinterpret_cast<float2*>(dV + at) = make_float2(dv[n][2 * h], dv[n][2 * h + 1]);
        }
    }
}
