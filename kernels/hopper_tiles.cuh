// hopper_tiles.cuh: what one consumer warpgroup does with one K/V tile in stage 06's forward kernels, and its
// epilogue: Algorithm 1's lines 8-10 and 12-14 (FlashAttention-2) on wgmma. Warp w of the warpgroup owns rows
// 16 w .. 16 w + 15 of its 64-row Q tile; its accumulators have the mma.m16n8 C layout (rows g, g + 8; columns
// 8 n + 2 t, + 1 of each 8-column block n), so the softmax is stage 02's, row by row in registers.
#pragma once
#include "attention_tiles.cuh"
#include "hopper.cuh"

// The one argument. Pointer fields first (kernels.Launch fills them per call), the tensor maps at multiples of 64
// bytes. q, k, v: (B, H, N, D) row-major, seen by the maps as D x N x (B H); stages/06_hopper/flash_v3.py mirrors it.
// Every stage 06 forward version takes it.
struct HopperFwdParams {
    void* o;           // (B, H, Nq, D), the input type
    float* lse;        // (B, H, Nq)
    int Nq, Nk;
    float scale_log2;  // softmax scale x log2(e)
    int causal;        // 1: query r sees key c iff c <= r + Nk - Nq
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

// One K/V tile: S = Q K_j^T (wgmma, both K-major in shared memory), masking, the online softmax in base 2, and
// O += P V_j (wgmma, P in registers, V_j MN-major). q_s, k_s, v_s: shared addresses of 64-row tiles (D / 64 panels
// of 8 KB). r0: this warp's first row; col0: the tile's first key; masked: the tile holds Nk's tail or keys right
// of some row's diagonal.
template <typename T, int D>
__device__ __forceinline__ void consume_tile(RowState<D>& st, u32 q_s, u32 k_s, u32 v_s, int r0, int col0, int Nk,
                                             int causal, int shift, float scale_log2, bool masked, int g, int t) {
    // Alg.1 L8: S_ij = Q_i K_j^T, D / 16 K steps; each 32 bytes further inside a 128-byte panel line.
    float s[8][4];
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
        const u32 off = (k / 4) * 8192u + (k % 4) * 32u;
        wgmma_64x64x16<T>(reinterpret_cast<float(&)[32]>(s), desc_kmajor_128b(q_s + off), desc_kmajor_128b(k_s + off),
                          k > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    if (masked) mask_scores<1, 64>(reinterpret_cast<float(&)[1][8][4]>(s), r0, col0, Nk, causal, shift, g, t);

    // Alg.1 L9-10 in base 2 (stage 02's pipelined kernel): m_ij, P_ij = exp2(S scale log2 e - m), l_ij, alpha.
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(st.m[h], row_max<64>(s, h) * scale_log2);
        const float m_use = m_new == -INF ? 0.f : m_new;  // a row with nothing visible yet: P = 0
        alpha[h] = fast_exp2(st.m[h] - m_use);
        st.m[h] = m_new;
        float rs = 0.f;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            s[n][2 * h] = fast_exp2(__fmul_rn(s[n][2 * h], scale_log2) - m_use);
            s[n][2 * h + 1] = fast_exp2(__fmul_rn(s[n][2 * h + 1], scale_log2) - m_use);
            rs += s[n][2 * h] + s[n][2 * h + 1];
        }
        st.l[h] = st.l[h] * alpha[h] + rs;
    }
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            st.o[c][n][0] *= alpha[0], st.o[c][n][1] *= alpha[0];
            st.o[c][n][2] *= alpha[1], st.o[c][n][3] *= alpha[1];
        }
    u32 pa[4][4];  // P_ij as the A fragments of the 4 K steps of 16 keys
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        c_to_a<T>(pa[kk], 2 * kk, s[2 * kk]);
        c_to_a<T>(pa[kk], 2 * kk + 1, s[2 * kk + 1]);
    }
    // Alg.1 L10: O_i += P_ij V_j, panel by panel of 64 columns; 16 keys further is 2048 bytes.
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < D / 64; ++c)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wgmma_64x64x16_rs<T>(reinterpret_cast<float(&)[32]>(st.o[c]), pa[kk],
                                 desc_mnmajor_128b(v_s + c * 8192u + kk * 2048u, 8192u), 1);
    wgmma_commit();
    wgmma_wait<0>();
}

// Alg.1 L12-14 for this warp's rows r0 + g, r0 + g + 8 of head bh: O_i = diag(l_i)^-1 O_i, L_i = m_i + log l_i
// (natural log); a row that saw no key: O = 0, L = -inf.
template <typename T, int D>
__device__ __forceinline__ void store_rows(const RowState<D>& st, T* o, float* lse, int bh, int Nq, int r0, int g,
                                           int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l;
        const float inv_l = inverse_row_sum(st.l[h], l);
        const int row = r0 + g + 8 * h;
        if (row >= Nq) continue;
        const long at = (long)bh * Nq + row;
        if (t == 0) lse[at] = row_lse(st.m[h], l);
#pragma unroll
        for (int c = 0; c < D / 64; ++c)
#pragma unroll
            for (int n = 0; n < 8; ++n)
                store2(o + at * D + 64 * c + 8 * n + 2 * t, st.o[c][n][2 * h] * inv_l, st.o[c][n][2 * h + 1] * inv_l);
    }
}
