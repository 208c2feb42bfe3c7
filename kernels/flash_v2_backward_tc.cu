// flash_v2_backward_tc.cu: FlashAttention-2 backward on tensor cores (Dao, arXiv 2307.08691, Algorithm 2): fp16 /
// bf16 in, fp32 accumulate. Notation: Q_i, dO_i, L_i, D_i (Br rows), K_j, V_j (Bc rows), S_ij, P_ij, dP_ij, dS_ij.
// The algorithm is version fp32's (flash_v2_backward_fp32.cu): a block per (K/V tile j, batch*head) keeps dK_j,
// dV_j on chip and loops over the Q tiles i. What changes, and why it is faster:
//   * the matmuls (S^T, dP^T, P^T dO, dS^T Q, dS K) run on tensor cores: mma.sync m16n8k16, fp32 accumulators,
//     operands by ldmatrix from a per-lane shared base plus compile-time offsets (no address arithmetic per load);
//   * FA2's register reuse: the C fragments of S^T, dP^T, packed to 16-bit, are the A fragments of dV_j += P^T dO_i
//     and dK_j += dS^T Q_i, so P^T and dS^T need no trip through shared memory (WQ = 1);
//   * Q_i, dO_i, L_i, D_i double-buffered by cp.async: tile i+1 lands while tile i is computed;
//   * larger tiles, Bc = 128 key rows (8 warps) and Br = 128 at d = 64: more mma per byte loaded; at d = 64 (KREG)
//     each warp keeps its K_j, V_j fragments in registers for the whole kernel;
//   * dQ_i added with vector atomics straight from the mma registers (backward_dq.cuh); warps in pairs that share
//     key rows (WQ = 2, backward_warp_pairs.cuh); at d = 256 the head dim split between two blocks (grid.z, DP),
//     since a warp's 16 rows of dK_j, dV_j over 256 columns would not fit in its registers.
// The variants (window, packed batches, grouped-query k/v, softcap, ALiBi, dropout) are the forward's hooks
// (kernels/variants.cuh), asked per score of S^T; plain attention's compile to nothing. The one argument, BwdParams,
// is in params.cuh; the tiles per head dim in stages/03_flash_v2_backward/tc.py. Deterministic dQ:
// flash_v2_backward_dq.cu. The layout in prose: stages/03_flash_v2_backward/README.md.
// Run: python stages/03_flash_v2_backward/run.py --version tc --dtype bf16   (tests: pytest
//      tests/test_03_flash_v2_backward.py)
#include "variants.cuh"
#include "backward_tiles.cuh"
#include "backward_warp_pairs.cuh"
#include "backward_dq.cuh"

