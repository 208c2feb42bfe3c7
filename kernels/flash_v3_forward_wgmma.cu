// flash_v3_forward_wgmma.cu: stage 06 version 1 "wgmma": the FlashAttention-2 forward (Dao, arXiv 2307.08691,
// Algorithm 1) with Hopper's two new data paths (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3.1):
//   * Q_i, K_j, V_j reach shared memory by the copy engine (TMA), 64 x 64 boxes with the 128-byte swizzle; a ring of
//     two K/V stages, each with an mbarrier that completes when its bytes have landed (phase parity = round & 1);
//   * S_ij = Q_i K_j^T by wgmma from shared memory (both K-major), O_i += P_ij V_j by wgmma with P_ij in registers
//     (the accumulators of S_ij rounded to 16 bits are its A fragments) and V_j read as an MN-major operand.
// One warpgroup (4 warps, 128 threads) per (Q tile i of 64 rows, head); warp w owns rows 16 w .. 16 w + 15 and, as in
// stage 02, its softmax is its own. No warp specialisation yet: thread 0 issues the copies.
// Layouts and descriptors: stages/06_hopper/layouts.py. Checked by tests/test_06_hopper_gpu.py.
#include "attention_tiles.cuh"
#include "hopper.cuh"

// The one argument. Pointer fields first (kernels.Launch fills them per call), the tensor maps at multiples of 64
// bytes. q, k, v: (B, H, N, D) row-major, seen by the maps as D x N x (B H); stages/06_hopper/flash_v3.py mirrors it.
struct HopperFwdParams {
    void* o;           // (B, H, Nq, D), the input type
    float* lse;        // (B, H, Nq)
    int Nq, Nk;
    float scale_log2;  // softmax scale x log2(e)
    int causal;        // 1: query r sees key c iff c <= r + Nk - Nq
    TensorMap map_q, map_k, map_v;
};

