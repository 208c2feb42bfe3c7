"""Stage 04: how the sequence is cut into shards, and which keys each query shard sees.

    contiguous: rank r holds rows [r*N/P, (r+1)*N/P)
    zigzag:     the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so every
                rank gets the same amount of causal work (contiguous leaves rank 0 almost idle).
Any length works: shards are padded to ceil(N/P) (zigzag: 2*ceil(N/2P)) rows; a position >= N is padding.

    shard_len(n, P, layout)       rows per rank
    positions(rank, P, n, layout) global positions of a rank's rows, in local order
    shard(x, rank, P, layout)     a rank's rows of x (B, H, N, ...), zero-padded
    unshard(shards, n, layout)    the global array back from the P shards
    plan(qpos, kpos, nq, nk, causal)  the kernel calls that cover exactly the visible (query, key) pairs
"""
import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout, where="ring attention"):
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: layout {layout!r} is not known; use one of {LAYOUTS}")
    return layout


def check_ranks(P, where="ring attention"):
    """The number of ranks: an int >= 1."""
    if isinstance(P, (bool, np.bool_)) or not isinstance(P, (int, np.integer)) or P < 1:
        raise ValueError(f"{where}: ranks must be a whole number >= 1, got {P!r}")
    return int(P)


def shard_len(n, P, layout):
    """Rows each rank holds for a global length n: ceil(n/P), or 2*ceil(n/2P) for zigzag."""
    check_layout(layout)
    P = check_ranks(P)
    return -(-n // P) if layout == "contiguous" else 2 * -(-n // (2 * P))


def positions(rank, P, n, layout):
    """Global sequence positions of `rank`'s rows, in local order; a position >= n is padding."""
    L = shard_len(n, P, layout)
    if layout == "contiguous":
        return np.arange(rank * L, (rank + 1) * L)
    c = L // 2  # chunk length: the sequence is 2P chunks, rank r holds chunks r and 2P-1-r
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange((2 * P - 1 - rank) * c, (2 * P - rank) * c)])


def shard(x, rank, P, layout):
    """Rank's shard of x (B, H, N, ...) along axis 2, zero-padded to shard_len rows."""
    n = x.shape[2]
    pos = positions(rank, P, n, layout)
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    out = x[:, :, xp.asarray(np.minimum(pos, n - 1))]  # (B, H, L, ...) gathered rows; padding repeats row n-1
    out = xp.ascontiguousarray(out)
    valid = int((pos < n).sum())  # padding rows are a suffix of the shard
    out.view(f"u{out.itemsize}")[:, :, valid:] = 0  # zero padding rows (bits 0 = +0.0): finite everywhere
    return out


def unshard(shards, n, layout):
    """The global (B, H, n, ...) array from the P shards (padding rows dropped)."""
    P = len(shards)
    xp = np if isinstance(shards[0], np.ndarray) else __import__("cupy")
    full = xp.concatenate(shards, axis=2)  # (B, H, P*L, ...) in rank order
    pos = np.concatenate([positions(r, P, n, layout) for r in range(P)])
    order = np.argsort(pos)[:n]  # local row -> global position, padding (pos >= n) sorts last
    return full[:, :, xp.asarray(order)]


# ----------------------------------------------------------------------------- which keys each query sees
def plan(qpos, kpos, nq, nk, causal):
    """Split one (query shard, key block) pair into kernel calls [(a, b, m, causal)]:
    rows a:b of the query shard attend keys 0:m of the block, with or without the causal diagonal.

    n_i = how many keys of the block row i sees. Positions increase in local order in both layouts,
    so row i sees a prefix of the block and n_i never decreases: a staircase. A flat run of the
    staircase is a full (non-causal) call; a run rising by one key per row is a causal call, since
    the kernels align the diagonal bottom-right (row b-1 sees all m keys); rows with n_i = 0 are skipped.
    """
    if causal:  # query i sees key j iff j <= i + (nk - nq)  (bottom-right, as every stage)
        n = np.searchsorted(kpos, qpos + (nk - nq), side="right")  # padded keys lie after every real query
    else:
        n = np.full(len(qpos), int((kpos < nk).sum()))  # every valid key: a prefix, padding is a suffix
    # Walk the staircase run by run, not row by row: a Python loop over 16k rows costs ~4 ms of host time
    # per call, during which the GPU would sit idle. d[p] = n[p+1] - n[p]; a run is a stretch of equal d.
    L = len(n)
    d = np.diff(n)  # (L-1,)
    change = np.flatnonzero(d[1:] != d[:-1]) + 1  # p where d[p] != d[p-1]: where a run of d starts

    def run_end(i):  # one past the last row of the run of rows that starts at row i (d == d[i] from i on)
        k = np.searchsorted(change, i, side="right")
        return int(change[k]) + 1 if k < len(change) else L

    calls, i = [], 0
    while i < L:
        if n[i] == 0:  # rows that see no key of this block: skip them all at once
            nz = np.flatnonzero(n[i:])
            if len(nz) == 0:
                break
            i += int(nz[0])
            continue
        if i + 1 < L and d[i] == 1:  # a diagonal run: one causal call
            j = run_end(i)
            calls.append((i, j, int(n[j - 1]), True))
        else:  # a flat run (d == 0), or a lone row before a jump: one full call
            j = run_end(i) if i + 1 < L and d[i] == 0 else i + 1
            calls.append((i, j, int(n[i]), False))
        i = j
    return calls
