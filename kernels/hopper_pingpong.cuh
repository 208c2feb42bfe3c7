// hopper_pingpong.cuh: the main loop of stage 06's ping-pong forward (FlashAttention-3, Shah et al., arXiv
// 2407.08608, Sec. 3.1 and 3.2), shared by the 16-bit kernels (flash_v3_forward_pingpong.cu; with the attention
// variants, flash_v3_forward_variants.cu) and the e4m3 one (flash_v3_forward_fp8.cu). A block holds a producer
// warpgroup and two consumer warpgroups; the scheduler (hopper_scheduler.cuh) gives it its work items (Q tile of 128
// rows, head); a tile's steps and the epilogue are in hopper_tiles.cuh. What the two kernels do differently comes in
// through a Kind (the kernel files define one each):
//   Kind::LIFT                       P's 2^LIFT (softmax_tile)
//   Kind::scale_log2(p, bh)          the factor of S in exp2's argument for head bh, as a callable
//   Kind::load_v(v, p, bar, key, bh) the producer's copies of V_j (BC keys from key on, of k / v head bh)
//   Kind::rescale(st, alpha)         O_i = diag(alpha) O_i
//   Kind::store(st, p, w, r0, g, t)  the epilogue: O_i, L_i of this warp's rows of work item w
// and the attention variants through stage 02's hooks (variants.cuh), as template arguments:
//   Sched   the work items (hopper_scheduler.cuh: TileScheduler; hopper_variants.cuh: VariantScheduler): heads, rows
//           and the band of K/V tiles j0 .. j0 + n_tiles - 1 the item visits (a window's tiles outside it skipped)
//   Mask    which keys a row sees: part_masked says whether a warpgroup's part of tile j needs the mask at all,
//           apply() sets S = -inf where a key is hidden, last_key(r) ends the ragged last tile (CausalMask: plain and
//           causal attention)
//   Score   what S becomes before the softmax (PlainScore: nothing, the scale sits in exp2's argument)
// Plain attention's hooks compute what the loop computed before they were hooks (and compile to the same code).
//
// The two overlaps that hide the softmax behind the GEMMs:
//   * ping-pong between the two consumer warpgroups: each issues its GEMMs of a tile only in its turn (named barrier
//     1 + its index) and passes the turn on as soon as they are issued, so warpgroup 1's GEMMs run while warpgroup 0
//     computes its softmax, and the other way round (stages/06_hopper/schedules.py: schedule_warpgroups "pingpong");
//   * inside a warpgroup, S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued together, so that the softmax of S_j may
//     run while O += P_{j-1} V_{j-1} is still on the tensor cores. P_{j-1}'s registers and O are the wgmma's until
//     wgmma.wait_group 0, so P_j stays in S's registers and the rescaling of O by alpha_j waits for that wait.
// K and V have stages of their own (full and empty barriers each): K_j is released as soon as S_j is computed, V_j
// one tile later, after O += P_j V_j. With a persistent grid the producer loads the next item's Q_i and K/V tiles
// while the consumers finish the last P V of this one and store O_i: Q_i has an empty barrier of its own for this,
// and the stage counters run on across items, so the phases of every barrier stay in step. With a block per item the
// consumers' item loop ends after one pass where the compiler sees it, so the counters are the constant 0 and the
// tile loop compiles as for a single item.
#pragma once
#include "hopper_scheduler.cuh"
#include "hopper_tiles.cuh"
#include "variants.cuh"

// The shared memory of one block: Q_i (two 64-row halves), then stage s: K_j, V_j of BC rows (e4m3: V_j^T, D rows of
// BC keys); the barriers: Q full, Q empty, then full_k[s], full_v[s], empty_k[s], empty_v[s].
template <typename T, int D, int BC, int STAGES>
struct PingpongSmem {
    enum : int { BARRIERS = 2 + 4 * STAGES, PANELS = D * Bytes<T>::value / 128 };  // PANELS: 128-byte panels a row
    enum : u32 { TILE = PANELS * 8192u, KV = PANELS * BC * 128u };  // bytes of a 64-row Q tile, a K or V tile
    enum { FULL_K, FULL_V, EMPTY_K, EMPTY_V };
    u32 q_s;    // Q_i, aligned to the swizzle's period
    u64* bars;

