// flash_v3_backward_ws.cu: stage 06's backward, version "ws": version "wgmma" with warp specialisation and the dQ
// reduction moved to the copy engine (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3.3). What changes, and
// why:
//   * dQ_i += dS K_j was 64 x D single reductions per lane and tile into the fp32 accumulator: the largest cost of
//     version 1. Here dQ_i leaves by bulk reductions: the consumers write it to shared memory (panels of 32 floats,
//     128-byte swizzle: conflict-free), one thread hands it to the copy engine (cp.reduce.async.bulk.tensor .add),
//     which adds it to the accumulator while the next tile is computed. The block's K/V tile has 128 keys, and each
//     dQ_i is summed over all of them before it leaves: half as many reductions, and half the bytes to write;
//   * two consumer warpgroups, each on its 64 keys of the tile, share every Q_i and dO_i a producer warpgroup loads
//     (setmaxnreg: 24 registers for it, 240 for each consumer) STAGES tiles ahead on full / empty mbarriers;
//   * dQ_i (64 x D) = dS_i (64 x 128 keys) K_j: each consumer computes half of its columns over all 128 keys (D / 4
//     accumulator registers), so it needs the other's dS^T: two named barriers of both consumers order each tile:
//     both halves of dS^T are written (BAR_DS), both halves of dQ_i are in shared memory (BAR_DQ; one thread then
//     hands all of it to the copy engine);
//   * at D = 64 each consumer holds its keys of K_j and V_j as A fragments in registers, so S^T and dP^T read only
//     Q_i and dO_i from shared memory (hopper_bwd_tiles.cuh: load_a_fragments, issue_s_dp_rs).
// Head dims 64 and 128 (at 256, K_j and V_j of 128 keys and the Q/dO stages do not fit shared memory: version 1).
// A block of ring attention (stage 04; p.accumulate) adds scale dQ_i through map_dq, a map of the ring's float32 dQ
// at the block's rows, and dK_j, dV_j into its float32 accumulators (hopper_bwd_tiles.cuh: store_dk_dv).
// Tile steps and epilogue: hopper_bwd_tiles.cuh. Checked by tests/test_06_hopper_gpu.py.
#include "hopper_bwd_tiles.cuh"

