// hopper_scheduler.cuh: the tile scheduler of stage 06's ping-pong forward: which work items a block computes, in
// what order, and how many K/V tiles each has. FlashAttention-3 keeps its schedulers apart from its kernel in the same
// way (hopper/tile_scheduler.hpp: SingleTileScheduler, StaticPersistentTileScheduler); the main loop
// (hopper_pingpong.cuh) walks the items it is given and never computes one itself. The variants' scheduler
// (hopper_variants.cuh: VariantScheduler) gives the same items of grouped-query heads, packed sequences and windows.
//
// A work item is (Q tile of 128 rows, head), item = head * n_rows + rank. Head-major: the blocks in flight share
// their heads' K and V in L2. Under the causal mask rank 0 is a head's last Q tile, the one that sees the most keys,
// so the heaviest items start first and the short ones fill the end of the grid.
//   PERSISTENT = false  a grid of (n_rows, heads) blocks, one per item, balanced by the GPU's block scheduler.
//                       blockIdx gives the item's rank and head without a division, and the caller's item loop ends
//                       after one pass (the kernel breaks out of it where the compiler sees it).
//   PERSISTENT = true   one block per SM (stages/06_hopper/flash_v3.py: persistent_rule), each striding over the
//                       items by the size of the grid.
#pragma once
#include "hopper_tiles.cuh"  // HopperFwdParams

// One work item as the main loop sees it: the Q tile's rows, the heads and rows the copy engine reads, and the K/V
// tiles j0 .. j0 + n_tiles - 1 of BC keys that hold a key one of its rows sees (n_tiles = 0: none, the item only
// stores O = 0, L = -inf). Plain attention: one head for q and k / v, rows from 0; the variants' scheduler
// (VariantScheduler, hopper_variants.cuh) gives grouped-query heads, a packed sequence's rows and a window's band of
// tiles.
struct WorkItem {
    int bh, bkv;    // the (batch, head) of q, o, lse and of k, v: the tensor maps' third coordinate
    int row0;       // the Q tile's first row, counted from its sequence's first
    int q0, k0;     // the rows of the sequence's first query and key in the maps (a packed batch; else 0)
    int Nq, Nk;     // the sequence's query rows and keys
    int j0, n_tiles;
    int hd;         // the (batch, head) of the ALiBi slope (hooks: variants.cuh)
};

template <int BC, bool PERSISTENT>
struct TileScheduler {
    enum : bool { persistent = PERSISTENT };
    const HopperFwdParams& p;
    int Nq, Nk, shift;            // the problem: query r sees key c iff c <= r + shift under the causal mask
    int n_rows, n_items, stride;  // Q tiles a head, items, the stride of a block's walk

    __device__ explicit TileScheduler(const HopperFwdParams& params)
        : p(params), Nq(p.Nq), Nk(p.Nk), shift(Nk - Nq), n_rows((Nq + 127) / 128), n_items(n_rows * p.heads),
          stride(gridDim.x * gridDim.y) {}

    // A block's items: first(), then on by stride while below n_items.
    __device__ int first() const { return blockIdx.y * gridDim.x + blockIdx.x; }

    // The item: its head, first row and K/V tiles of BC keys: those holding a key that one of its rows sees.
    __device__ WorkItem item(int item) const {
        const int rank = PERSISTENT ? item % n_rows : blockIdx.x;
        const int bh = PERSISTENT ? item / n_rows : blockIdx.y;
        const int row0 = 128 * (p.causal ? n_rows - 1 - rank : rank);
        const int last_row = min(row0 + 127, Nq - 1);
        const int last_key = p.causal ? min(Nk - 1, last_row + shift) : Nk - 1;
        return WorkItem{bh, bh, row0, 0, 0, Nq, Nk, 0, last_key < 0 ? 0 : last_key / BC + 1, bh};
    }
};
