// hopper_bwd_ws.cuh: the main loop of stage 06's backward version ws (FlashAttention-3, Shah et al., arXiv 2407.08608,
// Sec. 3.3; what it changes from version wgmma, and why: flash_v3_backward_ws.cu), shared by the plain kernel
// (flash_v3_backward_ws.cu) and the variants' (flash_v3_backward_variants.cu). A block owns a K/V tile of 128 keys:
// a producer warpgroup loads K_j, V_j once and then Q_i, dO_i, L_i, D_i tile after tile into STAGES stages; consumer
// warpgroup me (0 or 1) owns keys 64 me .. 64 me + 63 of the tile, keeps their dK_j, dV_j in its registers and hands
// each Q tile's dQ_i to the copy engine (bulk reductions). The variants enter through hooks, template arguments:
//   Block   which keys the block owns and which Q tiles it walks: PlainBlock (below) walks the Q tiles of its own
//           head that see its keys; KeyBlock (hopper_variants.cuh) walks those of every query head of its k / v
//           head's group, one head after the other, so that dK_j, dV_j are summed over the group in the registers
//           (no atomics, no pass of their own), and under a window only the Q tiles with a row that sees one of its
//           keys
//   Mask    stage 02's mask hook (variants.cuh): part_masked says whether a (Q tile x 64 keys) part needs the mask,
//           hidden(row, key) whether a query does not see a key
//   Score   PlainScore: P^T while dP^T is still on the tensor cores (probabilities_t); ModScore (softcap, ALiBi):
//           the capped scores then (capped_scores_t), P^T and dS^T once dP^T is done (probabilities_ds_t)
#pragma once
#include "hopper_bwd_tiles.cuh"

// The shared memory of one block: K_j (two 64-key tiles), V_j (two), dS^T (BR / 64 panels of 128 keys x 64 queries,
// 16 KB each), dQ_i (BR x D fp32 in four boxes of 64 rows x 32 columns, swizzled as the map_dq box; boxes 2 me,
// 2 me + 1 are consumer me's part), then stage s: Q_i, dO_i; after the stages, stage s's L_i and D_i (BR floats
// each). Barriers: K and V; full[s]; empty[s].
template <int D, int STAGES, int BR>
struct WsSmem {
    enum : int { PANELS = D / 64 };
    enum : u32 { TILE = PANELS * 8192u, QT = BR * D * 2u };  // bytes of 64 rows of K_j or V_j; of a Q_i or dO_i tile
    u32 k_s, v_s, ds_s, dq_s, q_s, ld_s;
    u64* bars;
    unsigned char* raw;

    __device__ WsSmem(unsigned char* smem_raw, u64* barriers) : bars(barriers), raw(smem_raw) {
        k_s = aligned_1024(smem_raw), v_s = k_s + 2 * TILE, ds_s = v_s + 2 * TILE, dq_s = ds_s + 256u * BR;
        q_s = dq_s + BR * D * 4u, ld_s = q_s + STAGES * 2 * QT;
    }
    __device__ u32 kv() const { return smem_addr(&bars[0]); }
    __device__ u32 full(int s) const { return smem_addr(&bars[1 + s]); }
    __device__ u32 empty(int s) const { return smem_addr(&bars[1 + STAGES + s]); }
    __device__ float* floats(u32 addr) const { return reinterpret_cast<float*>(raw + (addr - smem_addr(raw))); }
    __device__ float* ls(int s) const { return floats(ld_s + 8 * BR * s); }           // L_i of stage s
    __device__ float* ds(int s) const { return floats(ld_s + 8 * BR * s + 4 * BR); }  // D_i of stage s

    __device__ void init_barriers() const {  // thread 0, before the block's __syncthreads
        mbar_init(kv(), 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full(s), 1);   // the producer's arrival, with the stage's bytes
            mbar_init(empty(s), 8);  // one arrival per consumer warp
        }
        mbar_fence_init();
    }
};

// Plain attention's Block: a block per (K/V tile of 128 keys, head) of a (B H, N, D) problem; its Q tiles are those
// with a row that sees one of its keys (the causal mask: from the first row whose diagonal reaches key0 on).
template <int BR>
struct PlainBlock {
    const HopperBwdParams& p;
    int bh, key0, Nq, Nk, i0, n_tiles;

