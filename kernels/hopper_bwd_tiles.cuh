// hopper_bwd_tiles.cuh: what one consumer warpgroup of stage 06's backward does with its 64 keys and one Q tile of
// NQ rows, 64 or 128 (FlashAttention-2's Algorithm 2, lines 8-12, transposed), and its epilogue. Warp w owns keys
// 16 w .. 16 w + 15 of the warpgroup's 64; the accumulators of S^T and dP^T have the mma.m16n8 C layout (rows = keys
// g, g + 8; columns = queries 8 n + 2 t, + 1 of each 8-column block n, n < NQ / 8), so L_i and D_i are needed per
// column. A Q tile of NQ rows lies in shared memory as D / 64 panels of NQ rows x 128 bytes.
#pragma once
#include "backward_dq.cuh"
#include "hopper_tiles.cuh"
#include "variants.cuh"

// Whether a Score hook (variants.cuh) changes the scores: then P^T needs the hook's x, and dS^T its derivative.
template <typename Score>
struct ScoreHook {
    enum : bool { MODIFIES = true };
};
template <>
struct ScoreHook<PlainScore> {
    enum : bool { MODIFIES = false };
};

// The one argument of every stage 06 backward version: pointer fields first (kernels.Launch fills them per call),
// tensor maps at multiples of 64 bytes. q, k, v, dO: (B, H, N, D) row-major, seen by the maps as D x N x (B H) in
// boxes of 64 x 64. stages/06_hopper/params.py mirrors it.
struct HopperBwdParams {
    float* dq_acc;       // (B, H, Nq, D) fp32, zeroed by the preprocess: += scale dS K (version wgmma; ws: through
                         // map_dq, and read here by the fused conversion)
    void* dk;            // (B, H, kv_rows, D): the input type, or with accumulate the ring's float32 accumulator
    void* dv;
    const float* lse;    // (B H, Nq_pad): L_i (natural log); +inf where a row sees no key and past Nq (P = 0 there)
    const float* delta;  // (B H, Nq_pad): D_i = rowsum(dO_i o O_i); 0 past Nq
    void* dq;            // (B, H, Nq, D) in the input type: dQ, written by the kernel where done is not null
    int* done;           // one counter per (batch, head), zeroed by the preprocess: the head's blocks count themselves
                         // done, and the last converts the head's dq_acc into dq (version ws); null: the launcher
                         // converts with a kernel of its own
    int Nq, Nk, Nq_pad;
    float scale;         // softmax scale: P = exp(scale S - L), dK = scale dS^T Q
    int causal;          // 1: query r sees key c iff c <= r + Nk - Nq
    int kv_rows;         // rows of one head in dk, dv: Nk, or the ring's whole K/V block of which this call has Nk
    int accumulate;      // 0: write dK, dV; 1: add them to the float32 dk, dv (a block of ring attention, stage 04)
    TensorMap map_q, map_k, map_v, map_do;
    TensorMap map_dq;    // dq_acc seen as D x Nq x (B H), boxes of 32 x 64 floats (version ws's bulk reductions)
};

// S^T = K Q^T and dP^T = V dO^T for this warpgroup's 64 keys (k_s, v_s: 64-row tiles) against Q_i, dO_i (NQ rows:
// one m64nNQ wgmma per K step): issued as two commit groups, S^T's first, so that the caller can wait for S^T alone
// (wgmma_wait<1>) and compute P^T while dP^T is still on the tensor cores (hopper_tiles.cuh: issue_kmajor).
template <typename T, int D, int NQ = 64>
__device__ __forceinline__ void issue_s_dp(float (&s)[NQ / 8][4], float (&dp)[NQ / 8][4], u32 k_s, u32 v_s, u32 q_s,
                                           u32 do_s) {
    wgmma_fence();
    issue_kmajor<T, D, NQ>(s, desc_kmajor_128b(k_s), desc_kmajor_128b(q_s));  // Alg.2 L8
    wgmma_commit();
    issue_kmajor<T, D, NQ>(dp, desc_kmajor_128b(v_s), desc_kmajor_128b(do_s));  // Alg.2 L10
    wgmma_commit();
}

