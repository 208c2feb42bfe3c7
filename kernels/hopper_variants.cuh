// hopper_variants.cuh: how the attention variants enter stage 06's warp-specialised loops. The loops call stage 02's
// hooks (variants.cuh: Mask, Score; the definitions are stages/common/variants.py), and plain attention's hooks are
// identity; what is Hopper's own is here:
//   * the parameter structs: HopperFwdParams / HopperBwdParams, then the variants' fields as stage 02's kernels take
//     them (a FwdParams), so that the same hooks read them;
//   * the forward's VariantScheduler: a work item is (Q tile, query head) of a batch or of one sequence of a packed
//     batch; it reads K/V from the query head's k / v head (grouped-query attention: h / group) and visits only the
//     band of K/V tiles j0 .. j0 + n_tiles - 1 that hold a key one of its rows sees (a window's other tiles are never
//     loaded nor computed);
//   * the backward's KeyBlock: a block is (K/V tile, k / v head); it walks the Q tiles of every query head of its
//     group that see one of its keys, so that dK_j, dV_j are summed over the group in its registers.
// Dropout stays with stages 02 and 03 (stages/06_hopper/README.md says why).
#pragma once
#include "hopper_bwd_tiles.cuh"  // HopperBwdParams
#include "hopper_scheduler.cuh"
#include "params.cuh"
#include "variants.cuh"

// A packed batch (var.cu_q not null): q, o, lse are (1, H, total_q, ...) and k, v (1, H / group, total_k, D); the
// grid's (sequence, head) axis is s * H + h, and sequence s is rows cu_q[s] .. cu_q[s + 1] - 1 of its head (keys:
// cu_k). Otherwise the axis is the (batch, head) b * H + h of q, and k / v head b * (H / group) + h / group.
struct SequenceHead {
    int bh, bkv;   // the tensor maps' head coordinates of q (and o, lse) and of k, v
    int q0, k0;    // the sequence's first query row and first key in them
    int Nq, Nk;    // its query rows and keys
    int hd;        // the (batch, head) of the ALiBi slope: var.slopes is (B, H)
};
__device__ __forceinline__ SequenceHead sequence_head(const FwdParams& var, int axis, int Nq, int Nk) {
    const int H = var.H, group = var.group, b = axis / H, h = axis % H;
    if (var.cu_q == nullptr) return SequenceHead{axis, b * (H / group) + h / group, 0, 0, Nq, Nk, axis};
    const int q0 = var.cu_q[b], k0 = var.cu_k[b];
    return SequenceHead{h, h / group, q0, k0, var.cu_q[b + 1] - q0, var.cu_k[b + 1] - k0, h};
}

// ---------------------------------------------------------------- the forward
// HopperFwdParams with the variants: var.H, var.group, var.left, var.right, var.softcap, var.scale, var.a_off,
// var.slopes (ALiBi, (B, H) floats, or null), var.cu_q and var.cu_k (a packed batch's sequence bounds, or null); its
// other fields are unused. With a Score hook that changes S (ModScore), scale_log2 is log2(e): the hook has already
// applied the scale (variants.cuh). stages/06_hopper/params.py mirrors it.
struct HopperVarFwdParams : HopperFwdParams {
    FwdParams var;
};

// One block per work item: grid (Q tiles of the longest sequence, (batch or sequence, head)). Under a mask with no
// left bound (causal) the Q tiles of a head differ in work, and rank 0 is the last one, which sees the most keys
// (TileScheduler's order); a window's Q tiles all see about as many keys, and take their own order.
template <int BC, typename Mask>
struct VariantScheduler {
    enum : bool { persistent = false };
    const HopperVarFwdParams& p;
    int n_items, stride;

    __device__ explicit VariantScheduler(const HopperVarFwdParams& params)
        : p(params), n_items(gridDim.x * gridDim.y), stride(gridDim.x * gridDim.y) {}
    __device__ int first() const { return blockIdx.y * gridDim.x + blockIdx.x; }

