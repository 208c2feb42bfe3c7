// flash_v3_backward_ws.cu: stage 06's backward, version "ws": version "wgmma" with warp specialisation and the dQ
// reduction moved to the copy engine (FlashAttention-3, Shah et al., arXiv 2407.08608, Sec. 3.3). What changes, and
// why:
//   * dQ_i += dS K_j was 64 x D single reductions per lane and tile into the fp32 accumulator: the largest cost of
//     version 1. Here dQ_i leaves by bulk reductions: the consumers write it to shared memory (panels of 32 floats,
//     128-byte swizzle, in a lane order free of bank conflicts), one thread hands it to the copy engine
//     (cp.reduce.async.bulk.tensor .add), which adds it to the accumulator while the next tile is computed. The
//     block's K/V tile has 128 keys, and each dQ_i is summed over all of them before it leaves: half as many
//     reductions, and half the bytes to write;
//   * two consumer warpgroups, each on its 64 keys of the tile, share every Q_i and dO_i a producer warpgroup loads
//     (setmaxnreg: 24 registers for it, 240 for each consumer) STAGES tiles ahead on full / empty mbarriers;
//   * Q tiles of BR rows: 64 at D = 128, 128 at D = 64, where the registers allow it (S^T and dP^T of 64 keys x 128
//     queries, 64 registers each, beside dK_j and dV_j of 32 each). Each tile's barriers, softmax bookkeeping and
//     dQ epilogue then serve twice the work, and S^T, dP^T are m64n128 wgmmas;
//   * dQ_i (BR x D) = dS_i (BR x 128 keys) K_j needs both consumers' dS^T: each consumer computes a 64 x 64 part of
//     it over all 128 keys (32 accumulator registers): at D = 128 all 64 rows and columns 64 me..; at D = 64 rows
//     64 me.. and all 64 columns. Two named barriers of both consumers order each tile: both halves of dS^T are
//     written (BAR_DS), all of dQ_i is in shared memory (BAR_DQ; one thread then hands it to the copy engine).
//   * on short heads (the launcher's fuse_dq_rule) the last block of each head to finish converts the head's dQ
//     accumulator to the input type while it is in L2: no third launch and no pass of its own over the accumulator,
//     a fixed cost that weighs most where the GEMMs are fewest. A counter per head, as in stage 03's tc kernel; here
//     one thread counts with an acquire-release atomic while the block's other threads store dK_j, dV_j, so a block
//     that is not last loses almost nothing to the count.
// Head dims 64 and 128 (at 256, K_j and V_j of 128 keys and the Q/dO stages do not fit shared memory: version 1).
// A block of ring attention (stage 04; p.accumulate) adds scale dQ_i through map_dq, a map of the ring's float32 dQ
// at the block's rows, and dK_j, dV_j into its float32 accumulators (hopper_bwd_tiles.cuh: store_dk_dv).
// Tile steps and epilogue: hopper_bwd_tiles.cuh. Checked by tests/test_06_hopper_gpu.py.
#include "hopper_bwd_tiles.cuh"