// Alg.2 L9 in place: P^T = exp(scale S^T - L_i), as exp2((scale S^T - L_i) log2 e): scale S - L is one FMA, one
// rounding of a number near 0 (folding log2 e into the scale and L instead would round each of two large numbers,
// an error that grows with the logits). Entries whose key the query does not see are 0 (masked: this tile has such
// entries; mask: stage 02's Mask hook, variants.cuh, asked entry by entry: hidden(row, key), S^T's rows are keys).
// lse: L_i of the Q tile's NB x 8 rows (global or shared memory); kr: this lane's first key; row0: the Q tile's first
// row. Plain attention's Score hook (PlainScore: nothing to do); the variants' is capped_scores_t and
// probabilities_ds_t.
// Every exponential is taken, then the mask overwrites: straight-line code whose MUFU.EX2s overlap one another. Were
// each exp2 taken only where the entry is seen, the compiler would branch around each one, and the warp would wait
// for every exp2 in turn.
template <int NB, typename Mask>
__device__ __forceinline__ void probabilities_t(float (&s)[NB][4], float scale, const float* lse, int kr, int row0,
                                                bool masked, int t, const Mask& mask) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {  // column 8 nb + 2 t + e % 2 is query row0 + 8 nb + 2 t + e % 2
        const float2 L = *reinterpret_cast<const float2*>(lse + 8 * nb + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] = fast_exp2(fmaf(s[nb][e], scale, -(e % 2 ? L.y : L.x)) * LOG2E_F);
    }
    if (!masked) return;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = kr + 8 * (e / 2), row = row0 + 8 * nb + 2 * t + (e % 2);
            if (mask.hidden(row, key)) s[nb][e] = 0.f;
        }
}

// Alg.2 L9-11 with the variants' Score hook (ModScore, variants.cuh), in two passes over S^T, each one straight-line
// code for every option (a copy of a pass per option would not fit the registers beside S^T, dP^T, dK_j, dV_j).
// First, while dP^T is still on the tensor cores, with softcap c only (capped_scores_t): S^T -> c tanh(scale S^T / c)
// by the forward's own arithmetic (variants.cuh: transform_scores), so the backward's P^T is the forward's P where
// the scores are. Then, once dP^T is done (probabilities_ds_t): x = the capped score (or scale S^T without softcap),
// ALiBi x -> x - slope |diag - key| (slope 0: none), P^T = exp(x - L_i), and dS^T = P^T o (dP^T - D_i) o dcap in place
// of dP^T, dcap = 1 - (x_capped / c)^2 the softcap's derivative, read off the capped score itself (1 without).
template <int NB>
__device__ __forceinline__ void capped_scores_t(float (&s)[NB][4], const ModScore& score) {
    const float inv_cap = 1.f / score.softcap;
#pragma unroll
    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float e2y = fast_exp2(s[nb][e] * score.scale * inv_cap * (2.f * LOG2E_F));
            s[nb][e] = score.softcap * (1.f - __fdividef(2.f, e2y + 1.f));
        }
}

// ALiBi's distance |row + diag_shift - key| in float: a per-lane base and a constant per entry (exact below 2^24),
// not an integer conversion per entry. The mask is asked for every entry, with no test of the part first: the branch
// around it would keep more registers live than the four rows of S^T that the comparisons cost.
template <int NB, typename Mask>
__device__ __forceinline__ void probabilities_ds_t(float (&s)[NB][4], float (&dp)[NB][4], const ModScore& score,
                                                   const float* lse, const float* delta, int kr, int row0, int t,
                                                   const Mask& mask) {
    const bool cap = score.softcap > 0.f;
    const float mult = cap ? 1.f : score.scale, inv_cap = cap ? 1.f / score.softcap : 0.f;
    const float base = (float)(row0 + 2 * t + score.diag_shift - kr);  // entry (nb, e): + 8 nb + e % 2 - 8 (e / 2)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const float2 L = *reinterpret_cast<const float2*>(lse + 8 * nb + 2 * t);
        const float2 Di = *reinterpret_cast<const float2*>(delta + 8 * nb + 2 * t);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float xc = s[nb][e] * mult, th = xc * inv_cap;
            const float x = xc - score.slope * fabsf(base + (float)(8 * nb + e % 2 - 8 * (e / 2)));
            float pe = fast_exp2((x - (e % 2 ? L.y : L.x)) * LOG2E_F);
            if (mask.hidden(row0 + 8 * nb + 2 * t + (e % 2), kr + 8 * (e / 2))) pe = 0.f;
            s[nb][e] = pe;
            dp[nb][e] = pe * (dp[nb][e] - (e % 2 ? Di.y : Di.x)) * (1.f - th * th);
        }
    }
}

// Alg.2 L11 in place of dP^T: dS^T = P^T o (dP^T - D_i); delta: D_i of the Q tile's NB x 8 rows.
template <int NB>
__device__ __forceinline__ void ds_t(float (&dp)[NB][4], const float (&pt)[NB][4], const float* delta, int t) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
        const float2 Di = *reinterpret_cast<const float2*>(delta + 8 * nb + 2 * t);
        dp[nb][0] = pt[nb][0] * (dp[nb][0] - Di.x), dp[nb][1] = pt[nb][1] * (dp[nb][1] - Di.y);
        dp[nb][2] = pt[nb][2] * (dp[nb][2] - Di.x), dp[nb][3] = pt[nb][3] * (dp[nb][3] - Di.y);
    }
}