// The tiles of one instantiation (the launcher's TcTiles and TC_* tables): head dim HD; Br rows of Q_i, computed in
// chunks of BRC query rows (S^T, dP^T of one chunk live in registers; the barrier, the Q_i / dO_i load and the dQ
// step are per Br rows); Bc rows of K_j (Bc / 16 warps, 2 Bc threads); the warp layout WQ (1 or 2:
// backward_warp_pairs.cuh); KREG: each warp keeps its A fragments of K_j, V_j in registers for the whole kernel;
// DQ_MT: m-tiles (16 rows) of dQ_i per warp in the atomic dQ step; DEFER_DQ: that step for tile i runs at the end of
// tile i+1 (backward_dq.cuh).
template <int HD_, int BR_, int BC_, int BRC_, int WQ_, bool KREG_, int DQ_MT_, bool DEFER_DQ_>
struct BwdTiles {
    static constexpr int HD = HD_, Br = BR_, Bc = BC_, BRC = BRC_, WQ = WQ_, DQ_MT = DQ_MT_;
    static constexpr bool KREG = KREG_, DEFER_DQ = DEFER_DQ_;
    static constexpr int NW = Bc / 16, NT = 32 * NW;  // warps, threads
    static constexpr int LDK = HD + 8;  // row stride (elements) of K_j, V_j, Q_i, dO_i: +16 bytes, for ldmatrix
                                        // without bank conflicts
    static constexpr int LDS = Br + 8;  // row stride of P^T, dS^T
    static constexpr int NS = BRC / 8;  // n-tiles (8 queries) of one chunk
    static constexpr int DP = HD > 128 ? 2 : 1;        // column parts of dK_j, dV_j, dQ_i (one per block: grid.z)
    static constexpr int HDP = HD / DP, ND = HDP / 8;  // columns of one part; n-tiles of a warp's dK_j, dV_j rows
    // The warp layout: NW / WQ key groups own KR = 16 WQ rows of K_j each; the WQ warps of a group split the chunk's
    // queries for S^T, dP^T (QW each) and the columns of dK_j, dV_j (DW each).
    static constexpr int WK = NW / WQ, KR = Bc / WK, MS = KR / 16;  // key groups; rows and m-tiles of each
    static constexpr int QW = BRC / WQ, NSW = QW / 8;               // a warp's queries of S^T, dP^T; their n-tiles
    static constexpr int DW = HDP / WQ, NDW = DW / 8;               // a warp's columns of dK_j, dV_j; their n-tiles
    // A fragments a warp keeps in registers: of K_j and of V_j (KREG), of P^T and dS^T per k step (WQ = 1). An array a
    // configuration does not use keeps one entry (C++ has no empty arrays), never read.
    static constexpr int KF = KREG ? MS * HD / 16 : 1, PF = WQ == 1 ? BRC / 16 : 1;
    static_assert(Br % BRC == 0 && BRC % 16 == 0, "Br: a multiple of the BRC-row chunk");
    static_assert((WQ == 1 || WQ == 2) && NW % WQ == 0 && QW % 16 == 0 && DW % 16 == 0, "warp layout");
};

// This block's head, query head bh: its first rows of q, dO, dQ, dQ_accum (ldq rows a head) and of k, v, dK, dV
// (ldk). A Mask that takes packed batches takes grouped-query k, v too (head_rows, variants.cuh): query head h reads
// kv head h / group, into whose float dK, dV the group's query heads add. Plain attention's dK, dV are per query
// head, written in the inputs' type: no groups.
template <bool PACKED>
__device__ __forceinline__ HeadRows backward_head_rows(const BwdParams& p, long bh) {
    if constexpr (PACKED)
        return head_rows<true>(p, bh, false);
    else
        return HeadRows{bh * p.ldq, bh * p.ldk, bh, p.Nq, p.Nk, 0};
}

// KREG: this warp's A fragments of K_j, V_j (its KR rows, all HD columns), from this lane's ldmatrix addresses ka, va.
template <typename Tl>
__device__ __forceinline__ void load_kv_fragments(u32 (&akr)[Tl::KF][4], u32 (&avr)[Tl::KF][4], u32 ka, u32 va) {
#pragma unroll
    for (int mt = 0; mt < (Tl::KREG ? Tl::MS : 0); ++mt)
#pragma unroll
        for (int kk = 0; kk < Tl::HD / 16; ++kk) {
            ldsm_x4(akr[mt * (Tl::HD / 16) + kk], ka + 2 * (mt * 16 * Tl::LDK + kk * 16));
            ldsm_x4(avr[mt * (Tl::HD / 16) + kk], va + 2 * (mt * 16 * Tl::LDK + kk * 16));
        }
}