    __device__ explicit PlainBlock(const HopperBwdParams& params)
        : p(params), bh(blockIdx.y), key0(128 * blockIdx.x), Nq(p.Nq), Nk(p.Nk) {
        const int first_row = p.causal ? max(0, key0 - (Nk - Nq)) : 0;  // the first query row that sees a key of K_j
        i0 = first_row / BR;
        n_tiles = first_row >= Nq ? 0 : (Nq + BR - 1) / BR - i0;  // Q tiles i0 .. i0 + n_tiles - 1
    }
    __device__ static constexpr int group() { return 1; }  // query heads walked
    __device__ int q_head(int) const { return bh; }          // the maps' head coordinate of q, dO, dQ; ALiBi's
    __device__ int kv_head() const { return bh; }
    __device__ static constexpr int q0() { return 0; }       // the first query row and key in the maps
    __device__ static constexpr int k0() { return 0; }
    __device__ int counter() const { return bh; }            // the block counter of the fused dQ conversion
    // L_i and D_i of rows row0 .. row0 + BR - 1 of query head bq into dst, dst + 4 BR, counted on bar: bulk copies
    // of 4 BR bytes (the rows of a head start at a multiple of Nq_pad, a multiple of 128: aligned to 16 bytes).
    __device__ void load_l_d(u32 dst, u32 bar, int row0, int bq) const {
        const long tile_rows = (long)bq * p.Nq_pad + row0;
        bulk_load(dst, p.lse + tile_rows, 4 * BR, bar);
        bulk_load(dst + 4 * BR, p.delta + tile_rows, 4 * BR, bar);
    }
};

// The producer warpgroup: K_j and V_j once, then Q_i, dO_i, L_i, D_i of each Q tile of each query head the block
// walks, as stages free up. One thread issues every copy, and none that the consumers would not wait for.
template <typename T, int D, int STAGES, int BR, typename Block>
__device__ __forceinline__ void ws_producer(const HopperBwdParams& p, const WsSmem<D, STAGES, BR>& sm,
                                            const Block& blk) {
    using Smem = WsSmem<D, STAGES, BR>;
    setmaxnreg_dec<24>();
    if (threadIdx.x != 0 || blk.n_tiles == 0) return;
    mbar_arrive_expect_tx(sm.kv(), 4 * Smem::TILE);
    for (int half = 0; half < 2; ++half)
        for (int c = 0; c < Smem::PANELS; ++c) {
            const int key = blk.k0() + blk.key0 + 64 * half;
            tma_load_3d(sm.k_s + half * Smem::TILE + c * 8192u, &p.map_k, sm.kv(), 64 * c, key, blk.kv_head());
            tma_load_3d(sm.v_s + half * Smem::TILE + c * 8192u, &p.map_v, sm.kv(), 64 * c, key, blk.kv_head());
        }
    int n = 0;  // the block's Q tiles over all its query heads: stage n % STAGES, round n / STAGES
    for (int qh = 0; qh < blk.group(); ++qh)
        for (int i = 0; i < blk.n_tiles; ++i, ++n) {
            const int s = n % STAGES, row0 = BR * (blk.i0 + i), bq = blk.q_head(qh);
            const u32 dst = sm.q_s + 2 * s * Smem::QT;
            mbar_wait(sm.empty(s), ((n / STAGES) & 1) ^ 1);  // round 0 passes at once: the stages start empty
            mbar_arrive_expect_tx(sm.full(s), 2 * Smem::QT + 8 * BR);
            blk.load_l_d(sm.ld_s + 8 * BR * s, sm.full(s), row0, bq);
            for (int r = 0; r < BR / 64; ++r)  // boxes of 64 rows x 64 columns: row block r of panel c
                for (int c = 0; c < Smem::PANELS; ++c) {
                    const int row = blk.q0() + row0 + 64 * r;
                    tma_load_3d(dst + c * (BR * 128u) + r * 8192u, &p.map_q, sm.full(s), 64 * c, row, bq);
                    tma_load_3d(dst + Smem::QT + c * (BR * 128u) + r * 8192u, &p.map_do, sm.full(s), 64 * c, row, bq);
                }
        }
}

