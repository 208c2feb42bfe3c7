// hopper_tiles.cuh: what one consumer warpgroup does with one K/V tile in stage 06's forward kernels, and its
// epilogue: Algorithm 1's lines 8-10 and 12-14 (FlashAttention-2) on wgmma. Warp w of the warpgroup owns rows
// 16 w .. 16 w + 15 of its 64-row Q tile; its accumulators have the mma.m16n8 C layout (rows g, g + 8; columns
// 8 n + 2 t, + 1 of each 8-column block n), so the softmax is stage 02's, row by row in registers.
#pragma once
#include "attention_tiles.cuh"
#include "hopper.cuh"

// The one argument. Pointer fields first (kernels.Launch fills them per call), the tensor maps at multiples of 64
// bytes. q, k, v: (B, H, N, D) row-major, seen by the maps as D x N x (B H); stages/06_hopper/params.py mirrors it.
// Every stage 06 forward version takes it.
struct HopperFwdParams {
    void* o;           // (B, H, Nq, D), the input type
    float* lse;        // (B, H, Nq)
    const float* amax;  // version fp8: (B H, 3), per head max |q|, |k|, |v|: the e4m3 values are x 448 / amax;
                        // otherwise unused
    int Nq, Nk;
    float scale_log2;  // softmax scale x log2(e)
    int causal;        // 1: query r sees key c iff c <= r + Nk - Nq
    int o_rows;        // rows of one head in o and lse: Nq, or the ring's whole shard when o, lse are its running
                       // (O, L) and this call computes rows of it
    int merge;         // 0: write O_i (the input type) and L_i; 1: merge them into the running float32 (O, L)
    int heads;         // B H: the heads the grid covers (version pingpong walks (Q tile, head) items)
    TensorMap map_q, map_k, map_v;
};

// The running state of one warp's 16 rows: O_i in D / 64 panels of 8 blocks, m_i (base 2, scaled), l_i (this
// lane's part of the row sum).
template <int D>
struct RowState {
    float o[D / 64][8][4];
    float m[2], l[2];

    __device__ void init() {
#pragma unroll
        for (int c = 0; c < D / 64; ++c) zero(o[c]);
        m[0] = m[1] = -INF;
        l[0] = l[1] = 0.f;
    }
};

// Values of T a wgmma K step takes: 16 of 16 bits, 32 of 8 (32 bytes either way).
template <typename T>
struct KStep {
    enum : int { value = 32 / Bytes<T>::value };
};

// acc (64 x NB) = A (64 x D) B^T (NB x D), both K-major in the 128-byte swizzle, from their descriptors: D / KStep K
// steps, a K step 32 bytes further inside a 128-byte panel line, a new panel every 4 steps (A: 64 rows x 128 bytes =
// 8 KB a panel; B: panels of ROWS rows x 128 bytes, of which the first NB take part). Each step's descriptors are the
// first ones moved on by its byte offsets (hopper.cuh: desc_advance, one add), not rebuilt from addresses. The bytes
// are the same for 8-bit values (T = E4M3): a panel line holds 128 of them, a K step 32.
template <typename T, int D, int NB, int ROWS = NB>
__device__ __forceinline__ void issue_kmajor(float (&acc)[NB / 8][4], u64 a, u64 b) {
    static_assert(NB == 64 || NB == 128 || NB == 192, "a K/V tile of 64, 128 or 192 keys");
    static_assert(NB <= ROWS, "the first NB rows of panels of ROWS");
#pragma unroll
    for (int k = 0; k < D / KStep<T>::value; ++k) {
        const u32 a_off = (k / 4) * 8192u + (k % 4) * 32u, b_off = (k / 4) * (ROWS * 128u) + (k % 4) * 32u;
        const u64 ak = desc_advance(a, a_off), bk = desc_advance(b, b_off);
        if constexpr (Bytes<T>::value == 1) {
            static_assert(NB <= 128, "8-bit S tiles of 64 or 128 keys");
            if (NB < ROWS && k == 0)
                wgmma_e4m3_ss_set<NB>(reinterpret_cast<float(&)[NB / 2]>(acc), ak, bk);
            else
                wgmma_e4m3_ss<NB>(reinterpret_cast<float(&)[NB / 2]>(acc), ak, bk, k > 0);
        } else if (NB < ROWS && k == 0)  // part of a tile: acc = A B^T with acc's registers outputs only
            wgmma_64xNx16_set<T, NB>(reinterpret_cast<float(&)[NB / 2]>(acc), ak, bk);
        else if constexpr (NB == 64)  // acc = A B^T for k = 0, then acc += A B^T
            wgmma_64x64x16<T>(reinterpret_cast<float(&)[32]>(acc), ak, bk, k > 0);
        else if constexpr (NB == 128)
            wgmma_64x128x16<T>(reinterpret_cast<float(&)[64]>(acc), ak, bk, k > 0);
        else
            wgmma_64x192x16<T>(reinterpret_cast<float(&)[96]>(acc), ak, bk, k > 0);
    }
}

