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
// Deterministic dQ: flash_v2_backward_dq.cu. The layout in prose: stages/03_flash_v2_backward/README.md.
// Run: python stages/03_flash_v2_backward/run.py --version tc --dtype bf16   (tests: pytest
//      tests/test_03_flash_v2_backward.py)
#include "common.cuh"
#include "dropout.cuh"
#include "backward_tiles.cuh"
#include "backward_warp_pairs.cuh"
#include "backward_dq.cuh"

// Q, dO: (BH, Nq, HD); K, V: (BH / group, Nk, HD); dK, dV: like K, V; L2g, Dg: (BH, Nq_pad) from bwd_preprocess (L_i,
// +inf for masked or padding rows); dQacc: (BH, Nq, HD) fp32, zeroed (it receives scale dS K, so it holds dQ); dQ:
// (BH, Nq, HD) of TQ, done: one int per row of heads of the grid, zeroed (both unused, may be null, without
// DQ_ATOMIC; null done: dQacc is left for bwd_convert_dq, the launcher's choice for large problems: fuse_dq_rule).
// grid = (BH, ceil(Nk / Bc)) or, with j_fast, (ceil(Nk / Bc), BH), times DP (grid.z); 2 * Bc threads.
// A Q tile of Br rows is computed in chunks of BRC query rows (S^T, dP^T of one chunk live in registers; P^T, dS^T
// too with WQ = 1, in shared memory with WQ = 2); the barrier, the Q_i / dO_i load and the dQ step are per Br rows.
// DQ_MT: m-tiles (16 rows) of dQ_i per warp in the dQ step. KREG: this warp's A fragments of K_j, V_j stay in
// registers for the whole kernel. WQ: the warp layout (1 or 2: backward_warp_pairs.cuh).
// VAR, the variants (stages/common/variants.py): a window (left, right) around the diagonal (-1: unbounded): the
// block visits only the Q tiles with a row that sees a key of K_j; the scores x = scale S_ij capped (softcap c > 0:
// x = c tanh(x / c), and dS_ij times 1 - tanh^2) and biased (ALiBi: x -= slope |q + off + a_off - kv|, slopes one
// float per (batch, head), or null). a_off, q_off, k_off: 0, or where a ring block sits in the whole problem (ALiBi's
// diagonal moves by a_off; dropout draws from global indices q_off + q, k_off + kv). Grouped-query k, v (VAR): K, V
// have H / group heads and query head h reads kv head h / group; the group's query heads add their dK, dV into their
// kv head's rows (float, red.add).
// ldq, ldk: rows per head of Q, dO, dQacc and of K, V, dK, dV: Nq and Nk for a whole problem. A ring block (stage 04)
// is rows a..b-1 of its query shard against keys c..m-1 of a key block: its pointers start at row a and key c, Nq =
// b - a, Nk = m - c, and ldq, ldk are the shard's and the block's lengths, so nothing is copied, and its dQ, dK, dV
// are added to the ring's float32 accumulators.
// DROP (with VAR), dropout (dropout.cuh; an instantiation of its own, so the other variants carry none of its
// registers): the forward's Z_ij regenerated from the seed; dV_j += (P_ij Z_ij)^T dO_i and dP_ij -> Z_ij dP_ij /
// (1 - p) (the gradient through P~ = P Z / (1 - p)); D_i = rowsum(dO_i O_i) is unchanged, and dV_j is scaled by
// rp = 1 / (1 - p) once, at the end.
// Variable-length packed batches (VAR, cu_q != null): Q, dO, dQacc are (H, total_q, HD), K, V and dK, dV (H / group,
// total_k, HD), L2g, Dg (H, Nq_pad) with Nq = total_q, Nk = total_k; sequence s is rows cu_q[s]..cu_q[s + 1] - 1
// (keys: cu_k). The BH axis of the grid runs over (sequence, head), the Tc axis over the K/V tiles
// of the longest sequence; a block past its sequence's last key returns at once. L_i, D_i of a sequence start at
// any row, so they are read with plain loads (not 16-byte cp.async), rows past the sequence's end as L = +inf
// (P = 0), D = 0.
template <typename T, typename TO, typename TQ, int HD, int Br, int Bc, bool DQ_ATOMIC, bool DEFER_DQ, int DQ_MT,
          bool KREG, int BRC, int WQ, bool VAR = false, bool DROP = false>
