// flash_v3_forward_pingpong.cu: stage 06 version 3 "pingpong": version 2 ("ws") with FlashAttention-3's two
// overlaps (Shah et al., arXiv 2407.08608, Sec. 3.1 and 3.2). In version 2 a consumer warpgroup alternates between
// the tensor cores (S = Q K^T, O += P V) and the multi-function units (exp2 of the softmax), and each waits for the
// other. Two schedules hide the softmax behind the GEMMs:
//   * ping-pong between the two consumer warpgroups: each issues its GEMMs of a tile only in its turn (named barrier
//     1 + its index) and passes the turn on as soon as they are issued, so warpgroup 1's GEMMs run while warpgroup 0
//     computes its softmax, and the other way round (stages/06_hopper/schedules.py: schedule_warpgroups "pingpong");
//   * inside a warpgroup, the GEMMs of two tiles overlap its softmax: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are
//     issued together, the softmax of S_j runs while O += P_{j-1} V_{j-1} is still on the tensor cores. P_{j-1}'s
//     registers and O are the wgmma's until wgmma.wait_group 0, so P_j stays in S's registers and the rescaling of O by
//     alpha_j waits for that wait. In the SASS, ptxas places that wait where the branch of the masked(j) test
//     rejoins, before the softmax: only the ping-pong overlaps it (stages/06_hopper/README.md, version 3).
// K and V have stages of their own (full and empty barriers each): K_j is released as soon as S_j is computed, V_j
// one tile later, after O += P_j V_j. The heaviest Q tiles under the causal mask start first.
// A block computes one or more work items (Q tile, head). PERSISTENT = false: one block per item, balanced by the
// GPU's block scheduler; the consumers' item loop ends after one pass where the compiler sees it, so their stage
// counters are the constant 0 and the tile loop compiles as for a single item. PERSISTENT = true: one block per SM
// strides over the items, and its producer loads the next item's Q_i and K/V tiles while the consumers finish the
// last P V of this one and store O_i: the once-per-item work overlaps the next item's loads instead of leaving the
// SM's tensor cores idle between blocks. Q_i has an empty barrier of its own for this, and the stage counters run on
// across items, so the phases of every barrier stay in step. The launcher picks (stages/06_hopper/flash_v3.py:
// persistent_rule): persistent where every item is the same work (no mask) and short (few K/V tiles), so that the
// once-per-item work is a large share of it. BC: keys a K/V tile, 128 (64 at D = 256); on long items without a mask
// at D = 128, 192 (wide_rule): each tile's fixed work (barriers, the turn, row maxima, rescaling O) spread over more
// keys. At D = 128 a warpgroup's last tile is computed only on its 64-key blocks that hold keys for its rows
// (RAGGED).
// With T = E4M3 the same kernel is version fp8 (stages/06_hopper/fp8.py): Q', K' and V'^T in e4m3 from a pre-pass
// (flash_v3_fp8_quantize.cu), the 8-bit wgmma, P lifted by 2^8 and packed lane by lane, O written in type O.
// Tile steps and epilogue: hopper_tiles.cuh. Checked by tests/test_06_hopper_gpu.py.
#include "hopper_tiles.cuh"

