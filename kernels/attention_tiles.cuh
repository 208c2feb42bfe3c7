// attention_tiles.cuh: the tile bookkeeping the FlashAttention-2 forward kernels share, in paper notation (the
// stage 02 README's): which (Q tile, head) a block computes, the K/V tiles it visits, masking, the row state m_i, l_i
// and its row max and row sum over a quad, the lse, the fp32x3 kernels' online softmax, the ring block's merge.
// Every stage 02 forward includes it (the pipelined one through kernels/variants.cuh); so do stage 06's headers.
// i, j index tiles (Q_i, K_j); r, c index elements: query row r, key c. Lane = 4 g + t; the 4 lanes of one g are a
// quad, which together hold rows g and g + 8 of an m-tile (kernels/common.cuh).
// Causal masking is aligned bottom-right: query r sees key c iff c <= r + shift, shift = Nk - Nq.
#pragma once
#include "common.cuh"

// The K/V tiles 0 <= j < j_end of BC keys that the Q tile whose first row is row0 visits (Alg.1 L6); returns j_end,
// which (starting at 0) is also their number: Tc = ceil(Nk / BC) without causal. Causal: fewer, as the tiles right of
// the last key its last row sees are skipped entirely (all of their scores would be masked).
template <int BR, int BC>
__device__ __forceinline__ int visited_kv_tiles(int row0, int Nq, int Nk, int causal) {
    const int Tc = (Nk + BC - 1) / BC;
    if (!causal) return Tc;
    const int last_key = min(row0 + BR, Nq) - 1 + (Nk - Nq);
    return last_key < 0 ? 0 : min(Tc, last_key / BC + 1);
}

// S_ij = -inf on the keys a row may not see: keys >= Nk (the ragged last tile) and, causal, keys right of the
// row's diagonal. s holds one warp's mma accumulator fragments of MT m-tiles x NC keys (lane = 4 g + t): entry e
// of n-tile n in m-tile m is row r0 + 16 m + g + 8 (e / 2), key col0 + 8 n + 2 t + (e % 2).
template <int MT, int NC>
__device__ __forceinline__ void mask_scores(float (&s)[MT][NC / 8][4], int r0, int col0, int Nk, int causal,
                                            int shift, int g, int t) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + m * 16 + g + 8 * h;
            // keys col0 + 2t + x are visible for x < lim (x = 8n + (e & 1), the column inside the tile)
            const int lim = (causal ? min(Nk, r + shift + 1) : Nk) - col0 - 2 * t;
#pragma unroll
            for (int n = 0; n < NC / 8; ++n) {
                if (n * 8 >= lim) s[m][n][2 * h] = -INF;
                if (n * 8 + 1 >= lim) s[m][n][2 * h + 1] = -INF;
            }
        }
}

// The variants' mask (stages/common/variants.py): key c is visible to row r iff c < Nk, c <= r + shift + right
// (right >= 0) and c >= r + shift - left (left >= 0). Same fragment layout as mask_scores.
template <int MT, int NC>
__device__ __forceinline__ void mask_window(float (&s)[MT][NC / 8][4], int r0, int col0, int Nk, int left,
                                            int right, int shift, int g, int t) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + m * 16 + g + 8 * h;
            const int hi = min(Nk - 1, right < 0 ? Nk - 1 : r + shift + right);  // visible keys: lo <= c <= hi
            const int lo = left < 0 ? 0 : r + shift - left;
#pragma unroll
            for (int n = 0; n < NC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = col0 + n * 8 + 2 * t + e;
                    if (c > hi || c < lo) s[m][n][2 * h + e] = -INF;
                }
        }
}

// The variants' scores in natural units: x = scale s (s from Q_i K_j^T), then softcap x -> cap tanh(x / cap) (CAP,
// cap > 0), then ALiBi x -> x - slope |r + shift - c| (ALIBI). Same fragment layout as mask_scores. CAP and ALIBI
// are template arguments so that the caller branches once per slice (ModScore::apply), not once per score: a branch
// inside the loop keeps the compiler from interleaving one score's exp2 and reciprocal with the next score's, and a
// predicated-off ALiBi still takes its issue slots.
template <int MT, int NC, bool CAP, bool ALIBI>
__device__ __forceinline__ void transform_scores(float (&s)[MT][NC / 8][4], int r0, int col0, int shift, float scale,
                                                 float softcap, float slope, int g, int t) {
    const float inv_cap = CAP ? 1.f / softcap : 0.f;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int diag = r0 + m * 16 + g + 8 * h + shift;  // the key on row r's diagonal
#pragma unroll
            for (int n = 0; n < NC / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[m][n][2 * h + e] * scale;
                    if constexpr (CAP) {  // tanh(y) = 1 - 2 / (e^{2y} + 1): two SFU operations (ex2, rcp); exact
                        // limits +-1 where e^{2y} overflows or underflows; absolute error a few 1e-7 near 0
                        const float e2y = fast_exp2(x * inv_cap * (2.f * LOG2E_F));
                        x = softcap * (1.f - __fdividef(2.f, e2y + 1.f));
                    }
                    if constexpr (ALIBI) x -= slope * (float)abs(diag - (col0 + n * 8 + 2 * t + e));
                    s[m][n][2 * h + e] = x;
                }
        }
}