// Alg.2 L10 for one chunk: s = S_ij^T = K_j Q_i^T and dp = dP_ij^T = V_j dO_i^T, this warp's KR key rows x QW queries
// (m-tile mt, n-tile n at [mt * NSW + n]). A = this warp's rows of K_j, V_j: kept in registers (KREG: akr, avr) or
// loaded per k step from this lane's addresses ka, va. B[d][q] = Q_i[q][d], dO_i[q][d]: the rows of Q_i are the
// columns of B, no transpose (qb, ob: this lane's addresses in the chunk). step(kk) runs before k step kk.
template <typename Tl, typename T, typename Step>
__device__ __forceinline__ void s_dp_chunk(float (&s)[Tl::MS * Tl::NSW][4], float (&dp)[Tl::MS * Tl::NSW][4],
                                           const u32 (&akr)[Tl::KF][4], const u32 (&avr)[Tl::KF][4], u32 ka, u32 va,
                                           u32 qb, u32 ob, Step&& step) {
    constexpr int MS = Tl::MS, NSW = Tl::NSW, LDK = Tl::LDK, KK = Tl::HD / 16;
    constexpr bool KREG = Tl::KREG;
    zero(s), zero(dp);
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
        step(kk);
        u32 akl[MS][4], avl[MS][4];  // A = K_j, V_j rows KR wk + 16 mt.., cols kk*16..
        if (!KREG) {
#pragma unroll
            for (int mt = 0; mt < MS; ++mt) {
                ldsm_x4(akl[mt], ka + 2 * (mt * 16 * LDK + kk * 16));
                ldsm_x4(avl[mt], va + 2 * (mt * 16 * LDK + kk * 16));
            }
        }
#pragma unroll
        for (int np = 0; np < Tl::QW / 16; ++np) {
            u32 bq[4], bo[4];
            ldsm_x4(bq, qb + 2 * (np * 16 * LDK + kk * 16));
            ldsm_x4(bo, ob + 2 * (np * 16 * LDK + kk * 16));
#pragma unroll
            for (int mt = 0; mt < MS; ++mt) {
                const u32* ak = KREG ? akr[KREG ? mt * KK + kk : 0] : akl[mt];
                const u32* av = KREG ? avr[KREG ? mt * KK + kk : 0] : avl[mt];
                mma_16816<T>(s[mt * NSW + 2 * np], ak, bq);
                mma_16816<T>(s[mt * NSW + 2 * np + 1], ak, bq + 2);
                mma_16816<T>(dp[mt * NSW + 2 * np], av, bo);
                mma_16816<T>(dp[mt * NSW + 2 * np + 1], av, bo + 2);
            }
        }
    }
}

// Alg.2 L12, L14 for one chunk: dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i (scale at the end), this warp's KR rows x
// DW columns (m-tile mt, n-tile n at [mt * NDW + n]). A = P^T, dS^T: WQ = 1, this warp's registers (pa, dsa: k step kk
// in entry kk); WQ = 2, the key group's rows from shared memory (this lane's addresses pt, dst in the chunk).
// B[q][d] = dO_i[q][d], Q_i[q][d]: the k index runs down the rows, so ldmatrix transposes each 8x8 tile (ot, qt: this
// lane's addresses in the chunk).
template <typename Tl, typename T>
__device__ __forceinline__ void dv_dk_chunk(float (&dv)[Tl::ND][4], float (&dk)[Tl::ND][4],
                                            const u32 (&pa)[Tl::PF][4], const u32 (&dsa)[Tl::PF][4], u32 pt, u32 dst,
                                            u32 ot, u32 qt) {
    constexpr int MS = Tl::MS, NDW = Tl::NDW, LDK = Tl::LDK, WQ = Tl::WQ;
#pragma unroll
    for (int kk = 0; kk < Tl::BRC / 16; ++kk) {
        u32 apl[WQ == 1 ? 1 : MS][4], adl[WQ == 1 ? 1 : MS][4];
        if constexpr (WQ > 1) load_pt_dst<MS, Tl::LDS>(apl, adl, pt, dst, kk);
#pragma unroll
        for (int np = 0; np < Tl::DW / 16; ++np) {  // this warp's columns pc + DW wq + 16 np..
            u32 bo[4], bq[4];
            ldsm_x4_trans(bo, ot + 2 * (kk * 16 * LDK + np * 16));
            ldsm_x4_trans(bq, qt + 2 * (kk * 16 * LDK + np * 16));
#pragma unroll
            for (int mt = 0; mt < MS; ++mt) {
                const u32* ap = WQ == 1 ? pa[WQ == 1 ? kk : 0] : apl[WQ == 1 ? 0 : mt];
                const u32* ad = WQ == 1 ? dsa[WQ == 1 ? kk : 0] : adl[WQ == 1 ? 0 : mt];
                mma_16816<T>(dv[mt * NDW + 2 * np], ap, bo);
                mma_16816<T>(dv[mt * NDW + 2 * np + 1], ap, bo + 2);
                mma_16816<T>(dk[mt * NDW + 2 * np], ad, bq);
                mma_16816<T>(dk[mt * NDW + 2 * np + 1], ad, bq + 2);
            }
        }
    }
}