__global__ void __launch_bounds__(2 * Bc, 128 / Bc) flash_v2_backward_tc(
    const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, const T* __restrict__ dO,
    const float* __restrict__ L2g, const float* __restrict__ Dg, float* __restrict__ dQacc,
    TO* __restrict__ dK, TO* __restrict__ dV, TQ* __restrict__ dQ, int* __restrict__ done,
    const float* __restrict__ slopes, const int* __restrict__ cu_q,
    const int* __restrict__ cu_k, int Nq, int Nk, int ldq, int ldk, int Nq_pad,
    float scale, int causal, int j_fast, int left, int right, float softcap, int H, int group, int a_off, int q_off,
    int k_off, unsigned int keep, float rp, unsigned int seed_lo, unsigned int seed_hi) {
    constexpr int NW = Bc / 16, NT = NW * 32;  // warps
    constexpr int LDK = HD + 8;  // row stride (elements) of K_j, V_j, Q_i, dO_i: +16 bytes, conflict-free ldmatrix
    constexpr int LDS = Br + 8;  // row stride of dS^T
    constexpr int NS = BRC / 8;  // n-tiles (8 query columns) of this warp's S^T slice of one chunk
    constexpr int DP = HD > 128 ? 2 : 1;  // column parts of dK_j, dV_j, dQ_i (one per block: grid.z)
    constexpr int HDP = HD / DP;           // columns of one part: this block's are pc..pc + HDP - 1
    constexpr int ND = HDP / 8;            // n-tiles of this block's dK_j, dV_j rows
    static_assert(Br % BRC == 0 && BRC % 16 == 0, "Br: a multiple of the BRC-row chunk");
    // The warp layout (WQ = 1 or 2). The NW / WQ key groups own KR = 16 WQ rows of K_j each; the WQ warps of a
    // group split the chunk's queries for S^T, dP^T (QW each) and the columns of dK_j, dV_j (DW each).
    constexpr int WK = NW / WQ, KR = Bc / WK, MS = KR / 16;  // key groups; rows and m-tiles of each
    constexpr int QW = BRC / WQ, NSW = QW / 8;               // a warp's query columns of S^T, dP^T; their n-tiles
    constexpr int DW = HDP / WQ, NDW = DW / 8;               // a warp's columns of dK_j, dV_j; their n-tiles
    static_assert((WQ == 1 || WQ == 2) && NW % WQ == 0 && QW % 16 == 0 && DW % 16 == 0, "warp layout");
    const int pc = DP > 1 ? (int)blockIdx.z * HDP : 0;
    // dynamic shared memory, in this order (the launcher's smem_bytes adds up the same layout)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Ks = reinterpret_cast<T*>(smem_raw);
    T* Vs = Ks + Bc * LDK;
    T* Qs = Vs + Bc * LDK;       // [2][Br][LDK]
    T* dOs = Qs + 2 * Br * LDK;  // [2][Br][LDK]
    T* dSs = dOs + 2 * Br * LDK; // [2][Bc][LDS]: dS_ij^T (double-buffered when DEFER_DQ)
    T* Pst = dSs + 2 * Bc * LDS; // WQ > 1: [Bc][LDS]: P_ij^T
    float* Ls = reinterpret_cast<float*>(Pst + (WQ > 1 ? Bc * LDS : 0));  // [2][Br]
    float* Ds = Ls + 2 * Br;                               // [2][Br]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, mi = lane / 8;
    const int wk = warp / WQ, wq = warp % WQ;  // this warp's key group (rows KR wk..) and its part in the group
    // j_fast = 0: grid (BH, Tc), every head's j = 0 block (causal: the longest) starts first. j_fast = 1: grid
    // (Tc, BH), the blocks in flight are the K/V tiles of a few heads, which share Q_i, dO_i, dQ_i rows in L2.
    const int j = j_fast ? blockIdx.x : blockIdx.y;
    const long bh = j_fast ? blockIdx.y : blockIdx.x;
    const long kvh = VAR ? (bh / H) * (H / group) + (bh % H) / group : bh;  // the kv head query head bh reads
    // this head's first rows: of Q, dO, dQacc (ldq rows a head), K, V (ldk) and L_i, D_i; dK, dV are K, V's shape when
    // float (summed over a kv group by red.add), the query heads' otherwise (no group then: kvh = bh)
    long q_row0 = bh * ldq, kv_row0 = kvh * ldk, dkv_row0 = kvh * ldk, l_row0 = bh * Nq_pad;
    long hd = bh;  // the (batch, head) of the ALiBi slope and of dropout's counter
    bool varlen = false;
    if constexpr (VAR) {
        if (cu_q != nullptr) {  // varlen: this block's sequence s and head h
            const int sq = (int)bh / H, h = (int)bh % H;
            q_row0 = (long)h * ldq + cu_q[sq];
            kv_row0 = (long)(h / group) * ldk + cu_k[sq];
            dkv_row0 = kv_row0;
            l_row0 = (long)h * Nq_pad + cu_q[sq];
            Nq = cu_q[sq + 1] - cu_q[sq];
            Nk = cu_k[sq + 1] - cu_k[sq];
            hd = h;
            varlen = true;
            if (j * Bc >= Nk) {  // past this sequence's last K/V tile (the whole block: before any barrier)
                if (DQ_ATOMIC && done != nullptr && Nk == 0 && j == 0 && blockIdx.z == 0)  // no keys: dQ = 0
                    convert_dq<4>(dQacc + q_row0 * HD, dQ + q_row0 * HD, 1.f, (long)Nq * HD / 4, tid, NT);
                return;
            }
        }
    }
    const int off = Nk - Nq;  // bottom-right causal alignment: query q sees key kv iff kv <= q + off
    Q += q_row0 * HD; dO += q_row0 * HD; dQacc += q_row0 * HD;
    dQ += DQ_ATOMIC && done != nullptr ? q_row0 * HD : 0;  // otherwise null (dQ is left in dQacc), and stays null
    K += kv_row0 * HD; V += kv_row0 * HD; dK += dkv_row0 * HD; dV += dkv_row0 * HD;
    L2g += l_row0; Dg += l_row0;

    int Tr = (Nq + Br - 1) / Br;  // the loop's end: Q tiles i_begin <= i < Tr
    int i_begin = causal ? max(0, j * Bc - off) / Br : 0;  // earlier Q tiles see none of K_j
    if constexpr (VAR) {  // a window: from the first row whose right side reaches K_j's first key to the last
        const int first = right < 0 ? 0 : max(0, j * Bc - off - right);  // row whose left side reaches its last
        const int last = left < 0 ? Nq - 1 : min(Nq - 1, min(Nk, j * Bc + Bc) - 1 - off + left);
        i_begin = first / Br;
        Tr = first <= last ? last / Br + 1 : i_begin;
    }
    const float slope = VAR && slopes != nullptr ? slopes[hd] : 0.f;
    // The inner loop measures keys from ALiBi's diagonal, adiag = q + off + a_off, and the window from the same
    // point: kv > q + off + right  <=>  kv > adiag + hi_off (an unbounded side: an offset no key reaches).
    const int hi_off = right < 0 ? (1 << 29) : right - a_off, lo_off = left < 0 ? (1 << 29) : left + a_off;

    // L_i, D_i (padded to Nq_pad: always in range) into buffer b
    auto load_l_d = [&](int i, int b) {
        if (VAR && varlen) {  // plain loads: rows past the sequence's end see no key (L = +inf: P = 0)
            if (tid < Br) {
                const bool in = i * Br + tid < Nq;
                Ls[b * Br + tid] = in ? L2g[i * Br + tid] : INF;
                Ds[b * Br + tid] = in ? Dg[i * Br + tid] : 0.f;
            }
        } else if (tid < Br / 4) {
            cp_async_16(Ls + b * Br + 4 * tid, L2g + i * Br + 4 * tid, true);
        } else if (tid < Br / 2) {
            cp_async_16(Ds + b * Br + 4 * (tid - Br / 4), Dg + i * Br + 4 * (tid - Br / 4), true);
        }
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
    // [mt * NDW + n] (ND = MS * NDW entries at every WQ)
    float dv[ND][4], dk[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv[n][e] = dk[n][e] = 0.f;
    // KREG: this warp's K_j, V_j A fragments. An array a configuration does not use keeps one entry (C++ has no
    // empty arrays), never read.
    u32 akr[KREG ? MS * HD / 16 : 1][4], avr[KREG ? MS * HD / 16 : 1][4];
    // This lane's ldmatrix rows as 32-bit shared addresses, computed once; each load below adds a compile-time byte
    // offset (an immediate). A operands, this warp's rows of K_j, V_j (and, WQ > 1, of P_ij^T, dS_ij^T): lanes 0-15
    // the rows, lanes 16-31 the same rows +8 columns.
    const u32 ka_base = smem_u32(Ks + (KR * wk + lane % 16) * LDK + (lane / 16) * 8);
    const u32 va_base = smem_u32(Vs + (KR * wk + lane % 16) * LDK + (lane / 16) * 8);
    const u32 pa_base = smem_u32(Pst + (KR * wk + lane % 16) * LDS + (lane / 16) * 8);
    const u32 da_base = smem_u32(dSs + (KR * wk + lane % 16) * LDS + (lane / 16) * 8);
    // B operands of S^T, dP^T: this warp's rows of Q_i, dO_i as they are; of dV_j, dK_j: its columns of Q_i, dO_i
    // through ldmatrix .trans (buffer 0, chunk 0)
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
        // first chunk's S^T, dP^T (kk below), not in one burst
        const bool prefetch = i + 1 < Tr;
        using Copy = TileCopy<T, Br, HD, LDK, NT>;
        const Copy copy_q(Qs + (buf ^ 1) * Br * LDK, Q, (i + 1) * Br, Nq, tid);
        const Copy copy_o(dOs + (buf ^ 1) * Br * LDK, dO, (i + 1) * Br, Nq, tid);
        if (prefetch) load_l_d(i + 1, buf ^ 1);
        if (KREG && i == i_begin) {  // K_j, V_j have landed (barrier above): their A fragments, once
#pragma unroll
            for (int mt = 0; mt < (KREG ? MS : 0); ++mt)
#pragma unroll
                for (int kk = 0; kk < HD / 16; ++kk) {
                    ldsm_x4(akr[mt * (HD / 16) + kk], ka_base + 2 * (mt * 16 * LDK + kk * 16));
                    ldsm_x4(avr[mt * (HD / 16) + kk], va_base + 2 * (mt * 16 * LDK + kk * 16));
                }
        }
        T* dSt = dSs + (DEFER_DQ ? buf : 0) * Bc * LDS;

#pragma unroll 1
        for (int c = 0; c < Br / BRC; ++c) {  // chunks of BRC query rows
            const u32 chunk = 2 * (buf * Br + c * BRC) * LDK;  // byte offset of this buffer's chunk in Q_i, dO_i
            const float* Lb = Ls + buf * Br + c * BRC;
            const float* Db = Ds + buf * Br + c * BRC;
            const int q0 = i * Br + c * BRC;  // first query row of the chunk

            // Alg.2 L10: S_ij^T = K_j Q_i^T and dP_ij^T = V_j dO_i^T, this warp's KR key rows x QW queries
            // (m-tile mt, n-tile n at [mt * NSW + n])
            float s[MS * NSW][4], dp[MS * NSW][4];
            zero(s), zero(dp);
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                if (prefetch && c == 0) {  // passes kk * 2P / (HD / 16).. of Q_{i+1} then dO_{i+1} (P each)
                    constexpr int P = Copy::PASSES, KK = HD / 16;
#pragma unroll
                    for (int x = kk * 2 * P / KK; x < (kk + 1) * 2 * P / KK; ++x) {
                        if (x < P) copy_q.pass(x);
                        else copy_o.pass(x - P);
                    }
                }
                u32 akl[MS][4], avl[MS][4];  // A = K_j, V_j rows KR wk + 16 mt.., cols kk*16..
                if (!KREG) {
#pragma unroll
                    for (int mt = 0; mt < MS; ++mt) {
                        ldsm_x4(akl[mt], ka_base + 2 * (mt * 16 * LDK + kk * 16));
                        ldsm_x4(avl[mt], va_base + 2 * (mt * 16 * LDK + kk * 16));
                    }
                }
#pragma unroll
                for (int np = 0; np < QW / 16; ++np) {
                    u32 bq[4], bo[4];  // B[d][q] = Q_i[q][d]: rows of Q_i are the columns of B, no transpose
                    ldsm_x4(bq, qb_base + chunk + 2 * (np * 16 * LDK + kk * 16));
                    ldsm_x4(bo, ob_base + chunk + 2 * (np * 16 * LDK + kk * 16));
#pragma unroll
                    for (int mt = 0; mt < MS; ++mt) {
                        const u32* ak = KREG ? akr[KREG ? mt * (HD / 16) + kk : 0] : akl[mt];
                        const u32* av = KREG ? avr[KREG ? mt * (HD / 16) + kk : 0] : avl[mt];
                        mma_16816<T>(s[mt * NSW + 2 * np], ak, bq);
                        mma_16816<T>(s[mt * NSW + 2 * np + 1], ak, bq + 2);
                        mma_16816<T>(dp[mt * NSW + 2 * np], av, bo);
                        mma_16816<T>(dp[mt * NSW + 2 * np + 1], av, bo + 2);
                    }
                }
            }

            if (c == 0) cp_async_commit();  // the next tile's copies (an empty group on the last tile)

            // Alg.2 L11-13: P_ij, dS_ij (p_and_ds, backward_tiles.cuh), masked only on the last K tile and diagonal.
            // Accumulator (row g/g+8, cols 2t, 2t+1) of n-tile n is exactly the A fragment of k-step n/2:
            // WQ = 1 packs it to 16-bit in place (FA2's register reuse); WQ > 1 stores it to shared memory, where
            // the other warp of the key group reads it.
            bool need_mask = (j * Bc + Bc > Nk) || (causal && q0 + off < j * Bc + Bc - 1);
            if constexpr (VAR)  // keys right of the first row's window, or left of the last row's
                need_mask = (j * Bc + Bc > Nk) || (right >= 0 && q0 + off + right < j * Bc + Bc - 1) ||
                            (left >= 0 && j * Bc < q0 + BRC - 1 + off - left);
            u32 pa[WQ == 1 ? BRC / 16 : 1][4], dsa[WQ == 1 ? BRC / 16 : 1][4];
            u32 zb = 0u;  // DROP: the keep bits of n-tiles n, n + 1 (n even), bit 2 o + x = output o of the Philox
                          // call for query column x (one register, not the eight draws)
#pragma unroll
            for (int mt = 0; mt < MS; ++mt) {
                const int kr = KR * wk + 16 * mt + g;  // this thread's key rows kr, kr + 8 of K_j
#pragma unroll
                for (int n = 0; n < NSW; ++n) {
                    const int qc = QW * wq + n * 8 + 2 * t;  // this thread's query columns qc, qc + 1 of the chunk
                    float p[4], ds[4];
                    if (DROP && n % 2 == 0) {  // queries q0 + qc + x (+8), keys kr (+8) of K_j
                        const Dropout drop{keep, seed_lo, seed_hi, rp, q_off, k_off};
                        zb = 0u;
#pragma unroll
                        for (int x = 0; x < 2; ++x) {
                            const uint4 u = dropout_draws(drop, q0 + qc + x, j * Bc + kr, hd);
                            zb |= (u32)(u.x < keep) << x | (u32)(u.y < keep) << (2 + x) |
                                  (u32)(u.z < keep) << (4 + x) | (u32)(u.w < keep) << (6 + x);
                        }
                    }
                    const float* sv = s[mt * NSW + n];
                    const float* dpv = dp[mt * NSW + n];
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int ql = qc + (e % 2);  // local query column
                        const int kv = j * Bc + kr + (e / 2) * 8;
                        if constexpr (VAR) {
                            const int adiag = q0 + ql + off + a_off;  // ALiBi's diagonal (the query's; a ring's moves)
                            const bool visible =
                                !need_mask || !(kv >= Nk || kv > adiag + hi_off || kv < adiag - lo_off);
                            float x = sv[e] * scale, dcap = 1.f;
                            if (softcap > 0.f) {  // tanh(y) (common.cuh; within ~2e-7 of the forward's)
                                const float th = tanh_from_exp2(x * (1.f / softcap) * (2.f * LOG2E_F));
                                x = softcap * th;
                                dcap = 1.f - th * th;
                            }
                            x -= slope * (float)abs(adiag - kv);
                            const float pe = visible ? fast_exp2((x - Lb[ql]) * LOG2E_F) : 0.f;
                            float dpe = dpv[e];
                            p[e] = pe;
                            if constexpr (DROP) {  // Z_ij for (query q, key kv): S^T entry e of n-tile n is output
                                // o = 2 (n % 2) + e / 2 of the call for column x = e % 2 (dropout.cuh's order)
                                const bool kept = (zb >> (2 * (2 * (n % 2) + e / 2) + e % 2)) & 1u;
                                dpe = kept ? dpe * rp : 0.f;  // dP Z / (1 - p)
                                p[e] = kept ? pe : 0.f;       // P Z: the operand of dV_j (rp at the end)
                            }
                            ds[e] = pe * (dpe - Db[ql]) * dcap;
                        } else {
                            const bool visible = !need_mask || !(kv >= Nk || (causal && kv > q0 + ql + off));
                            p_and_ds(p[e], ds[e], sv[e], dpv[e], Lb[ql], Db[ql], scale, visible);
                        }
                    }
                    if constexpr (WQ == 1) {
                        c_to_a<T>(pa[n / 2], n, p);
                        c_to_a<T>(dsa[n / 2], n, ds);
                    } else {  // rows kr, kr + 8 of P^T and dS^T, columns c BRC + qc, qc + 1
                        T* prow = Pst + kr * LDS + c * BRC + qc;
                        T* drow = dSt + kr * LDS + c * BRC + qc;
                        store_row_pair<LDS>(prow, Half2<T>::pack(p[0], p[1]), Half2<T>::pack(p[2], p[3]));
                        store_row_pair<LDS>(drow, Half2<T>::pack(ds[0], ds[1]), Half2<T>::pack(ds[2], ds[3]));
                    }
                }
            }
            if constexpr (WQ > 1) group_sync(1 + wk, 32 * WQ);  // the key group's P^T, dS^T rows are complete

            // Alg.2 L12, L14: dV_j += P_ij^T dO_i;  dK_j += dS_ij^T Q_i (scale at the end), this warp's KR rows x
            // DW columns. B[q][d] = dO_i[q][d]: the k index runs down the rows, so ldmatrix transposes each 8x8 tile.
            const u32 pt = 2 * (c * BRC), dt = 2 * ((DEFER_DQ ? buf : 0) * Bc * LDS + c * BRC);  // byte offsets
#pragma unroll
            for (int kk = 0; kk < BRC / 16; ++kk) {
                u32 apl[WQ == 1 ? 1 : MS][4], adl[WQ == 1 ? 1 : MS][4];  // WQ > 1: P^T, dS^T rows from shared memory
                if constexpr (WQ > 1) {
#pragma unroll
                    for (int mt = 0; mt < MS; ++mt) {
                        ldsm_x4(apl[mt], pa_base + pt + 2 * (mt * 16 * LDS + kk * 16));
                        ldsm_x4(adl[mt], da_base + dt + 2 * (mt * 16 * LDS + kk * 16));
                    }
                }
#pragma unroll
                for (int np = 0; np < DW / 16; ++np) {  // this warp's columns pc + DW wq + 16 np..
                    u32 bo[4], bq[4];
                    ldsm_x4_trans(bo, ot_base + chunk + 2 * (kk * 16 * LDK + np * 16));
                    ldsm_x4_trans(bq, qt_base + chunk + 2 * (kk * 16 * LDK + np * 16));
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

            if (DQ_ATOMIC && WQ == 1) {
                // Alg.2 L15: dQ_i += dS_ij K_j sums over all Bc key rows, i.e. over all warps: dS^T via shared memory
#pragma unroll
                for (int n = 0; n < NS; ++n)  // rows 16 warp + g (+8), columns c BRC + 8 n + 2t, +1
                    store_row_pair<LDS>(dSt + (16 * warp + g) * LDS + c * BRC + n * 8 + 2 * t,
                                        dsa[n / 2][(n % 2) * 2 + 0], dsa[n / 2][(n % 2) * 2 + 1]);
            }
        }
        if (DQ_ATOMIC && DEFER_DQ && i > i_begin)  // dQ_{i-1}: its atomics drain at the next tile's barrier
            dq_tile_atomic<T, HD, HDP, Br, Bc, DQ_MT, LDK, LDS>(dSs + (buf ^ 1) * Bc * LDS, Ks, dQacc, (i - 1) * Br,
                                                                Nq, scale, pc, warp, lane);
        if (DQ_ATOMIC && !DEFER_DQ) {
            __syncthreads();  // all of dS_ij^T is in shared memory before any warp reads other warps' rows
            dq_tile_atomic<T, HD, HDP, Br, Bc, DQ_MT, LDK, LDS>(dSt, Ks, dQacc, i * Br, Nq, scale, pc, warp, lane);
        }
    }
    if (DQ_ATOMIC && DEFER_DQ && i_begin < Tr) {  // dQ of the last Q tile
        __syncthreads();  // every warp has written its rows of the last dS^T
        dq_tile_atomic<T, HD, HDP, Br, Bc, DQ_MT, LDK, LDS>(dSs + ((Tr - 1 - i_begin) & 1) * Bc * LDS, Ks, dQacc,
                                                            (Tr - 1) * Br, Nq, scale, pc, warp, lane);
    }

    // Alg.2 L19: dK_j = scale * (sum dS^T Q), dV_j, rows < Nk, this warp's columns. 16-bit, or deterministic mode:
    // written. float in atomic mode: ADDED (red.add) to dK, dV: a kv group's query heads sum into one kv head, a ring
    // block (stage 04) into its travelling dK, dV (the launcher zeroes them for a plain call).
#pragma unroll
    for (int mt = 0; mt < MS; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int kv = j * Bc + KR * wk + 16 * mt + g + 8 * h;
            if (kv < Nk) {
#pragma unroll
                for (int n = 0; n < NDW; ++n) {
                    const long idx = (long)kv * HD + pc + DW * wq + n * 8 + 2 * t;
                    const float* v = dv[mt * NDW + n];
                    const float* k = dk[mt * NDW + n];
                    if constexpr (sizeof(TO) == 4 && DQ_ATOMIC) {
                        red_add_f32x2<0>(reinterpret_cast<float*>(dV + idx), (DROP ? rp : 1.f) * v[2 * h],
                                         (DROP ? rp : 1.f) * v[2 * h + 1]);
                        red_add_f32x2<0>(reinterpret_cast<float*>(dK + idx), scale * k[2 * h], scale * k[2 * h + 1]);
                    } else {
                        store2(dV + idx, (DROP ? rp : 1.f) * v[2 * h], (DROP ? rp : 1.f) * v[2 * h + 1]);
                        store2(dK + idx, scale * k[2 * h], scale * k[2 * h + 1]);
                    }
                }
            }
        }

    // Alg.2 L21: dQ = dQ_accum, cast (the atomics added scale dS K), by the last of the head's ceil(Nk / Bc) x DP
    // blocks to finish: each block fences its atomics, then counts itself done; the one completing the count writes dQ.
    if (DQ_ATOMIC && done != nullptr) {  // null done: the launcher converts dQ with a kernel of its own
        __threadfence();  // this thread's dQ atomics are performed before the block's count below
        __syncthreads();  // ... for every thread of the block
        bool last = false;
        if (tid == 0) last = atomicAdd(done + bh, 1) == (Nk + Bc - 1) / Bc * (int)gridDim.z - 1;
        if (__syncthreads_or(last)) {
            __threadfence();  // the other blocks' atomics, made visible by their fences, before the reads
            convert_dq<16>(dQacc, dQ, 1.f, (long)Nq * HD / 4, tid, NT);  // 16 loads in flight
        }
    }
}