// Alg.1 L5 for one thread's rows of Q_i: O_i = 0 (its mma accumulator fragments, MT m-tiles x D columns),
// m_i = -inf, l_i = 0 (rows g and g + 8 of each m-tile).
template <int MT, int D>
__device__ __forceinline__ void init_row_state(float (&acc_o)[MT][D / 8][4], float (&m_i)[MT][2], float (&l_i)[MT][2]) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) acc_o[m][d][0] = acc_o[m][d][1] = acc_o[m][d][2] = acc_o[m][d][3] = 0.f;
        m_i[m][0] = m_i[m][1] = -INF;
        l_i[m][0] = l_i[m][1] = 0.f;
    }
}

// rowmax of one row of the tile (the max before the running m_i enters): over its NC scores in one m-tile's fragments
// (h = 0: row g, h = 1: row g + 8), over this lane's entries and then, by a 4-lane shuffle (warp_max<4>), over the
// lanes of the quad, which hold the rest of the row.
template <int NC>
__device__ __forceinline__ float row_max(const float (&s)[NC / 8][4], int h) {
    float mx = -INF;
#pragma unroll
    for (int n = 0; n < NC / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    return warp_max<4>(mx);
}

// Alg.1 L12: l_i of one row, summed over the 4 lanes of the quad that hold its pieces (each lane summed its own
// entries during the loop), and 1 / l_i (0 for a row that saw no key, so its O_i = 0).
__device__ __forceinline__ float inverse_row_sum(float l_part, float& l) {
    l = warp_sum<4>(l_part);
    return l > 0.f ? 1.f / l : 0.f;
}

// Alg.1 L13 in natural log: L_i = m_i ln 2 + log(l_i) (m_i is in base 2), -inf for a row that saw no key. The product
// in fp64: with huge logits m_i is ~1e4, and an fp32 product would add its own rounding (~1e-3) to the lse.
__device__ __forceinline__ float row_lse(float m, float l) {
    return l != 0.f ? (float)((double)m * 0.6931471805599453 + (double)logf(l)) : -INF;
}

// Alg.1 L9-10 (first half) in float32 and base 2, for the fp32x3 kernels (stage 02's flash_v2_forward_fp32x3.cu,
// stage 06's flash_v3_forward_fp32x3.cu): m_new = max(m_i, rowmax(S) scale log2 e), P~_ij = exp2(S scale log2 e -
// m_new) in place of S (the product rounded before m_new is subtracted, never one FMA, so a row's largest score gives
// exactly 1), l_i, and O_i rescaled by alpha = exp2(m_i - m_new); normalisation deferred. m_i is in base 2: the
// README's m_i times log2 e. masked: the tile was masked (a row that has seen no key yet keeps P~ = 0).
// The pipelined forward (flash_v2_forward_pipelined.cu) writes the same steps inline rather than calling this: its
// SKIP vote skips an m-tile's rescale only once both rows' alpha are known, and its l_i = l_i alpha + rowsum is
// plain C, which the compiler may contract into one FFMA (one rounding) where this function rounds the product and
// the sum apart (__fmul_rn, __fadd_rn), as the mirror's numpy does. So l_i may differ in its last bit between them.
template <int MT, int NC, int D>
__device__ __forceinline__ void online_softmax_fp32(float (&s)[MT][NC / 8][4], float (&m_i)[MT][2],
                                                    float (&l_i)[MT][2], float (&acc_o)[MT][D / 8][4],
                                                    float scale_log2, bool masked) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h = 0: row g (fragment entries 0,1); h = 1: row g+8 (entries 2,3)
            const float mx = row_max<NC>(s[m], h);  // rowmax of row g + 8 h (raw scores), over the quad
            const float m_new = fmaxf(m_i[m][h], mx * scale_log2);
            const float m_use = masked && m_new == -INF ? 0.f : m_new;  // nothing visible yet: P = 0
            const float alpha = fast_exp2(m_i[m][h] - m_use);  // 2^(m_i - m_new): 0 when m_i = -inf
            m_i[m][h] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int n = 0; n < NC / 8; ++n) {
                s[m][n][2 * h] = fast_exp2(__fmul_rn(s[m][n][2 * h], scale_log2) - m_use);
                s[m][n][2 * h + 1] = fast_exp2(__fmul_rn(s[m][n][2 * h + 1], scale_log2) - m_use);
                rs += s[m][n][2 * h] + s[m][n][2 * h + 1];
            }
            // this lane's part of the row sum (the quad's parts add up at the end: inverse_row_sum); not fused
            l_i[m][h] = __fadd_rn(__fmul_rn(l_i[m][h], alpha), rs);
            // __fmul_rn: not fused with the "+= P V" that follows into an FFMA (that keeps later products live)
#pragma unroll
            for (int d = 0; d < D / 8; ++d) {
                acc_o[m][d][2 * h] = __fmul_rn(acc_o[m][d][2 * h], alpha);
                acc_o[m][d][2 * h + 1] = __fmul_rn(acc_o[m][d][2 * h + 1], alpha);
            }
        }
    }
}

