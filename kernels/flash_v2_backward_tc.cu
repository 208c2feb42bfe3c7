// flash_v2_backward_tc.cu: FlashAttention-2 backward on tensor cores (fp16 / bf16 in, fp32 accumulate).
// Paper: Dao, "FlashAttention-2", arXiv 2307.08691, Algorithm 2. mma.sync m16n8k16 + ldmatrix + cp.async
// (the FA2 sm80 design, no Hopper-only instructions). Notation: Q_i, dO_i (Br rows), K_j, V_j (Bc rows).
//
// flash_bwd_tc<T, TO, TQ, HD, Br, Bc, DQ_ATOMIC, DEFER_DQ, DQ_MT, KREG, BRC, WQ>: T the inputs' type, TO dK and dV's,
//   TQ dQ's (16-bit, or float for the ring's partial gradients). Block per (K/V tile j, batch*head), Bc / 16
//   warps (Bc = 128: 8 warps; Br = 128 at d=64, 64 at d=128). The warp layout WQ: with WQ = 1 warp w owns rows
//   16w..16w+15 of K_j, V_j, dK_j, dV_j; with WQ = 2 (FA2's layout) the warps work in pairs, pair p owning rows
//   32p..32p+31 (below).
//   d = 256: a warp's 16 rows of dK_j and dV_j would be 256 fp32 registers a thread, more than a thread has, so
//   the head dim is split in DP = 2 column halves, one per block (grid.z): each block computes all of S_ij^T and
//   dP_ij^T (they sum over the whole head dim) but accumulates only its half of dK_j, dV_j and adds only its half
//   of dQ_i. Of the five matmuls (S, dP, dV, dK, dQ) each block does S and dP whole and three on its half: 3.5
//   each, 7 for the pair against 5 without the split, 1.4x the FLOPs.
//   K_j, V_j are loaded once; the block loops over Q tiles i with Q_i, dO_i, L_i, D_i double-buffered by cp.async.
//   A Q tile is computed in chunks of BRC = 64 query rows: per chunk, each warp computes S_ij^T = K_j Q_i^T and
//   dP_ij^T = V_j dO_i^T for its 16 key rows; P^T and dS^T then sit in registers exactly in the A-fragment layout
//   of the next mma, so dV_j += P^T dO_i and dK_j += dS^T Q_i need no shared memory round trip (WQ = 1). WQ = 2:
//   the two warps of a pair compute S^T, dP^T for their 32 key rows x half of the chunk's queries each, store P^T
//   and dS^T to shared memory, wait for each other (a named barrier for the pair's 64 threads), then each computes
//   dV_j, dK_j for the 32 rows x half of the columns. Per mma a warp then reads half as many rows of Q_i and dO_i
//   (32 key rows share each load, not 16), for one store and one load of P^T and dS^T. KREG (d=64): each
//   warp keeps its K_j, V_j A fragments in registers for the whole kernel. dQ_i += dS_ij K_j sums over all Bc key
//   rows (all warps): dS^T goes to shared memory as 16-bit, the warps split dQ_i (Br x HD) into 16 DQ_MT x NCOL
//   tiles (32 x 32 at both head dims) and add them to an fp32 buffer with red.global.add.v2.f32 (sm_90).
//   DEFER_DQ: tile i's dQ runs at the end of tile i+1, after its dV_j, dK_j (dS^T double-buffered): one barrier
//   per tile, not two, and the atomics leave while the warps wait at the next tile's barrier.
//   With DQ_ATOMIC the head's last block to finish also writes dQ = scale * dQ_accum (a counter per head, below):
//   no conversion kernel. For long heads the launcher passes null counters instead and converts dQ_accum with a
//   kernel of its own (fuse_dq_rule in flash_v2_backward.py): one block converting a long head alone would
//   outlast the rest of the grid.
//   j_fast (a kernel argument): grid (Tc, BH), the K/V tiles of one head side by side, else (BH, Tc) (the launcher
//   picks: j_fast_order).
// flash_bwd_dq_tc<T, HD>: deterministic mode's dQ pass: block per (Q tile i, batch*head), 4 warps x 16 rows,
//   loops over K/V tiles j (double-buffered), recomputes dS_ij and keeps dQ_i in registers: no atomics,
//   the same summation order every run, so dQ is bit-identical across runs.
//
// What changed from version fp32 (flash_v2_backward_fp32.cu), and why it is faster:
//   * the four matmuls of a tile pair (S^T, dP^T, P^T dO, dS^T Q) and dQ's dS K run on tensor cores
//     (mma.sync m16n8k16, fp32 accumulators) with fragments from ldmatrix;
//   * FA2's register reuse: the C fragments of S^T and dP^T become P^T and dS^T in registers, already in the
//     A-operand layout of the next mma, so dV_j and dK_j never round-trip through shared memory;
//   * Q_i, dO_i, L_i, D_i double-buffered by cp.async: tile i+1 lands while tile i is computed; its copies are
//     issued between the mma of S^T, dP^T, a few per k-step, each from one base address plus a constant;
//   * Bc = 128 key rows per block (8 warps) and Br = 128 query rows at d = 64: more mma per byte loaded, and
//     with KREG the K_j, V_j fragments are read from shared memory once per kernel, not once per Q chunk;
//   * dQ split into 32 x 32 tiles, one per warp, each lane adding its accumulator's 2 consecutive floats with one
//     vector reduction (half the atomic instructions of scalar atomicAdd, no shuffles), all of a warp's from one
//     address register plus constants;
//   * DEFER_DQ: one barrier per Q tile instead of two, and the dQ atomics drain during the next tile's barrier;
//   * grid order by mask and length: the K/V tiles of one head run side by side and share Q_i, dO_i and dQ_i rows
//     in L2 (non-causal, and causal up to 2048 keys); longer causal problems start every head's longest block
//     (j = 0) first, so short blocks fill the tail.
//   * every ldmatrix address is a per-lane 32-bit shared base (computed once) plus a compile-time offset, which
//     the instruction encodes as an immediate: no address arithmetic per load in the unrolled loops.
// What bounds it: latency. The registers (about 250 a thread, for the fp32 dK_j, dV_j and S^T, dP^T) allow one
// block of 8 warps per SM, so each warp's wait for its ldmatrix results, its atomics and the block's barriers is
// hidden only by the other 7 warps. Instruction order matters as much as instruction count: a burst of memory
// instructions that reuse one address register makes each wait for the one before it to read that register
// (hence the cp.async copies spread over the S^T loop and the atomics from one base). With WQ = 2 the kernel
// issues as many ldmatrix as FA2's; dev/profile_backward.py compares the two kernels' counters.
//
// Run: python stages/03_flash_v2_backward/run.py --version tc --dtype bf16   (tests: pytest
//      tests/test_03_flash_v2_backward.py; timings beside PyTorch: python dev/bench.py --direction bwd)
#include "common.cuh"
#include "dropout.cuh"

