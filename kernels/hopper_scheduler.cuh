// hopper_scheduler.cuh: the tile scheduler of stage 06's ping-pong forward: which work items a block computes, in
// what order, and how many K/V tiles each has. FlashAttention-3 keeps its schedulers apart from its kernel in the same
// way (hopper/tile_scheduler.hpp: SingleTileScheduler, StaticPersistentTileScheduler); the main loop
// (hopper_pingpong.cuh) walks the items it is given and never computes one itself.
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

template <int BC, bool PERSISTENT>
struct TileScheduler {
    const HopperFwdParams& p;
    int Nq, Nk, shift;            // the problem: query r sees key c iff c <= r + shift under the causal mask
    int n_rows, n_items, stride;  // Q tiles a head, items, the stride of a block's walk

    __device__ explicit TileScheduler(const HopperFwdParams& params)
        : p(params), Nq(p.Nq), Nk(p.Nk), shift(Nk - Nq), n_rows((Nq + 127) / 128), n_items(n_rows * p.heads),
          stride(gridDim.x * gridDim.y) {}

    // A block's items: first(), then on by stride while below n_items.
    __device__ int first() const { return blockIdx.y * gridDim.x + blockIdx.x; }

    // The item's head bh and first row row0; returns its K/V tiles of BC keys: those holding a key that one of its
    // rows sees (0: none).
    __device__ int tiles(int item, int& bh, int& row0) const {
        const int rank = PERSISTENT ? item % n_rows : blockIdx.x;
        bh = PERSISTENT ? item / n_rows : blockIdx.y;
        row0 = 128 * (p.causal ? n_rows - 1 - rank : rank);
        const int last_row = min(row0 + 127, Nq - 1);
        const int last_key = p.causal ? min(Nk - 1, last_row + shift) : Nk - 1;
        return last_key < 0 ? 0 : last_key / BC + 1;
    }
};