// dS^T's A fragments of 64 queries (four K steps) into a 64 x 64 tile of shared memory at ds_s (rows = this
// warpgroup's keys, 128 bytes of 64 queries) in the 128-byte swizzle a TMA tile has: the pair of columns 8 nb + 2 t,
// + 1 of row r sits in 16-byte chunk nb ^ (r % 8) at byte 4 t (conflict-free: the 8 rows g of a warp hit 8 different
// chunks). Then the fence that lets wgmma (the async proxy) read what ordinary stores wrote.
__device__ __forceinline__ void store_ds_t(u32 ds_s, const u32 (&da)[4][4], int warp, int g, int t) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // a[w]: row g + 8 (w % 2), columns of n-block 2 kk + w / 2
            const int r = 16 * warp + g + 8 * (w % 2), nb = 2 * kk + w / 2;
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(ds_s + r * 128u + ((nb ^ (r % 8)) << 4) + 4 * t),
                         "r"(da[kk][w])
                         : "memory");
        }
    fence_proxy_async();
}

// acc (64 rows x DP columns, DP / 64 panels of 8 n-blocks) += A (64 x 16 KS from registers: KS K steps of 16) times
// B (16 KS rows x DP columns of a tile in shared memory, MN-major: rows 16 kk.. are 2048 bytes further, panels of
// 16 KS rows 2048 KS bytes apart). col_panel: B's first 64-column panel. Alg.2 L9 dV += P^T dO and L12 dK += dS^T Q,
// over the Q tile's 16 KS rows.
template <typename T, int DP, int KS>
__device__ __forceinline__ void issue_rs(float (&acc)[DP / 64][8][4], const u32 (&a)[KS][4], u32 b_s, int col_panel) {
    constexpr u32 PANEL = KS * 2048u;
    const u64 bd = desc_mnmajor_128b(b_s + col_panel * PANEL, PANEL);
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        if constexpr (DP == 128)
            wgmma_64x128x16_rs<T>(reinterpret_cast<float(&)[64]>(acc), a[kk], desc_advance(bd, kk * 2048u), 1);
        else
            wgmma_64x64x16_rs<T>(reinterpret_cast<float(&)[32]>(acc[0]), a[kk], desc_advance(bd, kk * 2048u), 1);
    }
}

// After the wait for dV_j += P^T dO_i and dK_j += dS^T Q_i (issue_rs): their accumulators and A fragments are
// ordinary registers again, and nothing that uses them may move across the wait (hopper.cuh: fence_operands).
template <int DP, int KS>
__device__ __forceinline__ void fence_rs(float (&dv)[DP / 64][8][4], float (&dk)[DP / 64][8][4], u32 (&pa)[KS][4],
                                         u32 (&da)[KS][4]) {
    fence_operands(reinterpret_cast<float(&)[DP / 2]>(dv));
    fence_operands(reinterpret_cast<float(&)[DP / 2]>(dk));
    fence_operands(reinterpret_cast<u32(&)[4 * KS]>(pa));
    fence_operands(reinterpret_cast<u32(&)[4 * KS]>(da));
}

// Alg.2 L16 for this lane's keys kr, kr + 8 of k / v head bh: dK_j = scale sum dS^T Q and dV_j, columns
// 64 col_panel.. (DP of them), written in the input type or (accumulate) added to the ring's float32 accumulators with
// vector reductions (the ring's block calls of one step run side by side and may add to the same keys); keys Nk on
// are left alone. Key c is row k0 + c of the head (k0: a packed sequence's first key, else 0).
template <typename T, int D, int DP>
__device__ __forceinline__ void store_dk_dv(const float (&dk)[DP / 64][8][4], const float (&dv)[DP / 64][8][4],
                                            const HopperBwdParams& p, int bh, int k0, int Nk, int kr, int col_panel,
                                            int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int key = kr + 8 * h;
        if (key >= Nk) continue;
        const long at = ((long)bh * p.kv_rows + k0 + key) * D + 64 * col_panel + 2 * t;
#pragma unroll
        for (int c = 0; c < DP / 64; ++c)
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
                const long x = at + 64 * c + 8 * nb;
                const float dk0 = p.scale * dk[c][nb][2 * h], dk1 = p.scale * dk[c][nb][2 * h + 1];
                if (p.accumulate) {
                    red_add_f32x2<0>(static_cast<float*>(p.dk) + x, dk0, dk1);
                    red_add_f32x2<0>(static_cast<float*>(p.dv) + x, dv[c][nb][2 * h], dv[c][nb][2 * h + 1]);
                } else {
                    store2(static_cast<T*>(p.dk) + x, dk0, dk1);
                    store2(static_cast<T*>(p.dv) + x, dv[c][nb][2 * h], dv[c][nb][2 * h + 1]);
                }
            }
    }
}