// Copy a tile of `ROWS` rows x HD 16-bit values (rows row0.. of a (N, HD) matrix) to shared memory with row
// stride LD, 16 bytes per cp.async; rows >= N are zero-filled (their source address is clamped to row 0).
// Alg.2 L11-13 for one score: P_ij = exp(scale S_ij - L_i) from the forward's L_i (0 where the key is masked),
// dS_ij = P_ij (dP_ij - D_i). scale S_ij - L_i is one FMA: one rounding, of a number near 0 for the keys that
// matter (folding log2 e into scale and L_i instead rounds both at |S| ~ 1e4 and puts ~1e-3 into P at large
// logits); exp then runs as exp2 on the SFU.
__device__ __forceinline__ void p_and_ds(float& p, float& ds, float s, float dp, float L, float D, float scale,
                                         bool visible) {
    p = visible ? fast_exp2(fmaf(s, scale, -L) * LOG2E_F) : 0.f;
    ds = p * (dp - D);
}

// Thread tid always copies chunk tid % CHUNKS of rows tid / CHUNKS + k RSTEP (pass k): one shared and one global
// base per tile, and compile-time offsets from them (no division or 64-bit multiply per 16 bytes). A tile with all
// its rows (the same for the whole block) needs no test per row. The kernel can issue the passes one at a time,
// spread over other work (flash_bwd_tc prefetches the next Q tile between the mma of S^T, dP^T).
template <typename T, int ROWS, int HD, int LD, int NTHREADS>
struct TileCopy {
    static constexpr int CHUNKS = HD / 8, RSTEP = NTHREADS / CHUNKS;  // 16-byte chunks per row; rows per pass
    static constexpr int PASSES = (ROWS + RSTEP - 1) / RSTEP;
    static_assert(NTHREADS % CHUNKS == 0, "a pass of the block covers whole rows");
    u32 d0;
    const T* s0;
    const T* src;
    int r0;    // this thread's first row of the tile
    int left;  // rows of the tile from this thread's first row to the end of the matrix
    __device__ __forceinline__ TileCopy(T* dst, const T* src_, int row0, int N, int tid) {
        r0 = tid / CHUNKS;
        const int c = (tid % CHUNKS) * 8;
        d0 = smem_u32(dst + r0 * LD + c);
        s0 = src_ + ((long)row0 + r0) * HD + c;
        src = src_;
        left = row0 + ROWS <= N ? ROWS : N - row0 - r0;  // ROWS: the whole tile is there
    }
    __device__ __forceinline__ void pass(int k) const {
        const int tid_row = RSTEP * k;  // + this thread's first row
        if (ROWS % RSTEP != 0 && r0 + tid_row >= ROWS) return;
        if (left == ROWS) {
            cp_async_16_u32(d0 + 2 * tid_row * LD, s0 + tid_row * HD);
        } else {
            const bool ok = tid_row < left;
            cp_async_16_u32(d0 + 2 * tid_row * LD, ok ? s0 + tid_row * HD : src, ok);
        }
    }
};