// Alg.2 L19: dK_j = scale dk, dV_j = rp dv (rp = 1 / (1 - p) with dropout, else 1), this warp's rows kv0 + 16 mt + g
// (+ 8) below Nk and columns c0 + 8 n + 2t, + 1. ADD (float dK, dV in atomic mode): added with red.add, as a kv
// group's query heads and a ring's blocks (stage 04) add into one kv head's rows (the launcher zeroes them for a
// plain call); otherwise written (16-bit, or the deterministic mode).
template <typename Tl, bool ADD, typename TO>
__device__ __forceinline__ void write_dk_dv(TO* dK, TO* dV, const float (&dk)[Tl::ND][4], const float (&dv)[Tl::ND][4],
                                            float scale, float rp, int kv0, int Nk, int c0, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < Tl::MS; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kv = kv0 + 16 * mt + g + 8 * h;
            if (kv < Nk) {
#pragma unroll
                for (int n = 0; n < Tl::NDW; ++n) {
                    const long idx = (long)kv * Tl::HD + c0 + n * 8 + 2 * t;
                    const float* v = dv[mt * Tl::NDW + n];
                    const float* k = dk[mt * Tl::NDW + n];
                    if constexpr (ADD) {
                        red_add_f32x2<0>(reinterpret_cast<float*>(dV + idx), rp * v[2 * h], rp * v[2 * h + 1]);
                        red_add_f32x2<0>(reinterpret_cast<float*>(dK + idx), scale * k[2 * h], scale * k[2 * h + 1]);
                    } else {
                        store2(dV + idx, rp * v[2 * h], rp * v[2 * h + 1]);
                        store2(dK + idx, scale * k[2 * h], scale * k[2 * h + 1]);
                    }
                }
            }
        }
}

// Algorithm 2 for one (K/V tile j, head, column part). T: __half or __nv_bfloat16; TO: dK, dV's type (T, or float:
// added, with the variants and for a ring block); TQ: dQ's; DQ_ATOMIC: dQ_i added to dQ_accum here (else the
// deterministic pass computes dQ); Mask, Score, Drop: the hooks (variants.cuh). grid = (B H, ceil(Nk / Bc)) or, with
// j_fast, (ceil(Nk / Bc), B H), times DP (grid.z); 2 Bc threads. A packed batch's grid runs over (sequence, head) x
// the K/V tiles of the longest sequence; a block past its sequence's last key returns at once. A ring block (stage
// 04) is rows a..b-1 of its query shard against keys c..m-1 of a key block: its pointers start at row a and key c,
// Nq = b - a, Nk = m - c, and ldq, ldk are the shard's and the block's lengths, so nothing is copied; its dQ, dK, dV
// are added to the ring's float32 accumulators.
template <typename T, typename TO, typename TQ, typename Tiles, bool DQ_ATOMIC, typename Mask, typename Score,
          typename Drop>