template <typename T, int D, int STAGES>
__global__ void __launch_bounds__(384, 1) flash_v3_backward_ws(const __grid_constant__ HopperBwdParams p) {
    static_assert(D == 64 || D == 128, "version ws: head dims 64 and 128");
    constexpr int PANELS = D / 64;
    constexpr u32 TILE = PANELS * 8192u;  // bytes of one 64-row tile
    constexpr int DQ_COLS = D / 2;  // each consumer's columns of dQ_i, summed over all 128 keys of the tile
    enum { BAR_DS = 1, BAR_DQ = 3 };  // named barriers of both consumers (256 threads)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[1 + 2 * STAGES];  // K and V; full[s]; empty[s]
    // K_j (two 64-key tiles), V_j (two), dS^T (two 64 x 64 tiles: 16 KB), dQ_i (64 rows x D fp32 columns in panels
    // of 64 rows x 128 bytes, swizzled as the map_dq box; consumer me's columns D / 2 me.. are its D / 64 panels),
    // then stage s: Q_i, dO_i; after the stages, stage s's L_i and D_i (64 floats each)
    const u32 k_s = aligned_1024(smem_raw), v_s = k_s + 2 * TILE, ds_s = v_s + 2 * TILE, dq_s = ds_s + 16384u;
    const u32 q_s = dq_s + 64 * D * 4u, ld_s = q_s + STAGES * 2 * TILE;
    auto shared_floats = [&](u32 addr) { return reinterpret_cast<float*>(smem_raw + (addr - smem_addr(smem_raw))); };
    auto full = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty = [&](int s) { return smem_addr(&bars[1 + STAGES + s]); };
    const int wg = threadIdx.x / 128, bh = blockIdx.y, key0 = 128 * blockIdx.x;
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq;
    const int first_row = p.causal ? max(0, key0 - shift) : 0;  // the first query row that sees a key of K_j
    const int i0 = first_row / 64;
    const int n_tiles = first_row >= Nq ? 0 : (Nq + 63) / 64 - i0;  // Q tiles i0 .. i0 + n_tiles - 1

    if (threadIdx.x == 0) {
        mbar_init(smem_addr(&bars[0]), 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);   // the producer's arrival, with the stage's bytes
            mbar_init(empty(s), 8);  // one arrival per consumer warp
        }
        mbar_fence_init();
    }
    __syncthreads();

    if (wg == 0) {  // ---------------- producer: K_j and V_j once, then Q_i and dO_i as stages free up
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0 && n_tiles > 0) {  // no copy is issued that the consumers would not wait for
            mbar_arrive_expect_tx(smem_addr(&bars[0]), 4 * TILE);
            for (int half = 0; half < 2; ++half)
                for (int c = 0; c < PANELS; ++c) {
                    tma_load_3d(k_s + half * TILE + c * 8192u, &p.map_k, smem_addr(&bars[0]), 64 * c,
                                key0 + 64 * half, bh);
                    tma_load_3d(v_s + half * TILE + c * 8192u, &p.map_v, smem_addr(&bars[0]), 64 * c,
                                key0 + 64 * half, bh);
                }
            for (int n = 0; n < n_tiles; ++n) {
                const int s = n % STAGES;
                const u32 dst = q_s + 2 * s * TILE;
                const long tile_rows = (long)bh * p.Nq_pad + 64 * (i0 + n);  // within Nq_pad: a multiple of 64
                mbar_wait(empty(s), ((n / STAGES) & 1) ^ 1);  // round 0 passes at once: the stages start empty
                mbar_arrive_expect_tx(full(s), 2 * TILE + 512);
                bulk_load(ld_s + 512 * s, p.lse + tile_rows, 256, full(s));
                bulk_load(ld_s + 512 * s + 256, p.delta + tile_rows, 256, full(s));
                for (int c = 0; c < PANELS; ++c) {
                    tma_load_3d(dst + c * 8192u, &p.map_q, full(s), 64 * c, 64 * (i0 + n), bh);
                    tma_load_3d(dst + TILE + c * 8192u, &p.map_do, full(s), 64 * c, 64 * (i0 + n), bh);
                }
            }
        }
        return;
    }
    // ---------------- consumers: warpgroup wg - 1 owns keys key0 + 64 (wg - 1) .. + 63
    setmaxnreg_inc<240>();
    const int me = wg - 1;  // consumer index
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kfirst = key0 + 64 * me, kr = kfirst + 16 * warp + g;  // this warpgroup's keys; this lane's
    const u32 k_mine = k_s + me * TILE, v_mine = v_s + me * TILE, dq_mine = dq_s + me * (DQ_COLS / 32) * 8192u;
    const u32 ds_mine = ds_s + me * 8192u;
    const bool issuer = threadIdx.x == 128;  // who talks to the copy engine
    float dk[PANELS][8][4], dv[PANELS][8][4];  // Alg.2 L5