template <typename T, int ROWS, int HD, int LD, int NTHREADS>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, int row0, int N, int tid) {
    const TileCopy<T, ROWS, HD, LD, NTHREADS> copy(dst, src, row0, N, tid);
#pragma unroll
    for (int k = 0; k < copy.PASSES; ++k) copy.pass(k);
}

// row[OFF..OFF+1] += (a, b), atomically per element (8-byte aligned). sm_90 has a vector reduction, addressed as
// row plus an immediate, so all reductions of a row share one address register; older GPUs take two scalar atomics.
template <int OFF>
__device__ __forceinline__ void red_add_f32x2(float* row, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0+%3], {%1, %2};" ::"l"(row), "f"(a), "f"(b), "n"(4 * OFF) : "memory");
#else
    atomicAdd(row + OFF, a);
    atomicAdd(row + OFF + 1, b);
#endif
}

// The reductions of one lane's dQ accumulators, m-tile M - 1 and the ones before it (NQ n-tiles each): rows
// q + 16 m (entries 0-1) and q + 16 m + 8 (2-3), columns 8 n + 2t.. of `row` (row q's, column 2t's). A template
// recursion, so each offset is a compile-time immediate and all share row's address register. rows: how many
// rows from q exist (CHECK = false, a tile with all its rows: no test, no branch).
template <int M, int NQ, int HD, bool CHECK>
__device__ __forceinline__ void red_dq(float* row, const float (*dq)[NQ][4], int rows) {
    if constexpr (M > 0) {
        red_dq<M - 1, NQ, HD, CHECK>(row, dq, rows);
        constexpr int m = M - 1;
#pragma unroll
        for (int n = 0; n < NQ; ++n) {  // unrolled: n is a constant in each copy
            if (!CHECK || 16 * m < rows) red_add_f32x2<16 * m * HD>(row + 8 * n, dq[m][n][0], dq[m][n][1]);
            if (!CHECK || 16 * m + 8 < rows) red_add_f32x2<(16 * m + 8) * HD>(row + 8 * n, dq[m][n][2], dq[m][n][3]);
        }
    }
}