// Alg.1 L8, issued: S_ij = Q_i K_j^T for the first NC keys (64, 128 or 192) of a tile of ROWS: Q's 64 rows and K_j's
// first NC rows, each D / 64 panels of 128-byte lines. The caller commits and waits.
template <typename T, int D, int NC, int ROWS = NC>
__device__ __forceinline__ void issue_qk(float (&s)[NC / 8][4], u32 q_s, u32 k_s) {
    issue_kmajor<T, D, NC, ROWS>(s, desc_kmajor_128b(q_s), desc_kmajor_128b(k_s));
}

// Alg.1 L10, issued: O_i += P_ij V_j with P_ij's A fragments in registers and the first NC keys of V_j (a tile of ROWS
// keys) MN-major in panels of 64 columns of D (ROWS x 128 bytes each, LBO apart); 16 keys further is 2048 bytes.
// D = 128: both panels in one m64n128 instruction per K step; otherwise panel by panel. The caller commits and waits.
// 8-bit (T = E4M3): the tile is V_j^T, K-major: D = 128 rows of ROWS = 128 keys (one byte each, a 128-byte line), its
// keys permuted within each 16 as p_fragments packs P (stages/06_hopper/fp8.py: key_order); 32 keys a step.
template <typename T, int D, int NC, int ROWS = NC>
__device__ __forceinline__ void issue_pv(RowState<D>& st, const u32 (&pa)[NC / KStep<T>::value][4], u32 v_s) {
    if constexpr (Bytes<T>::value == 1) {
        static_assert(D == 128 && ROWS == 128, "the 8-bit P V: D = 128, tiles of 128 keys");
        const u64 vd = desc_kmajor_128b(v_s);
#pragma unroll
        for (int kk = 0; kk < NC / 32; ++kk)
            wgmma_e4m3_64x128_rs(reinterpret_cast<float(&)[64]>(st.o), pa[kk], desc_advance(vd, kk * 32u), 1);
    } else {
        const u64 vd = desc_mnmajor_128b(v_s, ROWS * 128u);
#pragma unroll
        for (int kk = 0; kk < NC / 16; ++kk) {
            if constexpr (D == 128)
                wgmma_64x128x16_rs<T>(reinterpret_cast<float(&)[64]>(st.o), pa[kk], desc_advance(vd, kk * 2048u), 1);
            else
#pragma unroll
                for (int c = 0; c < D / 64; ++c)
                    wgmma_64x64x16_rs<T>(reinterpret_cast<float(&)[32]>(st.o[c]), pa[kk],
                                         desc_advance(vd, c * (ROWS * 128u) + kk * 2048u), 1);
        }
    }
}

// An item's last K/V tile may hold fewer than BC keys (Nk not a multiple of BC, or the causal diagonal of the item's
// last row). Its GEMMs, mask, softmax and P can then take only the 64-key blocks that hold keys, W = 64 ceil(keys / 64)
// (columns 0 .. W - 1 of S and P; the registers past them are left alone), and the tile's empty blocks cost no tensor
// core work. W must be a compile-time constant (the registers of S and P are named by constant indices), so the caller
// branches once per item, never inside the tile loop: with_width<MAXW>(keys, f) calls f(Cols<W>()) for keys <= MAXW.
template <int W>
struct Cols {
    enum : int { value = W };
};
template <int MAXW, typename F>
__device__ __forceinline__ void with_width(int keys, F&& f) {
    static_assert(MAXW == 64 || MAXW == 128, "a last tile of 64 or 128 keys at most");
    if constexpr (MAXW > 64)
        if (keys <= 64) return f(Cols<64>());
    f(Cols<MAXW>());
}

