"""Stage 04: how the sequence is cut into shards, and which keys each query shard sees.

    contiguous: rank r holds rows [r*N/P, (r+1)*N/P)
    zigzag:     the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so every
                rank gets the same amount of causal work (contiguous leaves rank 0 almost idle).
Any length works: shards are padded to ceil(N/P) (zigzag: 2*ceil(N/2P)) rows; a position >= N is padding.

    shard_len(n, P, layout)       rows per rank
    positions(rank, P, n, layout) global positions of a rank's rows, in local order
    shard(x, rank, P, layout)     a rank's rows of x (B, H, N, ...), zero-padded
    unshard(shards, n, layout)    the global array back from the P shards
    block_calls(qpos, kpos, nq, nk, causal, window, runs)  the kernel calls that cover exactly the visible pairs
    steps(P, nq, nk, layout, causal, window)  the ring steps at which some rank has work (a window skips the rest)
    halves(T, P, layout)          the two halves a key block of T rows travels in (rows of the shard)
"""
import functools
from typing import NamedTuple

import numpy as np

from stages.common import variants

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


def _ceil_div(a, b):
    return -(-a // b)


def shard_len(n, P, layout):
    """Rows each rank holds for a global length n: ceil(n/P), or 2*ceil(n/2P) for zigzag."""
    check_layout(layout)
    P = check_ranks(P)
    return -(-n // P) if layout == "contiguous" else 2 * -(-n // (2 * P))


def positions(rank, P, n, layout):
    """Global sequence positions of `rank`'s rows, in local order; a position >= n is padding."""
    T = shard_len(n, P, layout)  # rows a rank holds
    if layout == "contiguous":
        return np.arange(rank * T, (rank + 1) * T)
    c = T // 2  # chunk length: the sequence is 2P chunks, rank r holds chunks r and 2P-1-r
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange((2 * P - 1 - rank) * c, (2 * P - rank) * c)])


def shard(x, rank, P, layout):
    """Rank's shard of x (B, H, N, ...) along axis 2, zero-padded to shard_len rows."""
    n = x.shape[2]
    pos = positions(rank, P, n, layout)
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    out = x[:, :, xp.asarray(np.minimum(pos, n - 1))]  # (B, H, T, ...) gathered rows; padding repeats row n-1
    out = xp.ascontiguousarray(out)
    valid = int((pos < n).sum())  # padding rows are a suffix of the shard
    out.view(f"u{out.itemsize}")[:, :, valid:] = 0  # zero padding rows (bits 0 = +0.0): finite everywhere
    return out


def unshard(shards, n, layout):
    """The global (B, H, n, ...) array from the P shards (padding rows dropped)."""
    P = len(shards)
    xp = np if isinstance(shards[0], np.ndarray) else __import__("cupy")
    full = xp.concatenate(shards, axis=2)  # (B, H, P*T, ...) in rank order
    pos = np.concatenate([positions(r, P, n, layout) for r in range(P)])
    order = np.argsort(pos)[:n]  # local row -> global position, padding (pos >= n) sorts last
    return full[:, :, xp.asarray(order)]