#pragma unroll
    for (int c = 0; c < PANELS; ++c) zero(dk[c]), zero(dv[c]);
    if (n_tiles > 0) mbar_wait(smem_addr(&bars[0]), 0);
    u32 ka[4][4], va[4][4];  // D = 64: this warpgroup's K_j, V_j as A fragments (issue_s_dp_rs)
    if constexpr (D == 64)
        if (n_tiles > 0) load_a_fragments(ka, k_mine, warp, lane), load_a_fragments(va, v_mine, warp, lane);

    for (int n = 0; n < n_tiles; ++n) {  // Alg.2 L6
        const int s = n % STAGES, row0 = 64 * (i0 + n);
        const u32 qn_s = q_s + 2 * s * TILE, do_s = qn_s + TILE;
        mbar_wait(full(s), (n / STAGES) & 1);
        float st[8][4], dp[8][4];  // S^T, dP^T of this warpgroup's keys
        if constexpr (D == 64)
            issue_s_dp_rs<T>(st, dp, ka, va, qn_s, do_s);
        else
            issue_s_dp<T, D>(st, dp, k_mine, v_mine, qn_s, do_s);
        wgmma_wait<1>();
        fence_operands(reinterpret_cast<float(&)[32]>(st));
        const bool masked = kfirst + 63 >= Nk || (p.causal && kfirst + 63 > row0 + shift);
        probabilities_t(st, p, shared_floats(ld_s + 512 * s), kr, row0, masked, t);
        wgmma_wait<0>();
        fence_operands(reinterpret_cast<float(&)[32]>(dp));
        ds_t(dp, st, shared_floats(ld_s + 512 * s + 256), t);
        u32 pa[4][4], da[4][4];
        p_fragments<T, 64>(pa, st);
        p_fragments<T, 64>(da, dp);
        wgmma_fence();
        issue_rs<T, D>(dv, pa, do_s, 0);  // Alg.2 L9: dV_j += P^T dO_i
        issue_rs<T, D>(dk, da, qn_s, 0);  // Alg.2 L12: dK_j += dS^T Q_i
        wgmma_commit();                    // waited for with dQ's: pa, da stay the wgmma's until then
        // dS^T's last readers, the dQ GEMMs of the last tile, are done: both consumers passed its BAR_DQ
        store_ds_t(ds_mine, da, warp, g, t);
        if (issuer) bulk_wait_read<0>();      // the last tile's dQ_i has left shared memory
        named_bar_sync(BAR_DS, 256);  // both halves of dS^T are written; the dQ buffer is free
        // Alg.2 L13: dQ_i += dS_i K_j. A = dS (queries x keys) as dS^T lies (MN-major), B = K_j (MN-major); 16 keys
        // further is 2048 bytes, 64 keys further the next tile
        float dq[DQ_COLS / 8][4];
        const int qr = 16 * warp + g;  // this lane's rows of dQ_i: qr, qr + 8 (the same row % 8)
        // columns 8 nb + 2 t, + 1 of this consumer's buffer: panel nb / 4, 16-byte chunk (2 (nb % 4) + t / 2) ^
        // (row % 8), byte 8 (t % 2); 8 rows further is 1024 bytes
        auto dq_at = [&](int nb) {
            return shared_floats(dq_mine + (nb / 4) * 8192u + qr * 128u +
                                 (((2 * (nb % 4) + t / 2) ^ (qr % 8)) << 4) + 8 * (t % 2));
        };
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {  // columns DQ_COLS me .. of K_j: the next panel at D = 128, 64 bytes into
            // each row of the one panel at D = 64 (the swizzle is a function of the address: the same chunks)
            const u32 a = ds_s + (kk / 4) * 8192u + (kk % 4) * 2048u;
            const u32 b = k_s + (kk / 4) * TILE + me * (D == 128 ? 8192u : 64u) + (kk % 4) * 2048u;
            if constexpr (D == 128)
                wgmma_64x64x16<T, 1, 1>(reinterpret_cast<float(&)[32]>(dq), desc_mnmajor_128b(a, 8192u),
                                        desc_mnmajor_128b(b, 8192u), kk > 0);
            else
                wgmma_64x32x16<T, 1, 1>(reinterpret_cast<float(&)[16]>(dq), desc_mnmajor_128b(a, 8192u),
                                        desc_mnmajor_128b(b, 8192u), kk > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        fence_rs<D>(dv, dk, pa, da);
        fence_operands(reinterpret_cast<float(&)[DQ_COLS / 2]>(dq));
        if (lane == 0) mbar_arrive(empty(s));  // this warp is done with Q_i and dO_i
#pragma unroll
        for (int nb = 0; nb < DQ_COLS / 8; ++nb)  // scale dS K: what the accumulator (or the ring's dQ) gets
            dq[nb][0] *= p.scale, dq[nb][1] *= p.scale, dq[nb][2] *= p.scale, dq[nb][3] *= p.scale;
#pragma unroll
        for (int nb = 0; nb < DQ_COLS / 8; ++nb) {  // this consumer's columns of dQ_i
            *reinterpret_cast<float2*>(dq_at(nb)) = make_float2(dq[nb][0], dq[nb][1]);
            *reinterpret_cast<float2*>(dq_at(nb) + 256) = make_float2(dq[nb][2], dq[nb][3]);
        }
        fence_proxy_async();  // the copy engine reads what these stores wrote
        named_bar_sync(BAR_DQ, 256);
        if (issuer) {  // one box of 64 rows x 32 columns per panel; rows past Nq are skipped
            for (int c = 0; c < D / 32; ++c) tma_reduce_add_3d(&p.map_dq, dq_s + c * 8192u, 32 * c, row0, bh);
            bulk_commit();
        }
    }
    if (issuer) bulk_wait_all<0>();  // no reduction may still read shared memory when the block exits
    store_dk_dv<T, D, D>(dk, dv, p, bh, kr, 0, t);  // Alg.2 L16 (a block no query sees writes zeros)
}