// BR: rows of a Q tile, chosen by the launcher (stages/06_hopper/flash_v3_backward.py: q_tile_rows).
template <typename T, int D, int STAGES, int BR>
__global__ void __launch_bounds__(384, 1) flash_v3_backward_ws(const __grid_constant__ HopperBwdParams p) {
    static_assert(D == 64 || D == 128, "version ws: head dims 64 and 128");
    static_assert(BR * D == 8192, "version ws: each consumer's part of dQ_i is 64 x 64 (BR = 128 at D = 64, 64 at "
                                  "D = 128)");
    constexpr int PANELS = D / 64;
    constexpr u32 TILE = PANELS * 8192u;    // bytes of 64 rows of K_j or V_j
    constexpr u32 QT = BR * D * 2u;         // bytes of a Q_i or dO_i tile: PANELS panels of BR rows x 128 bytes
    enum { BAR_DS = 1, BAR_DQ = 3, BAR_LAST = 4 };  // named barriers of both consumers (256 threads)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[1 + 2 * STAGES];  // K and V; full[s]; empty[s]
    // K_j (two 64-key tiles), V_j (two), dS^T (BR / 64 panels of 128 keys x 64 queries, 16 KB each), dQ_i (BR x D
    // fp32 in four boxes of 64 rows x 32 columns, swizzled as the map_dq box; boxes 2 me, 2 me + 1 are consumer
    // me's part), then stage s: Q_i, dO_i; after the stages, stage s's L_i and D_i (BR floats each)
    const u32 k_s = aligned_1024(smem_raw), v_s = k_s + 2 * TILE, ds_s = v_s + 2 * TILE, dq_s = ds_s + 256u * BR;
    const u32 q_s = dq_s + BR * D * 4u, ld_s = q_s + STAGES * 2 * QT;
    auto shared_floats = [&](u32 addr) { return reinterpret_cast<float*>(smem_raw + (addr - smem_addr(smem_raw))); };
    auto full = [&](int s) { return smem_addr(&bars[1 + s]); };
    auto empty = [&](int s) { return smem_addr(&bars[1 + STAGES + s]); };
    // the warpgroup index through a shuffle: the compiler then knows it is the same in every lane of a warp, and
    // keeps the addresses and wgmma descriptors derived from it in uniform registers instead of recomputing them
    // in every lane and moving them over before each wgmma
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0), bh = blockIdx.y, key0 = 128 * blockIdx.x;
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq;
    const int first_row = p.causal ? max(0, key0 - shift) : 0;  // the first query row that sees a key of K_j
    const int i0 = first_row / BR;
    const int n_tiles = first_row >= Nq ? 0 : (Nq + BR - 1) / BR - i0;  // Q tiles i0 .. i0 + n_tiles - 1

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
                const int s = n % STAGES, row0 = BR * (i0 + n);
                const u32 dst = q_s + 2 * s * QT;
                const long tile_rows = (long)bh * p.Nq_pad + row0;  // within Nq_pad: a multiple of 128
                mbar_wait(empty(s), ((n / STAGES) & 1) ^ 1);  // round 0 passes at once: the stages start empty
                mbar_arrive_expect_tx(full(s), 2 * QT + 8 * BR);
                bulk_load(ld_s + 8 * BR * s, p.lse + tile_rows, 4 * BR, full(s));
                bulk_load(ld_s + 8 * BR * s + 4 * BR, p.delta + tile_rows, 4 * BR, full(s));
                for (int r = 0; r < BR / 64; ++r)  // boxes of 64 rows x 64 columns: row block r of panel c
                    for (int c = 0; c < PANELS; ++c) {
                        tma_load_3d(dst + c * (BR * 128u) + r * 8192u, &p.map_q, full(s), 64 * c, row0 + 64 * r, bh);
                        tma_load_3d(dst + QT + c * (BR * 128u) + r * 8192u, &p.map_do, full(s), 64 * c,
                                    row0 + 64 * r, bh);
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
    const u32 k_mine = k_s + me * TILE, v_mine = v_s + me * TILE, dq_mine = dq_s + me * 2 * 8192u;
    const bool issuer = threadIdx.x == 128;  // who talks to the copy engine
    float dk[PANELS][8][4], dv[PANELS][8][4];  // Alg.2 L5
#pragma unroll
    for (int c = 0; c < PANELS; ++c) zero(dk[c]), zero(dv[c]);
    if (n_tiles > 0) mbar_wait(smem_addr(&bars[0]), 0);

    for (int n = 0; n < n_tiles; ++n) {  // Alg.2 L6
        const int s = n % STAGES, row0 = BR * (i0 + n);
        const u32 qn_s = q_s + 2 * s * QT, do_s = qn_s + QT;
        mbar_wait(full(s), (n / STAGES) & 1);
        float st[BR / 8][4], dp[BR / 8][4];  // S^T, dP^T of this warpgroup's keys
        issue_s_dp<T, D, BR>(st, dp, k_mine, v_mine, qn_s, do_s);
        wgmma_wait<1>();
        fence_operands(reinterpret_cast<float(&)[BR / 2]>(st));
        const bool masked = kfirst + 63 >= Nk || (p.causal && kfirst + 63 > row0 + shift);
        probabilities_t(st, p, shared_floats(ld_s + 8 * BR * s), kr, row0, masked, t);
        wgmma_wait<0>();
        fence_operands(reinterpret_cast<float(&)[BR / 2]>(dp));
        ds_t(dp, st, shared_floats(ld_s + 8 * BR * s + 4 * BR), t);
        u32 pa[BR / 16][4], da[BR / 16][4];
        p_fragments<T, BR>(pa, st);
        p_fragments<T, BR>(da, dp);
        wgmma_fence();
        issue_rs<T, D>(dv, pa, do_s, 0);  // Alg.2 L9: dV_j += P^T dO_i
        issue_rs<T, D>(dk, da, qn_s, 0);  // Alg.2 L12: dK_j += dS^T Q_i
        wgmma_commit();                    // waited for with dQ's: pa, da stay the wgmma's until then
        // dS^T's last readers, the dQ GEMMs of the last tile, are done: both consumers passed its BAR_DQ
#pragma unroll
        for (int c = 0; c < BR / 64; ++c)  // dS^T's panel c (queries 64 c ..): this warpgroup's 64 key rows
            store_ds_t(ds_s + c * 16384u + me * 8192u, reinterpret_cast<const u32(&)[4][4]>(da[4 * c]), warp, g, t);
        if (issuer) bulk_wait_read<0>();      // the last tile's dQ_i has left shared memory
        named_bar_sync(BAR_DS, 256);  // both halves of dS^T are written; the dQ buffer is free
        // Alg.2 L13: dQ_i += dS_i K_j. A = dS (queries x keys) as dS^T lies (MN-major: panel me at D = 64, where
        // this consumer's rows are queries 64 me..), B = K_j (MN-major: columns 64 me.. at D = 128); 16 keys further
        // is 2048 bytes, 64 keys further the next tile
        float dq[8][4];
        const int qr = 16 * warp + g;  // this lane's rows of dQ_i: qr, qr + 8 (the same row % 8)
        // columns 8 nb + 2 t, + 1 of this consumer's buffer: panel nb / 4, 16-byte chunk (2 (nb % 4) + t / 2) ^
        // (row % 8), byte 8 (t % 2); 8 rows further is 1024 bytes
        auto dq_at = [&](int nb) {
            return shared_floats(dq_mine + (nb / 4) * 8192u + qr * 128u +
                                 (((2 * (nb % 4) + t / 2) ^ (qr % 8)) << 4) + 8 * (t % 2));
        };
        const u64 ad = desc_mnmajor_128b(ds_s + (BR == 128 ? me * 16384u : 0u), 8192u);
        const u64 bd = desc_mnmajor_128b(k_s + (D == 128 ? me * 8192u : 0u), 8192u);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
            wgmma_64x64x16<T, 1, 1>(reinterpret_cast<float(&)[32]>(dq),
                                    desc_advance(ad, (kk / 4) * 8192u + (kk % 4) * 2048u),
                                    desc_advance(bd, (kk / 4) * TILE + (kk % 4) * 2048u), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_rs<D>(dv, dk, pa, da);
        fence_operands(reinterpret_cast<float(&)[32]>(dq));
        if (lane == 0) mbar_arrive(empty(s));  // this warp is done with Q_i and dO_i
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)  // scale dS K: what the accumulator (or the ring's dQ) gets
            dq[nb][0] *= p.scale, dq[nb][1] *= p.scale, dq[nb][2] *= p.scale, dq[nb][3] *= p.scale;
        // this consumer's part of dQ_i. Shared memory serves 8-byte stores half a warp (16 lanes, 128 bytes) at a
        // time. Were every lane on n-block nb, the half of rows g = 0..3 would write chunks (2 (nb % 4) + t / 2) ^ g:
        // 4 of the 8, each twice (a two-way bank conflict). Lanes of odd g store n-block nb ^ 2 in step nb instead:
        // their chunks move by 4, and each half covers all 8 (stages/06_hopper/swizzle.py: dq_store_offsets)
        const bool odd = g & 1;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) v[e] = odd ? dq[nb ^ 2][e] : dq[nb][e];
            float* at = dq_at(odd ? nb ^ 2 : nb);
            *reinterpret_cast<float2*>(at) = make_float2(v[0], v[1]);
            *reinterpret_cast<float2*>(at + 256) = make_float2(v[2], v[3]);
        }
        fence_proxy_async();  // the copy engine reads what these stores wrote
        named_bar_sync(BAR_DQ, 256);
        if (issuer) {  // box b: 64 rows x 32 columns (D = 128: columns 32 b; D = 64: rows 64 (b / 2) .., columns
            // 32 (b % 2)); rows past Nq are skipped
            for (int b = 0; b < 4; ++b)
                tma_reduce_add_3d(&p.map_dq, dq_s + b * 8192u, D == 128 ? 32 * b : 32 * (b % 2),
                                  row0 + (D == 128 ? 0 : 64 * (b / 2)), bh);
            bulk_commit();
        }
    }
    // Alg.2 L21: dQ = dq_acc in the input type, by the last of the head's gridDim.x blocks to finish (p.done not
    // null). The issuer is the one thread whose copies added to dq_acc: once they are complete it fences them (from
    // the copy engine's proxy into ordinary memory order) and counts the block done with an acquire-release atomic,
    // which publishes them to the block that completes the count and, in that block, makes every other block's
    // additions visible to what follows. The other consumers store dK_j, dV_j meanwhile; then the last block
    // converts the head's Nq x D values with its 256 consumer threads, from L2, where the reductions left them.
    __shared__ int last;
    if (issuer) {
        bulk_wait_all<0>();  // every reduction this block issued is complete (and none reads shared memory)
        if (p.done != nullptr) {
            fence_proxy_async_global();
            last = atomic_add_acq_rel_gpu(p.done + bh, 1) == (int)gridDim.x - 1;
        }
    }
    store_dk_dv<T, D, D>(dk, dv, p, bh, kr, 0, t);  // Alg.2 L16 (a block no query sees writes zeros)
    if (p.done == nullptr) return;
    named_bar_sync(BAR_LAST, 256);  // the issuer has counted: last is written
    if (last) {
        fence_acq_rel_gpu();  // the issuer's acquire, passed on by the barrier, made this thread's own
        const long head = (long)bh * Nq * D;
        convert_dq<16>(p.dq_acc + head, static_cast<T*>(p.dq) + head, 1.f, (long)Nq * D / 4, threadIdx.x - 128, 256);
    }
}
