// flash_v3_backward_wgmma.cu: stage 06's backward, version "wgmma": the FlashAttention-2 backward (Dao, arXiv
// 2307.08691, Algorithm 2) with the forward's Hopper data paths (FlashAttention-3, Shah et al., arXiv 2407.08608,
// Sec. 3.3): one warpgroup per K/V tile j of 64 keys keeps dK_j and dV_j in its accumulators and walks the Q tiles.
// Per Q tile i of 64 rows, five GEMMs by wgmma, the transposed products so that every result lands where it is used:
//   S_ij^T  = K_j Q_i^T        shared x shared, both K-major (the forward's S = Q K^T with the roles swapped)
//   dP_ij^T = V_j dO_i^T       the same
//   P^T = exp(scale S^T - L_i), dS^T = P^T o (dP^T - D_i), in registers (L_i, D_i: one per column)
//   dV_j   += P_ij^T dO_i      P^T from registers (the accumulator rounded to 16 bits is an A fragment), dO_i
//                              MN-major: the forward's O += P V
//   dK_j   += dS_ij^T Q_i      the same
//   dQ_i   += dS_ij K_j        dS^T through shared memory (written swizzled), read as an MN-major A, K_j as an
//                              MN-major B; scale dQ_i added to the fp32 dQ accumulator with vector reductions
//                              (other K/V blocks add to the same rows at the same time)
// Q_i and dO_i come by TMA into two stages on mbarriers; thread 0 issues the copies. D = 256: two blocks per K/V
// tile (grid.z), each with half of the columns of dK_j, dV_j, dQ_i (DP = 128), as stage 03 splits it: the
// accumulators of all 256 columns do not fit one warpgroup's registers.
// Launched by stages/06_hopper/flash_v3_backward.py after stage 03's preprocess (D_i; L_i, +inf where nothing
// is visible and past Nq); stage 03's bwd_convert_dq turns the accumulator into dQ (scale 1: the kernel adds
// scale dS K). Checked by
// tests/test_06_hopper_gpu.py.
#include "hopper_bwd_tiles.cuh"

// dQ_i (64 x DP) = dS_ij (64 queries x 64 keys) K_j[:, columns of col_panel..]: A = dS^T as stored (keys x queries,
// MN-major for A), B = K_j as stored (keys x D, MN-major for B).
template <typename T, int DP>
__device__ __forceinline__ void issue_dq(float (&dq)[DP / 64][8][4], u32 ds_s, u32 k_s, int col_panel) {
    const u64 ad = desc_mnmajor_128b(ds_s, 8192u), bd = desc_mnmajor_128b(k_s + col_panel * 8192u, 8192u);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // 16 keys further: 2048 bytes in both
        if constexpr (DP == 128)
            wgmma_64x128x16<T, 1, 1>(reinterpret_cast<float(&)[64]>(dq), desc_advance(ad, kk * 2048u),
                                     desc_advance(bd, kk * 2048u), kk > 0);
        else
            wgmma_64x64x16<T, 1, 1>(reinterpret_cast<float(&)[32]>(dq[0]), desc_advance(ad, kk * 2048u),
                                    desc_advance(bd, kk * 2048u), kk > 0);
    }
}