// Alg.1 L12-14 in float32, for the fp32x3 kernels: O_i = diag(l_i)^-1 O_i and L_i (row_lse) of the warp's rows
// r0 + 16 m + g + 8 h, written from the fragments: a quad writes 32 consecutive bytes of a row per n-tile.
template <int MT, int D>
__device__ __forceinline__ void write_rows_fp32(float* o, float* lse, const float (&acc_o)[MT][D / 8][4],
                                                const float (&m_i)[MT][2], const float (&l_i)[MT][2], long bh, int Nq,
                                                int r0, int g, int t) {
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l;
            const float inv_l = inverse_row_sum(l_i[m][h], l);  // fully masked row: O = 0
            const int r = r0 + m * 16 + g + 8 * h;
            if (r >= Nq) continue;
            if (t == 0) lse[bh * Nq + r] = row_lse(m_i[m][h], l);
            float* orow = o + (bh * Nq + r) * D + 2 * t;
#pragma unroll
            for (int d = 0; d < D / 8; ++d)
                *reinterpret_cast<float2*>(orow + 8 * d) =
                    make_float2(acc_o[m][d][2 * h] * inv_l, acc_o[m][d][2 * h + 1] * inv_l);
        }
}

// The epilogue of a ring block (float O, stage 04) for row g + 8 h of one m-tile, in the ring's notation (rank r's
// queries, key block j): (orow, *lse_row) hold the row's running O_r, L_r over the blocks merged so far (L_r = -inf:
// none yet; L_run below), and this block's O_rj (acc times inv_l) and L_rj = row_lse(m, l) (L_i below) merge into
// them in the stable form of stage 04's ring.merge (every exponent <= 0):
//     mx = max(L_r, L_rj),   L_new = mx + log(e^(L_r - mx) + e^(L_rj - mx))          (L below)
//     O_r <- e^(L_r - L_new) O_r + e^(L_rj - L_new) O_rj,   L_r <- L_new
// (w_run, w_new below: the two weights, w_new times inv_l since acc is O_rj before dividing by l), so the ring keeps
// no partial result per block and makes no pass of its own over O. Every lane of the warp calls it (the running L is
// read by lane t = 0 and passed to its quad); valid: the row exists (row < Nq).
template <int D>
__device__ __forceinline__ void merge_row_into_running(float* orow, float* lse_row, const float (&acc)[D / 8][4],
                                                       int h, float inv_l, float m, float l, bool valid, int lane) {
    const int t = lane % 4;
    float L_run = -INF;
    if (t == 0 && valid) L_run = *lse_row;
    L_run = __shfl_sync(0xffffffffu, L_run, lane & ~3);  // the quad has it before lane t = 0 overwrites it below
    if (!valid) return;
    const float L_i = row_lse(m, l);
    float w_run = 0.f, w_new = inv_l, L = L_i;  // the first block these rows see: O = O_i, L = L_i
    if (L_run > -INF) {  // merge (the max is finite, so both weights are in [0, 1])
        const float mx = fmaxf(L_run, L_i);
        const float e_run = expf(L_run - mx), e_new = expf(L_i - mx);  // e_new = 0 if L_i = -inf
        L = mx + logf(e_run + e_new);
        w_run = e_run / (e_run + e_new);
        w_new = inv_l * (e_new / (e_run + e_new));
    }
    if (t == 0) *lse_row = L;
    orow += 2 * t;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
        float lo = acc[d][2 * h] * w_new, hi = acc[d][2 * h + 1] * w_new;
        if (w_run != 0.f) {  // (never reads O where nothing was merged yet: it may be uninitialised)
            const float2 prev = *reinterpret_cast<const float2*>(orow + d * 8);
            lo += prev.x * w_run, hi += prev.y * w_run;
        }
        store2(orow + d * 8, lo, hi);
    }
}

// Which (Q tile i, head bh) this block computes. Grid (Tr, B*H) when head_group = 0: the Q tiles of one head side by
// side, sharing K_j, V_j in L2. head_group > 0 (causal): a 1-D grid of B*H*Tr blocks, heads in groups of head_group,
// and inside a group the Q tiles with the most keys (the last ones) first, so short tiles fill the tail (longest job
// first) while the blocks running at once still share the K/V of a few heads in L2. The launcher picks the grid:
// stages/02_flash_v2/tc.py, pipelined_launch (head_group = HEAD_GROUP for causal attention without a window).
template <int BR>
__device__ __forceinline__ void tile_and_head(int head_group, int Nq, int& i, long& bh) {
    if (head_group > 0) {
        const int HG = head_group;
        const int Tr = (Nq + BR - 1) / BR, BH = gridDim.x / Tr;
        const int grp = blockIdx.x / (HG * Tr), r = blockIdx.x % (HG * Tr);
        const int gsz = min(HG, BH - grp * HG);  // heads in this group (the last group may be short)
        i = Tr - 1 - r / gsz;
        bh = (long)grp * HG + r % gsz;
    } else {
        i = blockIdx.x;
        bh = blockIdx.y;
    }
}