    __device__ PingpongSmem(unsigned char* raw, u64* barriers) : q_s(aligned_1024(raw)), bars(barriers) {}
    __device__ u32 k_tile(int s) const { return q_s + 2 * TILE + 2 * s * KV; }
    __device__ u32 v_tile(int s) const { return q_s + 2 * TILE + (2 * s + 1) * KV; }
    __device__ u32 bar(int kind, int s) const { return smem_addr(&bars[2 + kind * STAGES + s]); }
    __device__ u32 q_full() const { return smem_addr(&bars[0]); }
    __device__ u32 q_empty() const { return smem_addr(&bars[1]); }

    __device__ void init_barriers() const {  // thread 0, before the block's __syncthreads
        mbar_init(q_full(), 1);
        mbar_init(q_empty(), 8);  // persistent grid: one arrival per consumer warp after an item's last S = Q K^T
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar(FULL_K, s), 1);  // the producer's arrival, with the tile's bytes
            mbar_init(bar(FULL_V, s), 1);
            mbar_init(bar(EMPTY_K, s), 8);  // one arrival per consumer warp
            mbar_init(bar(EMPTY_V, s), 8);
        }
        mbar_fence_init();
    }
};

// Both sides count, over the block's items, the K/V tiles (it: stage it % STAGES, round it / STAGES) and the items
// with at least one tile (qn: the Q buffer's round); an item without tiles loads nothing and only stores.

// The producer warpgroup: per item Q_i, then K_j and V_j as their stages free up. One thread issues every copy, and
// no copy may still be in flight when the block exits: every copy issued is one the consumers wait for.
template <typename T, int D, int BC, int STAGES, typename Sched, typename Kind>
__device__ __forceinline__ void pingpong_producer(const HopperFwdParams& p, const PingpongSmem<T, D, BC, STAGES>& sm,
                                                  const Sched& sched) {
    using Smem = PingpongSmem<T, D, BC, STAGES>;
    setmaxnreg_dec<24>();
    if (threadIdx.x != 0) return;
    int it = 0, qn = 0;
    for (int item = sched.first(); item < sched.n_items; item += sched.stride) {
        const WorkItem work = sched.item(item);
        if (work.n_tiles == 0) continue;
        if (Sched::persistent)  // the consumers are done with the last item's Q (round 0: at once)
            mbar_wait(sm.q_empty(), (qn & 1) ^ 1);
        mbar_arrive_expect_tx(sm.q_full(), 2 * Smem::TILE);
        // Q_i, both halves of its 128 rows
        tma_load_rows<D, Bytes<T>::value>(sm.q_s, &p.map_q, sm.q_full(), work.q0 + work.row0, work.bh, 2);
        ++qn;
        for (int j = 0; j < work.n_tiles; ++j, ++it) {
            const int s = it % STAGES, free_parity = ((it / STAGES) & 1) ^ 1;  // round 0 passes at once
            const int key = work.k0 + BC * (work.j0 + j);  // K_j's first key in the maps
            mbar_wait(sm.bar(Smem::EMPTY_K, s), free_parity);
            mbar_arrive_expect_tx(sm.bar(Smem::FULL_K, s), Smem::KV);
            for (int c = 0; c < Smem::PANELS; ++c)  // boxes of BC rows x 128 bytes
                tma_load_3d(sm.k_tile(s) + c * BC * 128u, &p.map_k, sm.bar(Smem::FULL_K, s),
                            (128 / Bytes<T>::value) * c, key, work.bkv);
            mbar_wait(sm.bar(Smem::EMPTY_V, s), free_parity);
            mbar_arrive_expect_tx(sm.bar(Smem::FULL_V, s), Smem::KV);
            Kind::load_v(sm.v_tile(s), p, sm.bar(Smem::FULL_V, s), key, work.bkv);
        }
    }
}

// Consumer warpgroup c = wg - 1 (wg: 1 or 2): rows row0 + 64 c .. + 63 of each item, K/V tile after K/V tile
// (Alg.1 L6-10), then the epilogue (Kind::store). hp: the fields the Mask and Score hooks read (p itself for plain
// attention; the variants' FwdParams, hopper_variants.cuh).
template <typename T, int D, int BC, int STAGES, typename Sched, typename Kind, typename Mask, typename Score,
          typename HP>