// Alg.2 L15 for one Q tile: dQ_i += dS_ij K_j, summed over all Bc key rows (all warps), from dS_ij^T in
// shared memory, for the HDP columns pc.. of dQ_i this block adds (HDP = HD unless the head dim is split, see
// flash_bwd_tc). The Bc / 16 warps split dQ_i (Br x HDP) into tiles of 16 MT rows x NCOL columns; other K/V blocks
// add to the same rows at the same time, hence fp32 atomic adds: each lane adds its accumulator's two consecutive
// columns of a row with one 8-byte red.global.add.v2.f32 (sm_90), straight from the mma's registers.
template <typename T, int HD, int HDP, int Br, int Bc, int MT, int LDK, int LDS>
__device__ __forceinline__ void dq_tile_atomic(const T* dSt, const T* Ks, float* dQacc, int q_tile0, int Nq,
                                               float scale, int pc, int warp, int lane) {
    constexpr int NW = Bc / 16;  // warps in the block
    constexpr int RG = Br / (16 * MT), NCOL = HDP / (NW / RG), NQ = NCOL / 8;  // warp -> rows qr0.., columns dc0..
    static_assert(NW % RG == 0 && NQ % 2 == 0, "dQ_i split: the warps must cover Br / (16 MT) row groups evenly");
    const int g = lane / 4, t = lane % 4, mi = lane / 8;
    const int qr0 = 16 * MT * (warp % RG), dc0 = pc + (warp / RG) * NCOL;
    // this lane's ldmatrix rows as 32-bit shared addresses; the loops below add compile-time byte offsets
    const u32 a_base = smem_u32(dSt + ((mi / 2) * 8 + lane % 8) * LDS + qr0 + (mi % 2) * 8);
    const u32 b_base = smem_u32(Ks + ((mi % 2) * 8 + lane % 8) * LDK + dc0 + (mi / 2) * 8);
    float dq[MT][NQ][4];
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[m][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
        u32 a[MT][4];  // A[q][kv] = dS^T[kv][q]: stored transposed, so ldmatrix .trans
#pragma unroll
        for (int m = 0; m < MT; ++m)
            ldsm_x4_trans(a[m], a_base + 2 * (kk * 16 * LDS + 16 * m));
#pragma unroll
        for (int np = 0; np < NQ / 2; ++np) {
            u32 b[4];  // B[kv][d] = K_j[kv][d]
            ldsm_x4_trans(b, b_base + 2 * (kk * 16 * LDK + np * 16));
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                mma_16816<T>(dq[m][2 * np], a[m], b);
                mma_16816<T>(dq[m][2 * np + 1], a[m], b + 2);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)  // dQ_i += scale dS_ij K_j: the accumulator holds dQ itself, whoever reads it
#pragma unroll
        for (int n = 0; n < NQ; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) dq[m][n][e] *= scale;
    const int q = q_tile0 + qr0 + g;  // this lane's first row
    float* row = dQacc + (long)q * HD + dc0 + 2 * t;
    if (q_tile0 + Br <= Nq)  // the same for the whole block
        red_dq<MT, NQ, HD, false>(row, dq, Nq - q);
    else
        red_dq<MT, NQ, HD, true>(row, dq, Nq - q);
}

// One thread's part of an mma accumulator tile as 16-bit pairs: (row g, columns 2t, 2t + 1) at row and (row g + 8,
// the same columns) at row + 8 LD, of a shared-memory matrix of row stride LD. P^T and dS^T go to shared memory
// through it in both warp layouts: with WQ = 2 as soon as they are computed (the other warp of the key group reads
// them for dV_j, dK_j), with WQ = 1 only dS^T, after dK_j, for the dQ step (all warps read it).
template <int LD, typename T>
__device__ __forceinline__ void store_row_pair(T* row, u32 lo, u32 hi) {
    *reinterpret_cast<u32*>(row) = lo;
    *reinterpret_cast<u32*>(row + 8 * LD) = hi;
}

// bar.sync on barrier `id` (1..15; __syncthreads is 0) for `n` threads: the warps of one key group (WQ > 1) wait
// for each other only.
__device__ __forceinline__ void group_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Q, dO: (BH, Nq, HD); K, V: (BH / group, Nk, HD); dK, dV: like K, V; L2g, Dg: (BH, Nq_pad) from bwd_preprocess (L_i,
// +inf for masked or padding rows); dQacc: (BH, Nq, HD) fp32, zeroed (it receives scale dS K, so it holds dQ); dQ:
// (BH, Nq, HD) of TQ, done: one int per
// row of heads of the grid, zeroed (both unused, may be null, without DQ_ATOMIC; null done: dQacc is left for
// bwd_convert_dq, the launcher's choice for large problems: fuse_dq_rule). grid = (BH, ceil(Nk / Bc)) or,
// with j_fast, (ceil(Nk / Bc), BH); 2 * Bc threads.
// A Q tile of Br rows is computed in chunks of BRC query rows (S^T, dP^T of one chunk live in registers; P^T, dS^T
// too with WQ = 1, in shared memory with WQ = 2); the barrier, the Q_i / dO_i load and the dQ step are per Br rows.
// DQ_MT: m-tiles (16 rows) of dQ_i per warp in the dQ step. KREG: this warp's A fragments of K_j, V_j stay in
// registers for the whole kernel. WQ: the warp layout (1 or 2, see the top of the file).
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
// Variable-length packed batches (VAR, cu_q != null): Q, dO, dQacc are (H, total_q, HD), K, V (H / group, total_k,
// HD), dK, dV (H / group, total_k, HD), L2g, Dg (H, Nq_pad) with Nq = total_q, Nk = total_k; sequence s is rows cu_q[s]..
// cu_q[s + 1] - 1 (keys: cu_k). The BH axis of the grid runs over (sequence, head), the Tc axis over the K/V tiles
// of the longest sequence; a block past its sequence's last key returns at once. L_i, D_i of a sequence start at
// any row, so they are read with plain loads (not 16-byte cp.async), rows past the sequence's end as L = +inf
// (P = 0), D = 0.
template <typename T, typename TO, typename TQ, int HD, int Br, int Bc, bool DQ_ATOMIC, bool DEFER_DQ, int DQ_MT,
          bool KREG, int BRC, int WQ, bool VAR = false, bool DROP = false>
__global__ void __launch_bounds__(2 * Bc, 128 / Bc) flash_bwd_tc(
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
    // j_fast = 0: grid = (BH, Tc); blocks start in order of the linear index, so every head's j = 0 block (under
    // causal the one with the most Q tiles) starts first and the short ones fill the tail. j_fast = 1: grid =
    // (Tc, BH): the blocks running together are all K/V tiles of a few heads, which stream the same Q_i, dO_i and
    // add to the same dQ_i rows at about the same time: those stay in L2.
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
    // KREG: this warp's K_j, V_j A fragments. Fragment arrays a configuration does not use (here without KREG; P^T and
    // dS^T below by warp layout) keep one entry, since C++ has no empty arrays; they are never read, and take no
    // registers.
    u32 akr[KREG ? MS * HD / 16 : 1][4], avr[KREG ? MS * HD / 16 : 1][4];
    // This lane's ldmatrix rows as 32-bit shared addresses, computed once. Each load in the unrolled loops below
    // adds a compile-time byte offset (of kk, np, mt), which ldmatrix encodes as an immediate: no address arithmetic
    // per load, where a generic pointer per load costs an IMAD or LEA and a conversion to a shared address.
    // A operands, this warp's rows of K_j, V_j (and, WQ > 1, of P_ij^T, dS_ij^T): lanes 0-15 the rows, lanes 16-31
    // the same rows +8 columns.
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
        // prefetch the next Q tile while this one is computed: L_i, D_i now, Q_i, dO_i pass by pass between the
        // mma of the first chunk's S^T, dP^T (kk below), so that each copy's address is read before the next one's
        // is computed (a burst of copies would wait on each other's address registers)
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

            // Alg.2 L11-13: P_ij, dS_ij (p_and_ds above); the mask only on the last K tile and on the diagonal.
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
    // written. float in atomic mode: ADDED (red.add) to what dK, dV hold: the query heads of a kv group sum into one
    // kv head, and a ring block (stage 04) adds into the block's travelling dK, dV (the launcher zeroes them for a
    // plain call).
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

    // Alg.2 L21 (dQ = dQ_accum, cast: the atomics added scale dS K), by the last of this head's blocks to finish: its ceil(Nk / Bc) K/V
    // tiles x DP column parts all add to the head's dQ_accum rows. Each block counts itself done once its atomics
    // are visible to the whole GPU (the fence before the count); the block whose count completes the head reads
    // the finished accumulator from L2 (recently written: mostly hits) and writes dQ. No third launch.
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

// Keys per K/V tile of flash_bwd_dq_tc: 64; 32 at d = 256, where a warp's 16 x 256 dQ_i already takes 128
// registers a thread beside S and dP.
template <int HD>
__host__ __device__ constexpr int dq_bc() { return HD > 128 ? 32 : 64; }


// Deterministic dQ pass: grid = (BH, ceil(Nq / 64)), 128 threads; warp w owns rows 16w..16w+15 of Q_i.
// dQ: (BH, Nq, HD) of T, written once.
template <typename T, typename TO, int HD>
__global__ void __launch_bounds__(128) flash_bwd_dq_tc(
    const T* __restrict__ Q, const T* __restrict__ K, const T* __restrict__ V, const T* __restrict__ dO,
    const float* __restrict__ L2g, const float* __restrict__ Dg, TO* __restrict__ dQ,
    int Nq, int Nk, int Nq_pad, float scale, int causal) {
    constexpr int Br = 64, Bc = dq_bc<HD>(), NT = 128, LDK = HD + 8, NS = Bc / 8, ND = HD / 8;
    // dynamic shared memory: Q_i, dO_i once, K_j and V_j double-buffered (the launcher's smem_bytes adds it up)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* Qs = reinterpret_cast<T*>(smem_raw);
    T* dOs = Qs + Br * LDK;
    T* Ks = dOs + Br * LDK;      // [2][Bc][LDK]
    T* Vs = Ks + 2 * Bc * LDK;   // [2][Bc][LDK]

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, mi = lane / 8;
    // grid = (BH, Tr); under causal the last Q tiles see the most keys: start them first
    const int i = gridDim.y - 1 - blockIdx.y;
    const long bh = blockIdx.x;
    const int off = Nk - Nq;
    Q += bh * Nq * HD; dO += bh * Nq * HD; dQ += bh * Nq * HD;
    K += bh * Nk * HD; V += bh * Nk * HD;
    L2g += bh * Nq_pad; Dg += bh * Nq_pad;

    // this thread's two query rows (g, g+8 of the warp's 16): L_i * log2 e and D_i in registers
    const int q_lo = i * Br + 16 * warp + g;
    const float L_row[2] = {L2g[q_lo], L2g[q_lo + 8]}, D_row[2] = {Dg[q_lo], Dg[q_lo + 8]};

    const int Tc = (Nk + Bc - 1) / Bc;
    const int last_kv = min(Nq - 1, i * Br + Br - 1) + off;  // causal: no K tile past the last row's keys
    const int j_end = !causal ? Tc : (last_kv < 0 ? 0 : min(Tc, last_kv / Bc + 1));

    load_tile_async<T, Br, HD, LDK, NT>(Qs, Q, i * Br, Nq, tid);
    load_tile_async<T, Br, HD, LDK, NT>(dOs, dO, i * Br, Nq, tid);
    if (j_end > 0) {
        load_tile_async<T, Bc, HD, LDK, NT>(Ks, K, 0, Nk, tid);
        load_tile_async<T, Bc, HD, LDK, NT>(Vs, V, 0, Nk, tid);
    }
    cp_async_commit();

    float dq[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dq[n][e] = 0.f;
    // this lane's ldmatrix rows as 32-bit shared addresses (as in flash_bwd_tc): A operands, this warp's rows of
    // Q_i, dO_i; B operands, rows of K_j, V_j as they are (S, dP) and through .trans (dQ), in buffer 0
    const u32 qa_base = smem_u32(Qs + (16 * warp + lane % 16) * LDK + (lane / 16) * 8);
    const u32 oa_base = smem_u32(dOs + (16 * warp + lane % 16) * LDK + (lane / 16) * 8);
    const u32 kb_base = smem_u32(Ks + ((mi / 2) * 8 + lane % 8) * LDK + (mi % 2) * 8);
    const u32 vb_base = smem_u32(Vs + ((mi / 2) * 8 + lane % 8) * LDK + (mi % 2) * 8);
    const u32 kt_base = smem_u32(Ks + ((mi % 2) * 8 + lane % 8) * LDK + (mi / 2) * 8);

    for (int j = 0; j < j_end; ++j) {
        const int buf = j & 1;
        cp_async_wait<0>();  // K_j, V_j (and Q_i, dO_i) have landed for this thread
        __syncthreads();     // ... for every thread; and every warp is done with K_{j-1}, V_{j-1}
        if (j + 1 < j_end) {  // prefetch K_{j+1}, V_{j+1} into the buffer tile j-1 used
            load_tile_async<T, Bc, HD, LDK, NT>(Ks + (buf ^ 1) * Bc * LDK, K, (j + 1) * Bc, Nk, tid);
            load_tile_async<T, Bc, HD, LDK, NT>(Vs + (buf ^ 1) * Bc * LDK, V, (j + 1) * Bc, Nk, tid);
        }
        cp_async_commit();
        const u32 tile = 2 * buf * Bc * LDK;  // byte offset of K_j, V_j's buffer

        // S_ij = Q_i K_j^T, dP_ij = dO_i V_j^T for this warp's 16 query rows
        float s[NS][4], dp[NS][4];
        zero(s), zero(dp);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 aq[4], ao[4];
            ldsm_x4(aq, qa_base + 2 * kk * 16);
            ldsm_x4(ao, oa_base + 2 * kk * 16);
#pragma unroll
            for (int np = 0; np < Bc / 16; ++np) {
                u32 bk[4], bv[4];
                ldsm_x4(bk, kb_base + tile + 2 * (np * 16 * LDK + kk * 16));
                ldsm_x4(bv, vb_base + tile + 2 * (np * 16 * LDK + kk * 16));
                mma_16816<T>(s[2 * np], aq, bk);
                mma_16816<T>(s[2 * np + 1], aq, bk + 2);
                mma_16816<T>(dp[2 * np], ao, bv);
                mma_16816<T>(dp[2 * np + 1], ao, bv + 2);
            }
        }
        // Alg.2 L11-13: P_ij, dS_ij (p_and_ds), dS_ij packed as A fragments
        const bool need_mask = (j * Bc + Bc > Nk) || (causal && i * Br + off < j * Bc + Bc - 1);
        u32 dsa[Bc / 16][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int kv = j * Bc + n * 8 + 2 * t + (e % 2), q = q_lo + (e / 2) * 8;
                const bool visible = !need_mask || !(kv >= Nk || (causal && kv > q + off));
                float p;
                p_and_ds(p, ds[e], s[n][e], dp[n][e], L_row[e / 2], D_row[e / 2], scale, visible);
            }
            c_to_a<T>(dsa[n / 2], n, ds);
        }
        // dQ_i += dS_ij K_j, B[kv][d] = K_j[kv][d] through ldmatrix .trans
#pragma unroll
        for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < HD / 16; ++np) {
                u32 b[4];
                ldsm_x4_trans(b, kt_base + tile + 2 * (kk * 16 * LDK + np * 16));
                mma_16816<T>(dq[2 * np], dsa[kk], b);
                mma_16816<T>(dq[2 * np + 1], dsa[kk], b + 2);
            }
        }
    }
    // dQ_i = scale * sum_j dS_ij K_j
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int q = q_lo + 8 * h;
        if (q < Nq) {
#pragma unroll
            for (int n = 0; n < ND; ++n)
                store2(dQ + (long)q * HD + n * 8 + 2 * t, scale * dq[n][2 * h], scale * dq[n][2 * h + 1]);
        }
    }
}