template <typename T, int D, int BC, int STAGES, bool PERSISTENT, typename O = T>
__global__ void __launch_bounds__(384, 1) flash_v3_forward_pingpong(const __grid_constant__ HopperFwdParams p) {
    // T = E4M3 (version fp8): Q, K and V^T in e4m3 with per-head factors amax / 448 (p.amax), O in type O; D = 128,
    // BC = 128. The tiles are the same bytes: a 128-byte line holds 128 values of a row of Q or K, or 128 keys of a row
    // of V^T.
    constexpr bool FP8 = Bytes<T>::value == 1;
    static_assert(!FP8 || (D == 128 && BC == 128 && !PERSISTENT), "version fp8: D = 128, tiles of 128 keys");
    constexpr int PANELS = D * Bytes<T>::value / 128;  // 128-byte panels of a row of Q or K
    constexpr int KS = KStep<T>::value;                // keys of P a K step of O += P V takes
    constexpr int LIFT = FP8 ? 8 : 0;                  // P's 2^LIFT (softmax_tile)
    constexpr u32 TILE = PANELS * 8192u;    // bytes of one 64-row Q tile
    constexpr u32 KV = PANELS * BC * 128u;  // bytes of one K or V tile of BC rows (FP8: V^T, D rows of BC keys)
    // RAGGED: a last K/V tile that holds keys for a warpgroup's rows in fewer than its BC / 64 blocks of 64 keys (Nk
    // not a multiple of BC, or the causal diagonal) takes only those blocks in the warpgroup's GEMMs and softmax
    // (hopper_tiles.cuh: with_width).
    // At D = 128, where the wide tiles leave up to two of three blocks empty. At D = 64 (BC = 128) a tile has two
    // blocks, at most one of them empty, and the GEMMs an empty block would skip are half as long as at D = 128:
    // less than a branch on the width in every tile of the loop costs, so the kernel keeps its single tail. At
    // D = 256 (BC = 64) no tile has an empty block.
    constexpr bool RAGGED = D == 128;
    enum { FULL_K, FULL_V, EMPTY_K, EMPTY_V };
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ __align__(8) u64 bars[2 + 4 * STAGES];  // Q full, Q empty; then full_k[s], full_v[s], empty_k[s], ..
    const u32 q_s = aligned_1024(smem_raw);             // Q (two 64-row halves), then stage s: K_j, V_j
    auto k_tile = [&](int s) { return q_s + 2 * TILE + 2 * s * KV; };
    auto v_tile = [&](int s) { return q_s + 2 * TILE + (2 * s + 1) * KV; };
    auto bar = [&](int kind, int s) { return smem_addr(&bars[2 + kind * STAGES + s]); };
    const u32 q_full = smem_addr(&bars[0]), q_empty = smem_addr(&bars[1]);
    const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
    const int Nq = p.Nq, Nk = p.Nk, shift = Nk - Nq, n_rows = (Nq + 127) / 128;
    // Work items: (Q tile of 128 rows, head), item = head * n_rows + rank; under the causal mask rank 0 is a head's
    // last (heaviest) tile. A grid of one block per item runs each once; a persistent grid (a block per SM) strides
    // over them, and its producer loads the next item's Q and K/V while the consumers finish and store this one.
    const int n_items = n_rows * p.heads, stride = gridDim.x * gridDim.y;
    auto item_tiles = [&](int item, int& bh, int& row0) {  // the item's head, first row and K/V tiles. Head-major:
        // the blocks in flight share their heads' K and V in L2. One block per item: the grid is (n_rows, heads), so
        // blockIdx gives both without a division.
        const int rank = PERSISTENT ? item % n_rows : blockIdx.x;
        bh = PERSISTENT ? item / n_rows : blockIdx.y;
        row0 = 128 * (p.causal ? n_rows - 1 - rank : rank);
        const int last_row = min(row0 + 127, Nq - 1);
        const int last_key = p.causal ? min(Nk - 1, last_row + shift) : Nk - 1;
        return last_key < 0 ? 0 : last_key / BC + 1;
    };

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        mbar_init(q_empty, 8);  // persistent grid: one arrival per consumer warp after an item's last S = Q K^T
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar(FULL_K, s), 1);  // the producer's arrival, with the tile's bytes
            mbar_init(bar(FULL_V, s), 1);
            mbar_init(bar(EMPTY_K, s), 8);  // one arrival per consumer warp
            mbar_init(bar(EMPTY_V, s), 8);
        }
        mbar_fence_init();
    }
    __syncthreads();

    // Both sides count, over the block's items, the K/V tiles (it: stage it % STAGES, round it / STAGES) and the items
    // with at least one tile (qn: the Q buffer's round); an item without tiles loads nothing and only stores.
    if (wg == 0) {  // ---------------- producer: per item Q, then K_j and V_j as their stages free up
        setmaxnreg_dec<24>();
        if (threadIdx.x == 0) {  // no copy may still be in flight when the block exits: every copy issued is one
            // the consumers wait for
            int it = 0, qn = 0;
            for (int item = blockIdx.y * gridDim.x + blockIdx.x; item < n_items; item += stride) {
                int bh, row0;
                const int n_tiles = item_tiles(item, bh, row0);
                if (n_tiles == 0) continue;
                if (PERSISTENT)  // the consumers are done with the last item's Q (round 0: at once)
                    mbar_wait(q_empty, (qn & 1) ^ 1);
                mbar_arrive_expect_tx(q_full, 2 * TILE);
                tma_load_rows<D, Bytes<T>::value>(q_s, &p.map_q, q_full, row0, bh, 2);  // both 64-row halves
                ++qn;
                for (int j = 0; j < n_tiles; ++j, ++it) {
                    const int s = it % STAGES, free_parity = ((it / STAGES) & 1) ^ 1;  // round 0 passes at once
                    mbar_wait(bar(EMPTY_K, s), free_parity);
                    mbar_arrive_expect_tx(bar(FULL_K, s), KV);
                    for (int c = 0; c < PANELS; ++c)
                        tma_load_3d(k_tile(s) + c * BC * 128u, &p.map_k, bar(FULL_K, s), (128 / Bytes<T>::value) * c,
                                    BC * j, bh);
                    mbar_wait(bar(EMPTY_V, s), free_parity);
                    mbar_arrive_expect_tx(bar(FULL_V, s), KV);
                    if constexpr (FP8)  // V_j^T: keys BC j .. of each of the D rows, 64 rows a box
                        for (int r = 0; r < D / 64; ++r)
                            tma_load_3d(v_tile(s) + r * 64 * 128u, &p.map_v, bar(FULL_V, s), BC * j, 64 * r, bh);
                    else
                        for (int c = 0; c < D / 64; ++c)
                            tma_load_3d(v_tile(s) + c * BC * 128u, &p.map_v, bar(FULL_V, s), 64 * c, BC * j, bh);
                }
            }
        }
        return;
    }
    // ---------------- consumers: warpgroup c = wg - 1 owns rows row0 + 64 c .. + 63 of each item
    setmaxnreg_inc<240>();
    const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 q_mine = q_s + c * TILE;
    auto release = [&](u32 barrier) {  // this warp's wgmmas on the tile have completed
        if (lane == 0) mbar_arrive(barrier);
    };
    auto my_turn = [&] { named_bar_sync(1 + c, 256); };     // wait until the other warpgroup has issued its GEMMs
    auto pass_turn = [&] { named_bar_arrive(2 - c, 256); };  // let it issue its own
    int it = 0, qn = 0;
    for (int item = blockIdx.y * gridDim.x + blockIdx.x; item < n_items; item += stride) {
        int bh, row0;
        const int n_tiles = item_tiles(item, bh, row0);
        const int first = row0 + 64 * c, r0 = first + 16 * warp;
        // The keys of the item's last tile that this warpgroup's rows see (at least 1). Under the causal mask
        // warpgroup 0's rows end 64 keys before warpgroup 1's: on the diagonal it takes half the tile's keys.
        const int last_keys = max(1, (p.causal ? min(Nk - 1, min(first + 63, Nq - 1) + shift) : Nk - 1) -
                                         BC * (n_tiles - 1) + 1);
        auto masked = [&](int j) { return (j + 1) * BC > Nk || (p.causal && (j + 1) * BC - 1 > first + shift); };

        float fp8_scale_log2 = 0.f;  // S = (Q' f_q)(K' f_k)^T for Q', K' in e4m3, f = amax / 448
        if constexpr (FP8) fp8_scale_log2 = p.scale_log2 * (p.amax[3 * bh] / 448.f) * (p.amax[3 * bh + 1] / 448.f);
        auto scale_log2 = [&] {
            if constexpr (FP8)
                return fp8_scale_log2;
            else
                return p.scale_log2;
        };
        RowState<D> st;  // Alg.1 L5
        st.init();
        float s[BC / 8][4], alpha[2];
        u32 pa[BC / KS][4];
        // Tile j's S_j = Q K_j^T and softmax on its first W columns (W = BC but for a ragged last tile): P_j in s,
        // its A fragments in pa. Tile 0 (O_i = 0: nothing to rescale); O += P_0 V_0 is issued with S_1.
        auto first_tile = [&](auto w) {
            constexpr int W = decltype(w)::value;
            mbar_wait(bar(FULL_K, it % STAGES), (it / STAGES) & 1);
            my_turn();
            wgmma_fence();
            issue_qk<T, D, W, BC>(cols<W>(s), q_mine, k_tile(it % STAGES));
            wgmma_commit();
            if (c == 0 || n_tiles > 1) pass_turn();  // the turns each warpgroup takes and is given balance out
            wgmma_wait<0>();
            fence_operands(reinterpret_cast<float(&)[W / 2]>(s));
            release(bar(EMPTY_K, it % STAGES));
            if (PERSISTENT && n_tiles == 1) release(q_empty);  // Q's last reader is done
            if (masked(0))
                mask_scores<1, W>(reinterpret_cast<float(&)[1][W / 8][4]>(s), r0, 0, Nk, p.causal, shift, g, t);
            softmax_tile<W, D, LIFT>(st, cols<W>(s), scale_log2(), alpha);
            p_fragments<T, W>(cols<W, KS>(pa), cols<W>(s));
        };
        // Tile j >= 1 (Alg.1 L6), one tile behind for P V: S_j with O += P_{j-1} V_{j-1} (a whole tile of BC keys).
        auto next_tile = [&](int j, auto w) {
            constexpr int W = decltype(w)::value;
            const int sk = (it + j) % STAGES, sv = (it + j - 1) % STAGES;
            mbar_wait(bar(FULL_K, sk), ((it + j) / STAGES) & 1);
            mbar_wait(bar(FULL_V, sv), ((it + j - 1) / STAGES) & 1);
            my_turn();
            wgmma_fence();
            issue_qk<T, D, W, BC>(cols<W>(s), q_mine, k_tile(sk));  // S_j = Q K_j^T
            wgmma_commit();
            issue_pv<T, D, BC>(st, pa, v_tile(sv));  // O += P_{j-1} V_{j-1}
            wgmma_commit();
            if (c == 0 || j < n_tiles - 1) pass_turn();
            wgmma_wait<1>();  // S_j is ready; O += P_{j-1} V_{j-1} may still run
            fence_operands(reinterpret_cast<float(&)[W / 2]>(s));
            release(bar(EMPTY_K, sk));
            if (PERSISTENT && j == n_tiles - 1) release(q_empty);
            if (masked(j))
                mask_scores<1, W>(reinterpret_cast<float(&)[1][W / 8][4]>(s), r0, BC * j, Nk, p.causal, shift, g, t);
            softmax_tile<W, D, LIFT>(st, cols<W>(s), scale_log2(), alpha);
            wgmma_wait<0>();  // O and P_{j-1}'s registers are ours again
            fence_operands(reinterpret_cast<float(&)[D / 2]>(st.o));
            release(bar(EMPTY_V, sv));
            // FP8: alpha = 1 exactly where a row's max did not change (exp2(0)); a warp none of whose 16 rows
            // changed skips the D / 2 multiplies by 1 (the same bits, fewer instructions; stage 02's SKIP). In 8 bits
            // the softmax step bounds the kernel; in 16 bits it hides behind the other warpgroup's GEMMs.
            if (!FP8 || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale_o(st, alpha);
            p_fragments<T, W>(cols<W, KS>(pa), cols<W>(s));
        };
        // O += P_{last} V_{last} on the last tile's W keys.
        auto last_pv = [&](auto w) {
            constexpr int W = decltype(w)::value;
            const int sv = (it + n_tiles - 1) % STAGES;
            mbar_wait(bar(FULL_V, sv), ((it + n_tiles - 1) / STAGES) & 1);
            wgmma_fence();
            issue_pv<T, D, W, BC>(st, cols<W, KS>(pa), v_tile(sv));
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(reinterpret_cast<float(&)[D / 2]>(st.o));
            release(bar(EMPTY_V, sv));
        };
        if (n_tiles > 0) {
            if (c == 1) pass_turn();  // warpgroup 0 issues first
            mbar_wait(q_full, qn & 1);
            ++qn;
            // Every tile but the last is BC keys wide. At D = 128 (RAGGED) a last tile with a 64-key block that
            // holds no key for this warpgroup's rows takes the blocks that do; the tile loop is the same either way.
            const bool ragged = RAGGED && last_keys <= BC - 64;
            if (ragged && n_tiles == 1) {
                if constexpr (RAGGED)
                    with_width<BC - 64>(last_keys, [&](auto w) {
                        first_tile(w);
                        last_pv(w);
                    });
            } else {
                first_tile(Cols<BC>());
                for (int j = 1; j < n_tiles - ragged; ++j) next_tile(j, Cols<BC>());
                if (!ragged)
                    last_pv(Cols<BC>());
                else if constexpr (RAGGED)
                    with_width<BC - 64>(last_keys, [&](auto w) {
                        next_tile(n_tiles - 1, w);
                        last_pv(w);
                    });
            }
            it += n_tiles;
        }
        if constexpr (FP8)  // O = P (V' f_v) for V' in e4m3
            store_rows<O, D>(st, p, bh, r0, g, t, p.amax[3 * bh + 2] / 448.f, LIFT);
        else
            store_rows<O, D>(st, p, bh, r0, g, t);
        if constexpr (!PERSISTENT) break;  // one block per item: a single pass
    }
}