def halves(T, P, layout):
    """The rows of a key block (T rows, local order) in the two halves it travels in: [rows of half 0, rows of half 1].

    The ring computes with one half of a block while the other half travels (ring.py), so each half should carry
    about half of every step's work. The shard is one chunk (contiguous) or two (zigzag), and half 0 takes the first
    part of each chunk, half 1 the rest: whichever rows of the block a step's queries see (a prefix, under a causal
    mask; all; one chunk), both halves hold some of them. The cut inside a chunk is rounded up to a multiple of 16
    rows, so a half starts on the kernels' 16-row dropout grid whenever its chunk does. One rank: one half, the whole
    block (nothing travels)."""
    if P == 1:
        return [np.arange(T)]
    chunks = [(0, T)] if layout == "contiguous" else [(0, T // 2), (T // 2, T)]
    first, second = [], []
    for a, b in chunks:
        half = _ceil_div(b - a, 2)  # half the chunk's rows, rounded up
        cut = a + min(b - a, _ceil_div(half, 16) * 16)  # ... then up to a multiple of 16 (the chunk's end at most)
        first.append(np.arange(a, cut))
        second.append(np.arange(cut, b))
    return [np.concatenate(first), np.concatenate(second)]


# ----------------------------------------------------------------------------- which keys each query sees
class BlockCall(NamedTuple):
    """One kernel call of a (query shard, key block) pair: rows q_start:q_stop of the query shard attend keys
    k_start:k_stop of the block under the kernel's own mask (left, right): a window around the kernel's bottom-right
    diagonal, -1 unbounded, so (-1, -1) is full attention and (-1, 0) causal (stages/common/variants.py)."""
    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    left: int = -1
    right: int = -1

    def mask(self):
        """The call's mask as keyword options of the kernels: {"causal": ...}, plus "window": (left, right) only when
        the call needs one (so a block kernel without windows serves every plain call)."""
        if self.left < 0 and self.right < 0:
            return {"causal": False}
        if self.left < 0 and self.right == 0:
            return {"causal": True}
        return {"causal": False, "window": (self.left, self.right)}

    def pairs(self):
        """How many (query, key) pairs the call computes."""
        opts = variants.Options(left=self.left, right=self.right)  # the kernel's own mask on its sub-problem
        return int(variants.visible(self.q_stop - self.q_start, self.k_stop - self.k_start, opts).sum())


def visible_range(qpos, kpos, nq, nk, causal, window=None):
    """(lo, hi): query row i of the shard sees keys lo[i]:hi[i] of the block (empty when hi <= lo).

    Query position p sees key position t iff p + shift - left <= t <= p + shift + right (shift = nk - nq,
    bottom-right as every stage; -1 unbounded; causal is right = 0) and t < nk. Positions increase in local order in
    both layouts, so each row sees one interval of the block and lo, hi never decrease down the rows."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    shift = nk - nq
    valid = int((kpos < nk).sum())  # padding keys are a suffix of the block
    hi = np.full(len(qpos), valid)
    if right >= 0:
        hi = np.minimum(np.searchsorted(kpos, qpos + shift + right, side="right"), valid)
    lo = np.zeros(len(qpos), dtype=hi.dtype)
    if left >= 0:
        lo = np.searchsorted(kpos, qpos + shift - left, side="left")
    return lo, np.maximum(hi, lo)


def block_calls(qpos, kpos, nq, nk, causal, window=None, runs=False):
    """Split one (query shard, key block) pair into kernel calls [BlockCall]: together they cover exactly the
    visible (query, key) pairs, each once.

    runs=True: no call spans a jump in positions (zigzag's two chunks), so each call's rows and keys are consecutive
    global positions: what ALiBi and dropout need, whose bias and bits are functions of the global (i, j). The
    pair is then split run by run (each run of consecutive query positions against each run of keys).

    Row i sees keys lo_i:hi_i (visible_range). Down the rows each edge either stays (a flat edge) or moves by one key
    per row (a diagonal edge), except at a jump; a run of rows whose two edges keep one behaviour is one call, of
    rows q_start:q_stop and keys k_start:k_stop (shift = (k_stop - k_start) - (q_stop - q_start)):
        both flat             full attention on keys lo:hi
        hi diagonal           causal (the kernel's diagonal is bottom-right: the last row sees up to the last key)
        lo diagonal           a window (shift, -1): row i' starts at key i'
        both diagonal         a band (shift, 0)
    A lone row between two jumps is a full call on its own keys; rows that see no key are skipped.
    With no window lo = 0 and this is the causal staircase: full calls, diagonal calls and skipped rows.
    """
    if runs:
        return [c._replace(q_start=c.q_start + q0, q_stop=c.q_stop + q0, k_start=c.k_start + k0, k_stop=c.k_stop + k0)
                for q0, q1 in _runs(qpos) for k0, k1 in _runs(kpos)
                for c in block_calls(qpos[q0:q1], kpos[k0:k1], nq, nk, causal, window)]
    lo, hi = visible_range(qpos, kpos, nq, nk, causal, window)
    T = len(lo)  # rows of the query shard
    busy = hi > lo
    dl, dh = np.diff(lo), np.diff(hi)  # (T-1,): how each edge moves from row p to row p+1
    ok = (dl >= 0) & (dl <= 1) & (dh >= 0) & (dh <= 1) & busy[:-1] & busy[1:]
    kind = np.where(ok, 2 * dl + dh, -1)  # 0 both flat, 1 hi diagonal, 2 lo diagonal, 3 both; -1 a jump
    # Walk run by run, not row by row: a Python loop over 16k rows costs ms of host time per call, during which the
    # GPU would sit idle. change[k]: where a run of equal kind starts.
    change = np.flatnonzero(kind[1:] != kind[:-1]) + 1

    def run_end(i):  # one past the last row of the run that starts at row i (kind == kind[i] from i on)
        k = np.searchsorted(change, i, side="right")
        return int(change[k]) + 1 if k < len(change) else T

    calls, i = [], 0
    while i < T:
        if not busy[i]:  # rows that see no key of this block: skip them all at once
            nz = np.flatnonzero(busy[i:])
            if len(nz) == 0:
                break
            i += int(nz[0])
            continue
        k = int(kind[i]) if i + 1 < T else -1
        end = run_end(i) if k >= 0 else i + 1  # this call's rows are i:end
        k_start, k_stop = int(lo[i]), int(hi[end - 1])
        shift = (k_stop - k_start) - (end - i)  # the kernel's diagonal shift on this sub-problem
        calls.append(BlockCall(i, end, k_start, k_stop, shift if k in (2, 3) else -1, 0 if k in (1, 3) else -1))
        i = end
    return calls


def _runs(pos):
    """[(start, end)]: the runs of consecutive positions in pos (one run contiguous, two zigzag)."""
    cut = np.flatnonzero(np.diff(pos) != 1) + 1
    edges = [0, *cut.tolist(), len(pos)]
    return list(zip(edges[:-1], edges[1:]))


def steps(P, nq, nk, layout, causal, window=None):
    """The ring steps s (rank r computes with the block of rank r - s) at which some rank has work, in order.

    Without a window every step has work. With a sliding window most blocks lie outside every query's window: the
    ring skips those steps, their compute and their transfers (K, V go straight to the next step with work).
    Computed once per problem (P^2 interval searches), then remembered."""
    return list(_steps(P, nq, nk, layout, bool(causal), None if window is None else tuple(window)))


@functools.lru_cache(maxsize=256)
def _steps(P, nq, nk, layout, causal, window):
    out = []
    for s in range(P):
        for r in range(P):
            lo, hi = visible_range(positions(r, P, nq, layout), positions((r - s) % P, P, nk, layout), nq, nk,
                                   causal, window)
            if (hi > lo).any():
                out.append(s)
                break
    return tuple(out)