// Alg.2 L16: dK_j, dV_j of the block's k / v head (a block no query sees writes zeros); L21: dQ = dq_acc in the input
// type, by the last of the gridDim.x blocks of the same counter to finish (p.done not null): the query heads the
// block walked, their rows of the sequence. The issuer is the one thread whose copies added to dq_acc: once they are
// complete it fences them (from the copy engine's proxy into ordinary memory order) and counts the block done with an
// acquire-release atomic, which publishes them to the block that completes the count and, in that block, makes every
// other block's additions visible to what follows. The other consumers store dK_j, dV_j meanwhile; then the last
// block converts with its 256 consumer threads, from L2, where the reductions left the values.
template <typename T, int D, typename Block, int PANELS>
__device__ __forceinline__ void ws_epilogue(const HopperBwdParams& p, const Block& blk,
                                            const float (&dk)[PANELS][8][4], const float (&dv)[PANELS][8][4], int kr,
                                            int t, bool issuer, int bar_last) {
    __shared__ int last;
    if (issuer) {
        bulk_wait_all<0>();  // every reduction this block issued is complete (and none reads shared memory)
        if (p.done != nullptr) {
            fence_proxy_async_global();
            last = atomic_add_acq_rel_gpu(p.done + blk.counter(), 1) == (int)gridDim.x - 1;
        }
    }
    store_dk_dv<T, D, D>(dk, dv, p, blk.kv_head(), blk.k0(), blk.Nk, kr, 0, t);
    if (p.done == nullptr) return;
    named_bar_sync(bar_last, 256);  // the issuer has counted: last is written
    if (last) {
        fence_acq_rel_gpu();  // the issuer's acquire, passed on by the barrier, made this thread's own
        for (int qh = 0; qh < blk.group(); ++qh) {
            const long head = ((long)blk.q_head(qh) * p.Nq + blk.q0()) * D;  // p.Nq: rows of a head of dq_acc
            convert_dq<16>(p.dq_acc + head, static_cast<T*>(p.dq) + head, 1.f, (long)blk.Nq * D / 4,
                           threadIdx.x - 128, 256);
        }
    }
}