// The first W columns of a tile's S (float[W / 8][4]) or of its P fragments (u32[W / 16][4]).
template <int W, int N>
__device__ __forceinline__ float (&cols(float (&s)[N][4]))[W / 8][4] {
    static_assert(W / 8 <= N, "a prefix of the tile's columns");
    return reinterpret_cast<float(&)[W / 8][4]>(s);
}
template <int W, int KS = 16, int N>
__device__ __forceinline__ u32 (&cols(u32 (&pa)[N][4]))[W / KS][4] {  // KS: keys a fragment (KStep)
    static_assert(W / KS <= N, "a prefix of the tile's columns");
    return reinterpret_cast<u32(&)[W / KS][4]>(pa);
}

// Alg.1 L9-10 in base 2 (stage 02's pipelined kernel) on this warp's scores of one tile: m_ij, P_ij =
// exp2(S scale log2 e - m) in place of S, l_i, and alpha = exp2(m_old - m_new), by which O_i is still to be scaled.
// LIFT (the FP8 forward: 8): P_ij and l_i are 2^LIFT times larger, P in [0, 2^LIFT], so that rounded to e4m3 its
// small values keep their bits (e4m3's smallest normal is 2^-6); O_i / l_i is the same, and L_i takes off LIFT.
template <int NC, int D, int LIFT = 0>
__device__ __forceinline__ void softmax_tile(RowState<D>& st, float (&s)[NC / 8][4], float scale_log2,
                                             float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(st.m[h], row_max<NC>(s, h) * scale_log2);
        const float m_use = m_new == -INF ? 0.f : m_new;  // a row with nothing visible yet: P = 0
        alpha[h] = fast_exp2(st.m[h] - m_use);
        st.m[h] = m_new;
        float bias;  // exp2's argument is S scale log2 e + bias (-m_use itself without a lift: 0 - m_use is +0 where
                     // m_use = 0, and the compiler keeps the subtraction)
        if constexpr (LIFT == 0)
            bias = -m_use;
        else
            bias = LIFT - m_use;
        float rs = 0.f;
#pragma unroll
        for (int n = 0; n < NC / 8; ++n) {
            s[n][2 * h] = fast_exp2(fmaf(s[n][2 * h], scale_log2, bias));  // one FFMA a score
            s[n][2 * h + 1] = fast_exp2(fmaf(s[n][2 * h + 1], scale_log2, bias));
            rs += s[n][2 * h] + s[n][2 * h + 1];
        }
        st.l[h] = st.l[h] * alpha[h] + rs;
    }
}

// O_i = diag(alpha) O_i (Alg.1 L10's rescaling of the old rows).
template <int D>
__device__ __forceinline__ void rescale_o(RowState<D>& st, const float (&alpha)[2]) {
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            st.o[c][n][0] *= alpha[0], st.o[c][n][1] *= alpha[0];
            st.o[c][n][2] *= alpha[1], st.o[c][n][3] *= alpha[1];
        }
}

// P_ij rounded to 16 bits as the A fragments of its NC / 16 K steps: K step kk is S's n-blocks 2 kk and 2 kk + 1.
// 8-bit (T = E4M3): NC / 32 K steps of S's n-blocks 4 kk .. 4 kk + 3. A lane holds columns 2 t, 2 t + 1 of each
// n-block, the A fragment wants 4 t .. 4 t + 3 and 16 + 4 t .. 16 + 4 t + 3: each register takes the lane's own four
// values of two n-blocks as they are, and the key each of the K step's 32 positions stands for is the one the lane
// put there. V_j^T's keys were laid out in that order (fp8.key_order), so the sum over keys is unchanged and
// no value moves between lanes.
template <typename T, int NC>
__device__ __forceinline__ void p_fragments(u32 (&pa)[NC / KStep<T>::value][4], float (&s)[NC / 8][4]) {
    if constexpr (Bytes<T>::value == 1) {
#pragma unroll
        for (int kk = 0; kk < NC / 32; ++kk) {
            const int n = 4 * kk;
            pa[kk][0] = pack_e4m3x4(s[n][0], s[n][1], s[n + 1][0], s[n + 1][1]);  // row g
            pa[kk][1] = pack_e4m3x4(s[n][2], s[n][3], s[n + 1][2], s[n + 1][3]);  // row g + 8
            pa[kk][2] = pack_e4m3x4(s[n + 2][0], s[n + 2][1], s[n + 3][0], s[n + 3][1]);
            pa[kk][3] = pack_e4m3x4(s[n + 2][2], s[n + 2][3], s[n + 3][2], s[n + 3][3]);
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < NC / 16; ++kk) {
            c_to_a<T>(pa[kk], 2 * kk, s[2 * kk]);
            c_to_a<T>(pa[kk], 2 * kk + 1, s[2 * kk + 1]);
        }
    }
}