    __device__ WorkItem item(int) const {
        const SequenceHead s = sequence_head(p.var, blockIdx.y, p.Nq, p.Nk);
        const int n_rows = (s.Nq + 127) / 128, rank = blockIdx.x;
        const bool heaviest_first = p.var.right >= 0 && p.var.left < 0 && rank < n_rows;
        const int row0 = 128 * (heaviest_first ? n_rows - 1 - rank : rank);
        int2 band = make_int2(0, 0);  // K/V tiles band.x <= j < band.y; none for a block past its sequence's rows
        if (row0 < s.Nq) band = Mask(p.var, s.Nq, s.Nk).template kv_tiles<128, BC>(row0, s.Nq);
        return WorkItem{s.bh, s.bkv, row0, s.q0, s.k0, s.Nq, s.Nk, band.x, band.y - band.x, s.hd};
    }
};

// ---------------------------------------------------------------- the backward
// HopperBwdParams with the variants, as HopperVarFwdParams (var.H, var.group, var.left, var.right, var.softcap,
// var.scale, var.a_off, var.slopes, var.cu_q, var.cu_k). A packed batch: q, dO, dq_acc, lse, delta are laid out
// (1, H, total_q, ...) (Nq = total_q, Nq_pad its padding), k, v, dK, dV (1, H / group, total_k, D). map_lse,
// map_delta: L_i and D_i (B H rows of Nq_pad floats) in boxes of BR floats, unswizzled: a packed sequence's rows
// start anywhere, where a bulk copy needs 16-byte aligned addresses (the copy engine's tensor copies take any
// coordinate); rows past the array's end come as 0 and rows past a sequence's end are the next one's, so the mask
// hides every row from the sequence's Nq on (WindowMask::hidden).
struct HopperVarBwdParams : HopperBwdParams {
    FwdParams var;
    TensorMap map_lse, map_delta;
};

// The variants' Block of the ws backward (hopper_bwd_ws.cuh): a block per (K/V tile of 128 keys, (batch or sequence,
// k / v head)). It walks the group's query heads one after the other, each over the Q tiles with a row that sees one
// of its keys: under a window (left, right) rows from key0 - shift - right (the first whose right side reaches the
// tile's first key) to key_last - shift + left (the last whose left side reaches its last key). A block whose keys
// start past its sequence's last has none (it still writes its keys' zero dK, dV: none, and counts itself done).
template <int BR>
struct KeyBlock {
    const HopperVarBwdParams& p;
    int key0, Nq, Nk, i0, n_tiles;
    int bkv, bq0, grp, q0_, k0_;

    __device__ explicit KeyBlock(const HopperVarBwdParams& params)
        : p(params), key0(128 * blockIdx.x), grp(p.var.group) {
        const int Hkv = p.var.H / grp, b = blockIdx.y / Hkv, hk = blockIdx.y % Hkv;
        if (p.var.cu_q == nullptr) {  // (batch b, k / v head hk): query heads b H + hk group ..
            bkv = blockIdx.y, bq0 = b * p.var.H + hk * grp, q0_ = 0, k0_ = 0, Nq = p.Nq, Nk = p.Nk;
        } else {  // (sequence b, k / v head hk) of a packed batch
            bkv = hk, bq0 = hk * grp, q0_ = p.var.cu_q[b], k0_ = p.var.cu_k[b];
            Nq = p.var.cu_q[b + 1] - q0_, Nk = p.var.cu_k[b + 1] - k0_;
        }
        const int shift = Nk - Nq, left = p.var.left, right = p.var.right, last_key = min(key0 + 127, Nk - 1);
        const int first = right < 0 ? 0 : max(0, key0 - shift - right);
        const int last = left < 0 ? Nq - 1 : min(Nq - 1, last_key - shift + left);
        i0 = first / BR;
        n_tiles = key0 >= Nk || first > last ? 0 : last / BR + 1 - i0;  // Q tiles i0 .. i0 + n_tiles - 1
    }
    __device__ int group() const { return grp; }
    __device__ int q_head(int qh) const { return bq0 + qh; }  // also ALiBi's (batch, head): var.slopes is (B, H)
    __device__ int kv_head() const { return bkv; }
    __device__ int q0() const { return q0_; }
    __device__ int k0() const { return k0_; }
    __device__ int counter() const { return blockIdx.y; }
    // L_i and D_i of the sequence's rows row0 .. row0 + BR - 1 of query head bq: tensor copies (any first row)
    __device__ void load_l_d(u32 dst, u32 bar, int row0, int bq) const {
        tma_load_2d(dst, &p.map_lse, bar, q0_ + row0, bq);
        tma_load_2d(dst + 4 * BR, &p.map_delta, bar, q0_ + row0, bq);
    }
};