__device__ __forceinline__ void pingpong_consumer(const HopperFwdParams& p, const HP& hp,
                                                  const PingpongSmem<T, D, BC, STAGES>& sm, const Sched& sched,
                                                  int wg) {
    using Smem = PingpongSmem<T, D, BC, STAGES>;
    constexpr int KS = KStep<T>::value;  // keys of P a K step of O += P V takes
    // RAGGED: a last K/V tile that holds keys for a warpgroup's rows in fewer than its BC / 64 blocks of 64 keys (Nk
    // not a multiple of BC, or the causal diagonal) takes only those blocks in the warpgroup's GEMMs and softmax
    // (hopper_tiles.cuh: with_width). At D = 128 only, where the wide tiles leave up to two of three blocks empty
    // (stages/06_hopper/README.md, version 3: the ragged last tile).
    constexpr bool RAGGED = D == 128;
    setmaxnreg_inc<240>();
    const int c = wg - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 q_mine = sm.q_s + c * Smem::TILE;
    auto release = [&](u32 barrier) {  // this warp's wgmmas on the tile have completed
        if (lane == 0) mbar_arrive(barrier);
    };
    auto my_turn = [&] { named_bar_sync(1 + c, 256); };     // wait until the other warpgroup has issued its GEMMs
    auto pass_turn = [&] { named_bar_arrive(2 - c, 256); };  // let it issue its own
    int it = 0, qn = 0;
    for (int item = sched.first(); item < sched.n_items; item += sched.stride) {
        const WorkItem work = sched.item(item);
        const int n_tiles = work.n_tiles, first = work.row0 + 64 * c, r0 = first + 16 * warp;
        const Mask mask(hp, work.Nq, work.Nk);              // the hooks (variants.cuh)
        const Score score(hp, work.hd, work.Nk - work.Nq);
        // The keys of the item's last tile that this warpgroup's rows see (at least 1). Under the causal mask
        // warpgroup 0's rows end 64 keys before warpgroup 1's: on the diagonal it takes half the tile's keys.
        const int last_key = mask.last_key(min(first + 63, work.Nq - 1));
        const int last_keys = max(1, last_key - BC * (work.j0 + n_tiles - 1) + 1);
        // Block-uniform per warpgroup: does tile j hold a key that one of its rows does not see?
        auto masked = [&](int j) {
            const int key0 = BC * (work.j0 + j);
            return mask.part_masked(first, first + 63, key0, key0 + BC - 1);
        };
        const auto scale_log2 = Kind::scale_log2(p, work.bh);
        RowState<D> st;  // Alg.1 L5
        st.init();
        float s[BC / 8][4], alpha[2];
        u32 pa[BC / KS][4];
        // The hooks on tile j's first W columns of S: the score first, then the mask where the tile needs it.
        auto hooks = [&](int j, auto width) {
            constexpr int W = decltype(width)::value;
            auto& s3 = reinterpret_cast<float(&)[1][W / 8][4]>(s);
            score.template apply<1, W>(s3, r0, BC * (work.j0 + j), g, t);
            if (masked(j)) mask.template apply<1, W>(s3, r0, BC * (work.j0 + j), g, t);
        };
        // Tile j's S_j = Q K_j^T and softmax on its first W columns (W = BC but for a ragged last tile): P_j in s,
        // its A fragments in pa. Tile 0 (O_i = 0: nothing to rescale); O += P_0 V_0 is issued with S_1.
        auto first_tile = [&](auto w) {
            constexpr int W = decltype(w)::value;
            mbar_wait(sm.bar(Smem::FULL_K, it % STAGES), (it / STAGES) & 1);
            my_turn();
            wgmma_fence();
            issue_qk<T, D, W, BC>(cols<W>(s), q_mine, sm.k_tile(it % STAGES));
            wgmma_commit();
            if (c == 0 || n_tiles > 1) pass_turn();  // the turns each warpgroup takes and is given balance out
            wgmma_wait<0>();
            fence_operands(reinterpret_cast<float(&)[W / 2]>(s));
            release(sm.bar(Smem::EMPTY_K, it % STAGES));
            if (Sched::persistent && n_tiles == 1) release(sm.q_empty());  // Q's last reader is done
            hooks(0, w);
            softmax_tile<W, D, Kind::LIFT>(st, cols<W>(s), scale_log2(), alpha);
            p_fragments<T, W>(cols<W, KS>(pa), cols<W>(s));
        };
        // Tile j >= 1 (Alg.1 L6), one tile behind for P V: S_j with O += P_{j-1} V_{j-1} (a whole tile of BC keys).
        auto next_tile = [&](int j, auto w) {
            constexpr int W = decltype(w)::value;
            const int sk = (it + j) % STAGES, sv = (it + j - 1) % STAGES;
            mbar_wait(sm.bar(Smem::FULL_K, sk), ((it + j) / STAGES) & 1);
            mbar_wait(sm.bar(Smem::FULL_V, sv), ((it + j - 1) / STAGES) & 1);
            my_turn();
            wgmma_fence();
            issue_qk<T, D, W, BC>(cols<W>(s), q_mine, sm.k_tile(sk));  // S_j = Q K_j^T
            wgmma_commit();
            issue_pv<T, D, BC>(st, pa, sm.v_tile(sv));  // O += P_{j-1} V_{j-1}
            wgmma_commit();
            if (c == 0 || j < n_tiles - 1) pass_turn();
            wgmma_wait<1>();  // S_j is ready; O += P_{j-1} V_{j-1} may still run
            fence_operands(reinterpret_cast<float(&)[W / 2]>(s));
            release(sm.bar(Smem::EMPTY_K, sk));
            if (Sched::persistent && j == n_tiles - 1) release(sm.q_empty());
            hooks(j, w);
            softmax_tile<W, D, Kind::LIFT>(st, cols<W>(s), scale_log2(), alpha);
            wgmma_wait<0>();  // O and P_{j-1}'s registers are ours again
            fence_operands(reinterpret_cast<float(&)[D / 2]>(st.o));
            release(sm.bar(Smem::EMPTY_V, sv));
            Kind::rescale(st, alpha);
            p_fragments<T, W>(cols<W, KS>(pa), cols<W>(s));
        };
        // O += P_{last} V_{last} on the last tile's W keys.
        auto last_pv = [&](auto w) {
            constexpr int W = decltype(w)::value;
            const int sv = (it + n_tiles - 1) % STAGES;
            mbar_wait(sm.bar(Smem::FULL_V, sv), ((it + n_tiles - 1) / STAGES) & 1);
            wgmma_fence();
            issue_pv<T, D, W, BC>(st, cols<W, KS>(pa), sm.v_tile(sv));
            wgmma_commit();
            wgmma_wait<0>();
            fence_operands(reinterpret_cast<float(&)[D / 2]>(st.o));
            release(sm.bar(Smem::EMPTY_V, sv));
        };
        if (n_tiles > 0) {
            if (c == 1) pass_turn();  // warpgroup 0 issues first
            mbar_wait(sm.q_full(), qn & 1);
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
        Kind::store(st, p, work, r0, g, t);  // Alg.1 L12-14
        if constexpr (!Sched::persistent) break;  // one block per item: a single pass
    }
}

// The 16-bit kernels' part of the main loop (flash_v3_forward_pingpong.cu, flash_v3_forward_variants.cu): S scaled
// by the softmax scale (or, with a Score hook that applies it, by log2 e), O rescaled by alpha on every tile, V_j
// loaded in panels of 64 columns (BC rows x 128 bytes each), O_i stored in type O and L_i (or both merged into the
// running float32 O, L: a ring block).
template <typename O, int D, int BC>
struct Sixteen {
    enum : int { LIFT = 0 };
    __device__ static auto scale_log2(const HopperFwdParams& p, int) {
        return [&p] { return p.scale_log2; };
    }
    __device__ static void load_v(u32 v_s, const HopperFwdParams& p, u32 bar, int key, int bh) {
        for (int c = 0; c < D / 64; ++c) tma_load_3d(v_s + c * BC * 128u, &p.map_v, bar, 64 * c, key, bh);
    }
    __device__ static void rescale(RowState<D>& st, const float (&alpha)[2]) { rescale_o(st, alpha); }
    __device__ static void store(RowState<D>& st, const HopperFwdParams& p, const WorkItem& w, int r0, int g, int t) {
        store_rows<O, D>(st, p, w.bh, w.q0, w.Nq, r0, g, t);
    }
};