__global__ void __launch_bounds__(Tiles::NT, 128 / Tiles::Bc)
flash_v2_backward_tc(const __grid_constant__ BwdParams p) {
    using Tl = Tiles;
    using BMask = typename Mask::template For<BwdParams>;  // the mask hook, built from BwdParams
    constexpr int HD = Tl::HD, Br = Tl::Br, Bc = Tl::Bc, BRC = Tl::BRC, WQ = Tl::WQ, NT = Tl::NT, LDK = Tl::LDK;
    constexpr int LDS = Tl::LDS, HDP = Tl::HDP, KR = Tl::KR, MS = Tl::MS, QW = Tl::QW, NSW = Tl::NSW, DW = Tl::DW;
    constexpr bool KREG = Tl::KREG, DEFER_DQ = DQ_ATOMIC && Tl::DEFER_DQ;
    // dynamic shared memory, in this order (the launcher's smem_bytes adds up the same layout)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + Bc * LDK;
    T* Qs = Vs + Bc * LDK;        // [2][Br][LDK]
    T* dOs = Qs + 2 * Br * LDK;   // [2][Br][LDK]
    T* dSs = dOs + 2 * Br * LDK;  // [2][Bc][LDS]: dS_ij^T (double-buffered when DEFER_DQ)
    T* Pst = dSs + 2 * Bc * LDS;  // WQ > 1: [Bc][LDS]: P_ij^T
    float* Ls = reinterpret_cast<float*>(Pst + (WQ > 1 ? Bc * LDS : 0));  // [2][Br]
    float* Ds = Ls + 2 * Br;                                              // [2][Br]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, mi = lane / 8;
    const int wk = warp / WQ, wq = warp % WQ;  // this warp's key group (rows KR wk..) and its part in the group
    const int pc = Tl::DP > 1 ? (int)blockIdx.z * HDP : 0;  // this block's columns pc.. of dK_j, dV_j, dQ_i
    // j_fast = 0: grid (BH, Tc), every head's j = 0 block (causal: the longest) starts first. j_fast = 1: grid
    // (Tc, BH), the blocks in flight are the K/V tiles of a few heads, which share Q_i, dO_i, dQ_i rows in L2.
    const int j = p.j_fast ? blockIdx.x : blockIdx.y;
    const long bh = p.j_fast ? blockIdx.y : blockIdx.x;
    const HeadRows rows = backward_head_rows<Mask::packed>(p, bh);
    const int Nq = rows.Nq, Nk = rows.Nk;
    const bool varlen = Mask::packed && p.cu_q != nullptr;
    const T* __restrict__ Q = static_cast<const T*>(p.q) + rows.q0 * HD;
    const T* __restrict__ dO = static_cast<const T*>(p.dO) + rows.q0 * HD;
    const T* __restrict__ K = static_cast<const T*>(p.k) + rows.kv0 * HD;
    const T* __restrict__ V = static_cast<const T*>(p.v) + rows.kv0 * HD;
    TO* __restrict__ dK = static_cast<TO*>(p.dK) + rows.kv0 * HD;
    TO* __restrict__ dV = static_cast<TO*>(p.dV) + rows.kv0 * HD;
    float* __restrict__ dQacc = p.dQ_accum + rows.q0 * HD;
    TQ* __restrict__ dQ = static_cast<TQ*>(p.dQ) + (DQ_ATOMIC && p.done != nullptr ? rows.q0 * HD : 0);
    const float* __restrict__ Lg = p.L_i + rows.hd * p.Nq_pad + rows.s0;  // L_i, D_i: Nq_pad rows a head
    const float* __restrict__ Dg = p.D_i + rows.hd * p.Nq_pad + rows.s0;
    if (Mask::packed && j * Bc >= Nk) {  // past this sequence's last K/V tile (the whole block: before any barrier)
        if (DQ_ATOMIC && p.done != nullptr && Nk == 0 && j == 0 && blockIdx.z == 0)  // no keys: dQ = 0
            convert_dq<4>(dQacc, dQ, 1.f, (long)Nq * HD / 4, tid, NT);
        return;
    }
    // the hooks (kernels/variants.cuh)
    const Score score(p, rows.hd, Nk - Nq);
    const Drop drop(p, rows.hd);
    const BMask mask(p, Nq, Nk);
    const int2 qt = mask.template q_tiles<Br, Bc>(j, Nq);
    const int i_begin = qt.x, Tr = qt.y;  // the loop's Q tiles i_begin <= i < Tr: the others see none of K_j

    // L_i, D_i into buffer b. L_i, D_i of a packed sequence start at any row: plain loads (not 16-byte cp.async),
    // rows past the sequence's end as L = +inf (P = 0), D = 0. Otherwise padded to Nq_pad: always in range.
    auto load_l_d = [&](int i, int b) {
        if (varlen) {
            if (tid < Br) {
                const bool in = i * Br + tid < Nq;
                Ls[b * Br + tid] = in ? Lg[i * Br + tid] : INF;
                Ds[b * Br + tid] = in ? Dg[i * Br + tid] : 0.f;
            }
        } else if (tid < Br / 4) {
            cp_async_16(Ls + b * Br + 4 * tid, Lg + i * Br + 4 * tid, true);
        } else if (tid < Br / 2) {
            cp_async_16(Ds + b * Br + 4 * (tid - Br / 4), Dg + i * Br + 4 * (tid - Br / 4), true);
        }
    };
    // Alg.2 L15 for Q tile i from its dS_ij^T at dst: dQ_i += scale dS_ij K_j (backward_dq.cuh)
    auto dq_step = [&](int i, const T* dst) {
        dq_tile_atomic<T, HD, HDP, Br, Bc, Tl::DQ_MT, LDK, LDS>(dst, Ks, dQacc, i * Br, Nq, p.scale, pc, warp, lane);
    };

    // Alg.2 L6: K_j, V_j to shared memory, once; the first Q tile with them
    load_tile_async<T, Bc, HD, LDK, NT>(Ks, K, j * Bc, Nk, tid);
    load_tile_async<T, Bc, HD, LDK, NT>(Vs, V, j * Bc, Nk, tid);
    if (i_begin < Tr) {  // Q_i, dO_i (zero-filled past Nq), L_i, D_i into buffer 0
        load_tile_async<T, Br, HD, LDK, NT>(Qs, Q, i_begin * Br, Nq, tid);
        load_tile_async<T, Br, HD, LDK, NT>(dOs, dO, i_begin * Br, Nq, tid);
        load_l_d(i_begin, 0);
    }
    cp_async_commit();

    // Alg.2 L7: dV_j = dK_j = 0, fp32 accumulators of this warp's KR rows x DW columns: m-tile mt, n-tile n at
    // [mt * NDW + n]
    float dv[Tl::ND][4], dk[Tl::ND][4];
    zero(dv), zero(dk);
    u32 akr[Tl::KF][4], avr[Tl::KF][4];  // KREG: this warp's K_j, V_j A fragments
    // This lane's ldmatrix rows as 32-bit shared addresses, computed once; each load adds a compile-time byte offset
    // (an immediate). A operands, this warp's rows of K_j, V_j (and, WQ > 1, of P_ij^T, dS_ij^T): lanes 0-15 the rows,
    // lanes 16-31 the same rows +8 columns. B operands of S^T, dP^T: this warp's rows of Q_i, dO_i as they are; of
    // dV_j, dK_j: its columns of Q_i, dO_i through ldmatrix .trans (buffer 0, chunk 0).
    const u32 ka_base = smem_u32(Ks + (KR * wk + lane % 16) * LDK + (lane / 16) * 8);
    const u32 va_base = smem_u32(Vs + (KR * wk + lane % 16) * LDK + (lane / 16) * 8);
    const u32 pa_base = smem_u32(Pst + (KR * wk + lane % 16) * LDS + (lane / 16) * 8);
    const u32 da_base = smem_u32(dSs + (KR * wk + lane % 16) * LDS + (lane / 16) * 8);
    const u32 qb_base = smem_u32(Qs + (QW * wq + (mi / 2) * 8 + lane % 8) * LDK + (mi % 2) * 8);
    const u32 ob_base = smem_u32(dOs + (QW * wq + (mi / 2) * 8 + lane % 8) * LDK + (mi % 2) * 8);
    const u32 qt_base = smem_u32(Qs + ((mi % 2) * 8 + lane % 8) * LDK + pc + DW * wq + (mi / 2) * 8);
    const u32 ot_base = smem_u32(dOs + ((mi % 2) * 8 + lane % 8) * LDK + pc + DW * wq + (mi / 2) * 8);

    for (int i = i_begin; i < Tr; ++i) {  // Alg.2 L8
        const int buf = (i - i_begin) & 1;
        cp_async_wait<0>();  // tile i (and K_j, V_j) have landed for this thread (issued one tile ago)
        __syncthreads();     // ... for every thread; every warp is done with tile i-1's Q/dO buffer (and P^T) and
                             // has written dS_{i-1}^T (read below when DEFER_DQ)
        // prefetch tile i+1 while tile i is computed: L_i, D_i now, Q_i, dO_i pass by pass between the mma of the
        // first chunk's S^T, dP^T (the step of s_dp_chunk), not in one burst
        const bool prefetch = i + 1 < Tr;
        using Copy = TileCopy<T, Br, HD, LDK, NT>;
        const Copy copy_q(Qs + (buf ^ 1) * Br * LDK, Q, (i + 1) * Br, Nq, tid);
        const Copy copy_o(dOs + (buf ^ 1) * Br * LDK, dO, (i + 1) * Br, Nq, tid);
        if (prefetch) load_l_d(i + 1, buf ^ 1);
        if (KREG && i == i_begin) load_kv_fragments<Tl>(akr, avr, ka_base, va_base);  // once: K_j, V_j have landed
        T* dSt = dSs + (DEFER_DQ ? buf : 0) * Bc * LDS;

#pragma unroll 1
        for (int c = 0; c < Br / BRC; ++c) {  // chunks of BRC query rows
            const u32 chunk = 2 * (buf * Br + c * BRC) * LDK;  // byte offset of this buffer's chunk in Q_i, dO_i
            const float* Lb = Ls + buf * Br + c * BRC;
            const float* Db = Ds + buf * Br + c * BRC;
            const int q0 = i * Br + c * BRC;  // first query row of the chunk

            // Alg.2 L10: S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T, this warp's KR keys x QW queries
            float s[MS * NSW][4], dp[MS * NSW][4];
            s_dp_chunk<Tl, T>(s, dp, akr, avr, ka_base, va_base, qb_base + chunk, ob_base + chunk, [&](int kk) {
                if (prefetch && c == 0) {  // passes kk * 2 NP / (HD / 16).. of Q_{i+1} then dO_{i+1} (NP each)
                    constexpr int NP = Copy::PASSES, KK = HD / 16;
#pragma unroll
                    for (int x = kk * 2 * NP / KK; x < (kk + 1) * 2 * NP / KK; ++x) {
                        if (x < NP) copy_q.pass(x);
                        else copy_o.pass(x - NP);
                    }
                }
            });
            if (c == 0) cp_async_commit();  // the next tile's copies (an empty group on the last tile)

            // Alg.2 L11-13: P_ij = exp(x_ij - L_i) with x_ij the score after the score hook, 0 where the mask hook
            // hides the key; dS_ij = P_ij (dP_ij - D_i) times the score hook's derivative; the dropout hook's Z_ij on
            // P_ij (dV's operand) and dP_ij. Accumulator (rows g, g+8, cols 2t, 2t+1) of n-tile n is exactly the A
            // fragment of k-step n/2: WQ = 1 packs it to 16-bit in place (FA2's register reuse); WQ = 2 stores it to
            // shared memory, where the pair's other warp reads it. Two copies, as the forward's tile: MASKED asks the
            // mask hook (chunks with Nk's tail or a key some row does not see), the other has no test. With dropout
            // one copy asks per score: two would hold its draws twice, for one test saved per score.
            u32 pa[Tl::PF][4], dsa[Tl::PF][4];
            auto p_ds = [&](const bool MASKED) {  // called with a constant: each call inlines its own copy
                u32 z = 0u;  // dropout's keep bits of n-tiles n, n + 1 (n even): Drop::keep_bits
#pragma unroll
                for (int mt = 0; mt < MS; ++mt) {
                    const int kr = KR * wk + 16 * mt + g;  // this thread's key rows kr, kr + 8 of K_j
#pragma unroll
                    for (int n = 0; n < NSW; ++n) {
                        const int qc = QW * wq + n * 8 + 2 * t;  // this thread's query columns qc, qc + 1 of the chunk
                        if (n % 2 == 0) z = drop.keep_bits(q0 + qc, j * Bc + kr);
                        float pz[4], ds[4];
#pragma unroll
                        for (int e = 0; e < 4; ++e) {  // query q0 + qc + e % 2, key j Bc + kr + 8 (e / 2)
                            const int ql = qc + e % 2, q = q0 + ql, kv = j * Bc + kr + (e / 2) * 8;
                            float grad;
                            const float x = score.exponent(s[mt * NSW + n][e], Lb[ql], q, kv, grad);
                            const float pe = !MASKED || mask.visible(q, kv) ? fast_exp2(x * LOG2E_F) : 0.f;
                            float dpe = dp[mt * NSW + n][e];
                            pz[e] = drop.dropped(z, 2 * (n % 2) + e / 2, e % 2, pe, dpe);
                            ds[e] = pe * (dpe - Db[ql]) * grad;
                        }
                        if constexpr (WQ == 1) {
                            c_to_a<T>(pa[n / 2], n, pz);
                            c_to_a<T>(dsa[n / 2], n, ds);
                        } else {  // rows kr, kr + 8 of P^T and dS^T, columns c BRC + qc, qc + 1
                            store_pt_dst<LDS>(Pst + kr * LDS + c * BRC + qc, dSt + kr * LDS + c * BRC + qc, pz, ds);
                        }
                    }
                }
            };
            const bool masked = mask.template tile_masked<Bc>(j, q0, q0 + BRC - 1);  // the same for the whole block
            if constexpr (Drop::draws)  // one copy: the Philox draws, most of its code, once
                p_ds(masked);
            else if (masked)
                p_ds(true);
            else
                p_ds(false);
            if constexpr (WQ > 1) group_sync(1 + wk, 32 * WQ);  // the key group's P^T, dS^T rows are complete

            // Alg.2 L12, L14: dV_j += P_ij^T dO_i;  dK_j += dS_ij^T Q_i, this warp's KR rows x DW columns
            const u32 pt = 2 * (c * BRC), dt = 2 * ((DEFER_DQ ? buf : 0) * Bc * LDS + c * BRC);  // byte offsets
            dv_dk_chunk<Tl, T>(dv, dk, pa, dsa, pa_base + pt, da_base + dt, ot_base + chunk, qt_base + chunk);

            if constexpr (DQ_ATOMIC && WQ == 1)  // Alg.2 L15 sums over all Bc key rows, i.e. all warps: dS^T via smem
                store_ds_t<Tl::NS, LDS>(dSt + (16 * warp + g) * LDS + c * BRC + 2 * t, dsa);
        }
        if (DEFER_DQ && i > i_begin)  // dQ_{i-1}: its atomics drain at the next tile's barrier
            dq_step(i - 1, dSs + (buf ^ 1) * Bc * LDS);
        if (DQ_ATOMIC && !DEFER_DQ) {
            __syncthreads();  // all of dS_ij^T is in shared memory before any warp reads other warps' rows
            dq_step(i, dSt);
        }
    }
    if (DEFER_DQ && i_begin < Tr) {  // dQ of the last Q tile
        __syncthreads();  // every warp has written its rows of the last dS^T
        dq_step(Tr - 1, dSs + ((Tr - 1 - i_begin) & 1) * Bc * LDS);
    }

    // Alg.2 L19: dK_j = scale sum_i dS_ij^T Q_i, dV_j = sum_i (P_ij Z_ij)^T dO_i / (1 - p)
    write_dk_dv<Tl, sizeof(TO) == 4 && DQ_ATOMIC>(dK, dV, dk, dv, p.scale, drop.rp(), j * Bc + KR * wk, Nk,
                                                  pc + DW * wq, g, t);
    // Alg.2 L21: dQ = dQ_accum by the last of the head's ceil(Nk / Bc) x DP blocks to finish (null done: the launcher
    // converts dQ with a kernel of its own)
    if (DQ_ATOMIC && p.done != nullptr)
        convert_dq_by_last_block<NT>(dQacc, dQ, p.done + bh, (Nk + Bc - 1) / Bc * (int)gridDim.z, (long)Nq * HD / 4,
                                     tid);
}