// One K/V tile of NC keys, each GEMM waited for before the next step (versions wgmma and ws): S = Q K_j^T, masking,
// the online softmax, O += P V_j. q_s, k_s, v_s: shared addresses of the tiles; r0: this warp's first row; col0: the
// tile's first key; masked: the tile holds Nk's tail or keys right of some row's diagonal.
template <typename T, int D, int NC>
__device__ __forceinline__ void consume_tile(RowState<D>& st, u32 q_s, u32 k_s, u32 v_s, int r0, int col0, int Nk,
                                             int causal, int shift, float scale_log2, bool masked, int g, int t) {
    float s[NC / 8][4];
    wgmma_fence();
    issue_qk<T, D, NC>(s, q_s, k_s);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(reinterpret_cast<float(&)[NC / 2]>(s));
    if (masked) mask_scores<1, NC>(reinterpret_cast<float(&)[1][NC / 8][4]>(s), r0, col0, Nk, causal, shift, g, t);
    float alpha[2];
    softmax_tile<NC, D>(st, s, scale_log2, alpha);
    rescale_o(st, alpha);
    u32 pa[NC / 16][4];
    p_fragments<T, NC>(pa, s);
    wgmma_fence();
    issue_pv<T, D, NC>(st, pa, v_s);
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(reinterpret_cast<float(&)[D / 2]>(st.o));
}

// Alg.1 L12-14 for this warp's rows r0 + g, r0 + g + 8 of head bh: O_i = diag(l_i)^-1 O_i, L_i = m_i + log l_i
// (natural log); a row that saw no key: O = 0, L = -inf. Rows Nq on are not stored; row r is row q0 + r of the head in
// o and lse (q0: a packed sequence's first row, else 0). With p.merge, a block of ring attention (stage 04): O_i, L_i
// merge into the running float32 (O, L) of those rows instead (attention_tiles.cuh: merge_row_into_running).
// o_scale: O_i's factor (version fp8: v's amax / 448); lift: P's 2^lift (softmax_tile's LIFT), taken off L_i.
template <typename T, int D>
__device__ __forceinline__ void store_rows(RowState<D>& st, const HopperFwdParams& p, int bh, int q0, int Nq, int r0,
                                           int g, int t, float o_scale = 1.f, float lift = 0.f) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l;
        const float inv_l = inverse_row_sum(st.l[h], l) * o_scale, m = st.m[h] - lift;
        const int row = r0 + g + 8 * h;
        const long at = (long)bh * p.o_rows + q0 + row;
        if (p.merge) {  // every lane takes part (the running L travels within the quad)
            merge_row_into_running<D>(static_cast<float*>(p.o) + at * D, p.lse + at,
                                      reinterpret_cast<float(&)[D / 8][4]>(st.o), h, inv_l, m, l,
                                      row < Nq, 4 * g + t);
            continue;
        }
        if (row >= Nq) continue;
        T* o = static_cast<T*>(p.o);
        float* lse = p.lse;
        if (t == 0) lse[at] = row_lse(m, l);
#pragma unroll
        for (int c = 0; c < D / 64; ++c)
#pragma unroll
            for (int n = 0; n < 8; ++n)
                store2(o + at * D + 64 * c + 8 * n + 2 * t, st.o[c][n][2 * h] * inv_l, st.o[c][n][2 * h + 1] * inv_l);
    }
}