template <typename T, int D, int DP>
__global__ void __launch_bounds__(128, 1) flash_v3_backward_wgmma(const __grid_constant__ HopperBwdParams p) {
    constexpr int PANELS = D / 64;        // 64-column panels of a tile (one TMA box, 8 KB each)
    constexpr u32 TILE = PANELS * 8192u;  // bytes of one 64-row tile
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[3];  // K_j and V_j; Q/dO stage 0; Q/dO stage 1
    // K_j, V_j, dS^T (64 x 64: 8 KB), then stage s: Q_i at q_s + 2 s TILE, dO_i one TILE further
    const u32 k_s = aligned_1024(smem_raw), v_s = k_s + TILE, ds_s = v_s + TILE, q_s = ds_s + 8192u;
    const int j = blockIdx.x, bh = blockIdx.y, col_panel = blockIdx.z * (DP / 64), key0 = 64 * j;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq;
    const int first_row = p.causal ? max(0, key0 - shift) : 0;  // the first query row that sees a key of K_j
    const int i0 = first_row / 64;
    const int n_tiles = first_row >= Nq ? 0 : (Nq + 63) / 64 - i0;  // Q tiles i0 .. i0 + n_tiles - 1
    const u32 bar_kv = smem_addr(&bars[0]);

    auto load_q_do = [&](int n) {  // thread 0: Q and dO of the block's n-th Q tile into stage n & 1
        const u32 bar = smem_addr(&bars[1 + (n & 1)]), dst = q_s + 2 * (n & 1) * TILE;
        mbar_arrive_expect_tx(bar, 2 * TILE);
        for (int c = 0; c < PANELS; ++c) {
            tma_load_3d(dst + c * 8192u, &p.map_q, bar, 64 * c, 64 * (i0 + n), bh);
            tma_load_3d(dst + TILE + c * 8192u, &p.map_do, bar, 64 * c, 64 * (i0 + n), bh);
        }
    };
    if (threadIdx.x == 0) {
        for (int b = 0; b < 3; ++b) mbar_init(smem_addr(&bars[b]), 1);
        mbar_fence_init();
    }
    __syncthreads();
    if (threadIdx.x == 0 && n_tiles > 0) {  // no copy is issued that the block would not wait for
        mbar_arrive_expect_tx(bar_kv, 2 * TILE);
        for (int c = 0; c < PANELS; ++c) {
            tma_load_3d(k_s + c * 8192u, &p.map_k, bar_kv, 64 * c, key0, bh);
            tma_load_3d(v_s + c * 8192u, &p.map_v, bar_kv, 64 * c, key0, bh);
        }
        for (int n = 0; n < min(2, n_tiles); ++n) load_q_do(n);
    }

    float dk[DP / 64][8][4], dv[DP / 64][8][4];  // Alg.2 L5: dK_j, dV_j of this warp's 16 keys (rows of the tile)
#pragma unroll
    for (int c = 0; c < DP / 64; ++c) zero(dk[c]), zero(dv[c]);
    const int kr = key0 + 16 * warp + g;  // this lane's keys: kr (h = 0), kr + 8 (h = 1)
    if (n_tiles > 0) mbar_wait(bar_kv, 0);

    for (int n = 0; n < n_tiles; ++n) {  // Alg.2 L6: the Q tiles that see K_j
        const int row0 = 64 * (i0 + n);
        const u32 qn_s = q_s + 2 * (n & 1) * TILE, do_s = qn_s + TILE;
        mbar_wait(smem_addr(&bars[1 + (n & 1)]), (n >> 1) & 1);
        float s[8][4], dp[8][4];  // S^T, dP^T: rows = this warp's keys, columns = the tile's 64 queries
        issue_s_dp<T, D>(s, dp, k_s, v_s, qn_s, do_s);
        wgmma_wait<1>();
        fence_operands(reinterpret_cast<float(&)[32]>(s));
        const bool masked = key0 + 63 >= Nk || (p.causal && key0 + 63 > row0 + shift);
        const long tile_rows = (long)bh * p.Nq_pad + row0;  // L_i and D_i of the tile, read from global memory
        probabilities_t(s, p.scale, p.lse + tile_rows, kr, row0, masked, t, CausalMask(p, Nq, Nk));  // the mask hook
        wgmma_wait<0>();
        fence_operands(reinterpret_cast<float(&)[32]>(dp));
        ds_t(dp, s, p.delta + tile_rows, t);
        u32 pa[4][4], da[4][4];  // P^T and dS^T as the A fragments of four K steps of 16 queries
        p_fragments<T, 64>(pa, s);
        p_fragments<T, 64>(da, dp);
        store_ds_t(ds_s, da, warp, g, t);
        wgmma_fence();
        issue_rs<T, DP>(dv, pa, do_s, col_panel);  // Alg.2 L9: dV_j += P^T dO_i
        issue_rs<T, DP>(dk, da, qn_s, col_panel);  // Alg.2 L12: dK_j += dS^T Q_i
        wgmma_commit();
        wgmma_wait<0>();
        fence_rs<DP>(dv, dk, pa, da);
        __syncthreads();  // every warp's rows of dS^T are in shared memory
        float dq[DP / 64][8][4];
        wgmma_fence();
        issue_dq<T, DP>(dq, ds_s, k_s, col_panel);  // Alg.2 L13: dQ_i += dS K_j
        wgmma_commit();
        wgmma_wait<0>();
        fence_operands(reinterpret_cast<float(&)[DP / 2]>(dq));
        const int qr = row0 + 16 * warp + g;  // this lane's query rows of dQ_i: qr, qr + 8
        float* acc = p.dq_acc + ((long)bh * Nq + qr) * D + 64 * col_panel + 2 * t;
#pragma unroll
        for (int c = 0; c < DP / 64; ++c)
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
                const float sc = p.scale;
                if (qr < Nq) red_add_f32x2<0>(acc + 64 * c + 8 * nb, sc * dq[c][nb][0], sc * dq[c][nb][1]);
                if (qr + 8 < Nq) red_add_f32x2<0>(acc + 8 * D + 64 * c + 8 * nb, sc * dq[c][nb][2], sc * dq[c][nb][3]);
            }
        __syncthreads();  // stage n & 1 and dS^T are free: every wgmma that read them has completed
        if (threadIdx.x == 0 && n + 2 < n_tiles) load_q_do(n + 2);
    }

    store_dk_dv<T, D, DP>(dk, dv, p, bh, 0, Nk, kr, col_panel, t);  // Alg.2 L16 (a block no query sees writes zeros)
}