template <typename T, int D>
__global__ void __launch_bounds__(128, 1) flash_v3_forward_wgmma(const __grid_constant__ HopperFwdParams p) {
    constexpr int PANELS = D / 64;           // 64-column panels of a tile (one TMA box and 8 KB each)
    constexpr u32 TILE = PANELS * 8192u;     // bytes of one 64-row tile
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[3];     // Q_i; K/V stage 0; K/V stage 1
    const u32 q_s = aligned_1024(smem_raw);  // Q_i, then stage s: K at q_s + (1 + 2 s) TILE, V at q_s + (2 + 2 s) TILE
    const u32 bar_q = smem_addr(&bars[0]);
    const int i = blockIdx.x, bh = blockIdx.y, row0 = 64 * i;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq;
    const int last_row = min(row0 + 63, Nq - 1);
    const int last_key = p.causal ? min(Nk - 1, last_row + shift) : Nk - 1;  // the last key a row of Q_i sees
    const int n_tiles = last_key < 0 ? 0 : last_key / 64 + 1;                  // K/V tiles 0 .. n_tiles - 1

    auto load_kv = [&](int j) {  // thread 0: tile j into stage j & 1, both K_j and V_j on the stage's barrier
        const int st = j & 1;
        const u32 bar = smem_addr(&bars[1 + st]), k_s = q_s + (1 + 2 * st) * TILE, v_s = k_s + TILE;
        mbar_arrive_expect_tx(bar, 2 * TILE);
        for (int c = 0; c < PANELS; ++c) {
            tma_load_3d(k_s + c * 8192u, &p.map_k, bar, 64 * c, 64 * j, bh);
            tma_load_3d(v_s + c * 8192u, &p.map_v, bar, 64 * c, 64 * j, bh);
        }
    };
    if (threadIdx.x == 0) {
        for (int b = 0; b < 3; ++b) mbar_init(smem_addr(&bars[b]), 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // Alg.1 L4: Q_i; L6 (j = 0): K_0, V_0
        mbar_arrive_expect_tx(bar_q, TILE);
        for (int c = 0; c < PANELS; ++c) tma_load_3d(q_s + c * 8192u, &p.map_q, bar_q, 64 * c, row0, bh);
        if (n_tiles > 0) load_kv(0);
    }

    // Alg.1 L5. The accumulators of one warp's 16 rows: S in 8 n-blocks of 8 columns (the mma.m16n8 C layout: rows g,
    // g + 8, columns 8 n + 2 t, + 1), O in PANELS x 8 such blocks.
    float o[PANELS][8][4];
#pragma unroll
    for (int c = 0; c < PANELS; ++c) zero(o[c]);
    float m_i[2] = {-INF, -INF}, l_i[2] = {0.f, 0.f};
    mbar_wait(bar_q, 0);

    for (int j = 0; j < n_tiles; ++j) {  // Alg.1 L6
        const int st = j & 1;
        if (j > 0) __syncthreads();  // every warp is done with tile j - 1, whose stage the next copy refills
        if (threadIdx.x == 0 && j + 1 < n_tiles) load_kv(j + 1);
        mbar_wait(smem_addr(&bars[1 + st]), (j >> 1) & 1);  // round j / 2 of this stage
        const u32 k_s = q_s + (1 + 2 * st) * TILE, v_s = k_s + TILE;

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

        // Masking: Nk's tail (the copy engine filled its rows with zeros) and keys right of the diagonal.
        if ((j + 1) * 64 > Nk || (p.causal && (j + 1) * 64 - 1 > row0 + shift))
            mask_scores<1, 64>(reinterpret_cast<float(&)[1][8][4]>(s), row0 + 16 * warp, 64 * j, Nk, p.causal, shift,
                               g, t);
        // Alg.1 L9-10 in base 2 (stage 02's pipelined kernel): m_ij, P_ij = exp2(S scale log2 e - m), l_ij, alpha.
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float m_new = fmaxf(m_i[h], row_max<64>(s, h) * p.scale_log2);
            const float m_use = m_new == -INF ? 0.f : m_new;  // a row with nothing visible yet: P = 0
            alpha[h] = fast_exp2(m_i[h] - m_use);
            m_i[h] = m_new;
            float rs = 0.f;
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                s[n][2 * h] = fast_exp2(__fmul_rn(s[n][2 * h], p.scale_log2) - m_use);
                s[n][2 * h + 1] = fast_exp2(__fmul_rn(s[n][2 * h + 1], p.scale_log2) - m_use);
                rs += s[n][2 * h] + s[n][2 * h + 1];
            }
            l_i[h] = l_i[h] * alpha[h] + rs;
        }
#pragma unroll
        for (int c = 0; c < PANELS; ++c)
#pragma unroll
            for (int n = 0; n < 8; ++n) {
                o[c][n][0] *= alpha[0], o[c][n][1] *= alpha[0];
                o[c][n][2] *= alpha[1], o[c][n][3] *= alpha[1];
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
        for (int c = 0; c < PANELS; ++c)
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                wgmma_64x64x16_rs<T>(reinterpret_cast<float(&)[32]>(o[c]), pa[kk],
                                     desc_mnmajor_128b(v_s + c * 8192u + kk * 2048u, 8192u), 1);
        wgmma_commit();
        wgmma_wait<0>();
    }

    // Alg.1 L12-14: O_i = diag(l_i)^-1 O_i, L_i = m_i + log l_i (natural log); a row that saw no key: O = 0, L = -inf.
    T* o_out = static_cast<T*>(p.o);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l;
        const float inv_l = inverse_row_sum(l_i[h], l);
        const int row = row0 + 16 * warp + g + 8 * h;
        if (row >= Nq) continue;
        const long at = (long)bh * Nq + row;
        if (t == 0) p.lse[at] = row_lse(m_i[h], l);
#pragma unroll
        for (int c = 0; c < PANELS; ++c)
#pragma unroll
            for (int n = 0; n < 8; ++n)
                store2(o_out + at * D + 64 * c + 8 * n + 2 * t, o[c][n][2 * h] * inv_l, o[c][n][2 * h + 1] * inv_l);
    }
}