// Consumer warpgroup me = wg - 1: keys key0 + 64 me .. + 63 of the block (Alg.2 L6-16). hp: the fields the Mask and
// Score hooks read (p itself for plain attention; the variants' FwdParams, hopper_variants.cuh).
template <typename T, int D, int STAGES, int BR, typename Block, typename Mask, typename Score, typename HP>
__device__ __forceinline__ void ws_consumer(const HopperBwdParams& p, const HP& hp, const WsSmem<D, STAGES, BR>& sm,
                                            const Block& blk, int wg) {
    using Smem = WsSmem<D, STAGES, BR>;
    enum { BAR_DS = 1, BAR_DQ = 3, BAR_LAST = 4 };  // named barriers of both consumers (256 threads)
    setmaxnreg_inc<240>();
    const int me = wg - 1;  // consumer index
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int kfirst = blk.key0 + 64 * me, kr = kfirst + 16 * warp + g;  // this warpgroup's keys; this lane's
    const u32 k_mine = sm.k_s + me * Smem::TILE, v_mine = sm.v_s + me * Smem::TILE, dq_mine = sm.dq_s + me * 2 * 8192u;
    const bool issuer = threadIdx.x == 128;  // who talks to the copy engine
    const Mask mask(hp, blk.Nq, blk.Nk);     // the hooks (variants.cuh)
    float dk[Smem::PANELS][8][4], dv[Smem::PANELS][8][4];  // Alg.2 L5
#pragma unroll
    for (int c = 0; c < Smem::PANELS; ++c) zero(dk[c]), zero(dv[c]);
    if (blk.n_tiles > 0) mbar_wait(sm.kv(), 0);

    int n = 0;  // as the producer counts
    for (int qh = 0; qh < blk.group(); ++qh) {  // the query heads of the group (plain attention: its own)
        const int bq = blk.q_head(qh);
        const Score score(hp, bq, blk.Nk - blk.Nq);
        for (int i = 0; i < blk.n_tiles; ++i, ++n) {  // Alg.2 L6
            const int s = n % STAGES, row0 = BR * (blk.i0 + i);
            const u32 qn_s = sm.q_s + 2 * s * Smem::QT, do_s = qn_s + Smem::QT;
            mbar_wait(sm.full(s), (n / STAGES) & 1);
            float st[BR / 8][4], dp[BR / 8][4];  // S^T, dP^T of this warpgroup's keys
            issue_s_dp<T, D, BR>(st, dp, k_mine, v_mine, qn_s, do_s);
            // block-uniform per warpgroup: does the part hold a (query, key) the mask hides?
            const bool masked = mask.part_masked(row0, row0 + BR - 1, kfirst, kfirst + 63);
            if constexpr (ScoreHook<Score>::MODIFIES) {  // the variants' scores while dP^T is on the tensor cores,
                wgmma_wait<1>();                          // then P^T and dS^T
                fence_operands(reinterpret_cast<float(&)[BR / 2]>(st));
                if (score.softcap > 0.f) capped_scores_t(st, score);
                wgmma_wait<0>();
                fence_operands(reinterpret_cast<float(&)[BR / 2]>(dp));
                probabilities_ds_t(st, dp, score, sm.ls(s), sm.ds(s), kr, row0, t, mask);
            } else {  // P^T while dP^T is still on the tensor cores
                wgmma_wait<1>();
                fence_operands(reinterpret_cast<float(&)[BR / 2]>(st));
                probabilities_t(st, p.scale, sm.ls(s), kr, row0, masked, t, mask);
                wgmma_wait<0>();
                fence_operands(reinterpret_cast<float(&)[BR / 2]>(dp));
                ds_t(dp, st, sm.ds(s), t);
            }
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
                store_ds_t(sm.ds_s + c * 16384u + me * 8192u, reinterpret_cast<const u32(&)[4][4]>(da[4 * c]), warp,
                           g, t);
            if (issuer) bulk_wait_read<0>();  // the last tile's dQ_i has left shared memory
            named_bar_sync(BAR_DS, 256);      // both halves of dS^T are written; the dQ buffer is free
            // Alg.2 L13: dQ_i += dS_i K_j. A = dS (queries x keys) as dS^T lies (MN-major: panel me at D = 64, where
            // this consumer's rows are queries 64 me..), B = K_j (MN-major: columns 64 me.. at D = 128); 16 keys
            // further is 2048 bytes, 64 keys further the next tile
            float dq[8][4];
            const int qr = 16 * warp + g;  // this lane's rows of dQ_i: qr, qr + 8 (the same row % 8)
            // columns 8 nb + 2 t, + 1 of this consumer's buffer: panel nb / 4, 16-byte chunk (2 (nb % 4) + t / 2) ^
            // (row % 8), byte 8 (t % 2); 8 rows further is 1024 bytes
            auto dq_at = [&](int nb) {
                return sm.floats(dq_mine + (nb / 4) * 8192u + qr * 128u + (((2 * (nb % 4) + t / 2) ^ (qr % 8)) << 4) +
                                 8 * (t % 2));
            };
            const u64 ad = desc_mnmajor_128b(sm.ds_s + (BR == 128 ? me * 16384u : 0u), 8192u);
            const u64 bd = desc_mnmajor_128b(sm.k_s + (D == 128 ? me * 8192u : 0u), 8192u);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 8; ++kk)
                wgmma_64x64x16<T, 1, 1>(reinterpret_cast<float(&)[32]>(dq),
                                        desc_advance(ad, (kk / 4) * 8192u + (kk % 4) * 2048u),
                                        desc_advance(bd, (kk / 4) * Smem::TILE + (kk % 4) * 2048u), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_rs<D>(dv, dk, pa, da);
            fence_operands(reinterpret_cast<float(&)[32]>(dq));
            if (lane == 0) mbar_arrive(sm.empty(s));  // this warp is done with Q_i and dO_i
#pragma unroll
            for (int nb = 0; nb < 8; ++nb)  // scale dS K: what the accumulator (or the ring's dQ) gets
                dq[nb][0] *= p.scale, dq[nb][1] *= p.scale, dq[nb][2] *= p.scale, dq[nb][3] *= p.scale;
            // this consumer's part of dQ_i. Shared memory serves 8-byte stores half a warp (16 lanes, 128 bytes) at
            // a time. Were every lane on n-block nb, the half of rows g = 0..3 would write chunks (2 (nb % 4) + t / 2)
            // ^ g: 4 of the 8, each twice (a two-way bank conflict). Lanes of odd g store n-block nb ^ 2 in step nb
            // instead: their chunks move by 4, and each half covers all 8 (stages/06_hopper/swizzle.py:
            // dq_store_offsets)
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
            if (issuer) {  // box b: 64 rows x 32 columns (D = 128: columns 32 b; D = 64: rows 64 (b / 2) ..,
                // columns 32 (b % 2)); rows past the array's end are skipped
                for (int b = 0; b < 4; ++b)
                    tma_reduce_add_3d(&p.map_dq, sm.dq_s + b * 8192u, D == 128 ? 32 * b : 32 * (b % 2),
                                      blk.q0() + row0 + (D == 128 ? 0 : 64 * (b / 2)), bq);
                bulk_commit();
            }
        }
    }
    ws_epilogue<T, D>(p, blk, dk, dv, kr, t, issuer, BAR_LAST);
}
