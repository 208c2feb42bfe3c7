"""Stage 04: what every rank checks and agrees on before the ring turns.

    prob = prologue(q, k, v, comm, ...)     the local checks, then an agreement between the ranks; a Problem
    prob.todo                               the steps with work (shards.steps: a window skips the others)
    prob.calls(s, h)                        this rank's block calls against (half h of) the block of step s
    check_api(...)                          the one-process API's checks, before any shard is cut

Ranks that called the ring with different shapes, dtype or options would post transfers of different sizes and hang.
So every call starts with an allgather of the facts (check_same_everywhere), and a rank whose own inputs are invalid
shares its error the same way: the error is raised on EVERY rank at once (RingMismatch), never a hang.
"""
import dataclasses
import functools

import numpy as np

from stages.common import (
    array_module, cast, check_attention_inputs, check_backward_inputs, check_causal, resolve_scale, variants,
)

from .compute import BLOCKS, default_block
from .gather import check_scheme
from .shards import LAYOUTS, block_calls, check_layout, check_ranks, halves, positions, shard_len, steps

__all__ = ["RingMismatch", "check_same_everywhere", "Problem", "prologue", "check_api", "check_block", "plain_problem"]


class RingMismatch(ValueError):
    """Ranks called the ring with different shapes/dtype/options, or one rank's inputs are invalid.
    Raised on EVERY rank at once (never a hang in a receive that will not come)."""


def check_same_everywhere(comm, **facts):
    """Every rank must call the ring with the same shapes, dtype and options: a mismatch would make
    the send/recv sizes disagree and hang. Raise on EVERY rank, naming the ranks that differ.
    comm: this rank's communicator (comm.py). A rank whose own inputs are invalid sends {"problem": message} instead,
    and every rank raises that."""
    every = comm.allgather(facts)
    problems = [(r, f["problem"]) for r, f in enumerate(every) if "problem" in f]
    if problems:
        raise RingMismatch("ring attention: " + "; ".join(f"rank {r} cannot run: {msg}" for r, msg in problems))
    bad = [r for r, f in enumerate(every) if f != every[0]]
    if bad:
        keys = sorted({key for r in bad for key in facts if every[r][key] != every[0][key]})
        lines = "\n".join(f"  rank {r}: " + ", ".join(f"{key}={every[r][key]}" for key in keys)
                          for r in range(len(every)))
        raise RingMismatch(f"ring attention: ranks {bad} disagree with rank 0 on {', '.join(keys)} "
                           f"(every rank must pass the same shapes, dtype and options):\n{lines}")


@functools.lru_cache(maxsize=1024)
def _step_calls(P, r, nq, nk, layout, causal, window, runs, s, h):
    """(calls, key positions) of this rank's queries against half h (None: all) of the block it holds at step s: the
    kernel calls (shards.block_calls) and the global positions of the keys. A pure function of the problem's shape, so
    it is made once per (problem, step, half) and remembered: a repeated ring call splits nothing again."""
    kpos = positions((r - s) % P, P, nk, layout)
    if h is not None:
        kpos = kpos[halves(shard_len(nk, P, layout), P, layout)[h]]
    return tuple(block_calls(positions(r, P, nq, layout), kpos, nq, nk, causal, window, runs)), kpos


@functools.lru_cache(maxsize=256)
def _gathered(P, r, nq, nk, layout, causal, window, runs):
    """(calls, key positions) of this rank's queries against every key of the sequence, in order (scheme
    "allgather"): one call per run of query rows whose visible keys move the same way, two for causal zigzag."""
    kpos = np.arange(P * shard_len(nk, P, layout))
    return tuple(block_calls(positions(r, P, nq, layout), kpos, nq, nk, causal, window, runs)), kpos


@dataclasses.dataclass(frozen=True)
class Problem:
    """What forward and backward agree on before the ring turns: ranks, this rank, the array module, the shard
    shapes (B, H, Hkv, Tq, Tk, D), the global lengths, the layout, the resolved mask, scale and the options that act
    on scores or probabilities (softcap, ALiBi, dropout), and the steps with work (shards.steps)."""
    P: int  # ranks in the ring
    r: int  # this rank
    xp: object  # the array module: numpy or cupy
    B: int
    H: int
    Hkv: int  # k, v heads (grouped-query: Hkv divides H)
    Tq: int  # rows of this rank's query shard: T = N/P tokens a rank, padding included (shards.shard_len)
    Tk: int  # rows of its key shard (and of every block it receives)
    D: int
    nq: int  # global query length, no padding
    nk: int  # global key length
    layout: str
    causal: bool
    scale: float
    window: object  # (left, right) or None
    softcap: object  # c or None
    alibi_slopes: object  # (H,) or (B, H), or None
    dropout_p: float
    seed: int
    todo: tuple  # the steps at which some rank has work
    scheme: str = "ring"  # SCHEMES: how the ranks share the keys

    @property
    def key_halves(self):
        """The rows of a key block in each half it travels in (shards.halves)."""
        return halves(self.Tk, self.P, self.layout)

    @property
    def runs(self):
        """Whether each call must lie on consecutive global positions (ALiBi and dropout need them)."""
        return self.alibi_slopes is not None or bool(self.dropout_p)

    def calls(self, s, h=None):
        """(block calls, key positions) of this rank's queries against half h (None: all) of the block it holds at
        step s."""
        return _step_calls(self.P, self.r, self.nq, self.nk, self.layout, self.causal, self.window, self.runs, s, h)

    def gathered_calls(self):
        """(block calls, key positions) of this rank's queries against the whole sequence of keys (scheme
        "allgather")."""
        return _gathered(self.P, self.r, self.nq, self.nk, self.layout, self.causal, self.window, self.runs)

    def qpos(self):
        return positions(self.r, self.P, self.nq, self.layout)

    def options(self, qpos, kpos, c):
        """The options block call c takes besides its mask (none for plain attention): softcap when set; with ALiBi or
        dropout also where the call sits in the whole problem, origin (global row of its first query, global index
        of its first key, the problem's shift nk - nq)."""
        out = {} if self.softcap is None else {"softcap": self.softcap}
        if self.runs:
            out.update(alibi_slopes=self.alibi_slopes, dropout_p=self.dropout_p, seed=self.seed,
                       origin=(int(qpos[c.q_start]), int(kpos[c.k_start]), self.nk - self.nq))
        return out

    @property
    def plain(self):
        """No option that acts on scores or probabilities, and one kv head per query head."""
        return self.softcap is None and self.alibi_slopes is None and not self.dropout_p and self.Hkv == self.H

    def whole_call(self):
        """(call, key positions) when this is a ring of one rank with one block call over the whole shard and block
        (plain and causal attention of any length, except odd zigzag lengths), else None. The ring is then one kernel
        call: nothing travels, nothing is merged, and the call writes its result in the inputs' dtype itself."""
        if self.P != 1 or self.todo != (0,):
            return None
        calls, kpos = self.calls(0)
        if len(calls) == 1 and calls[0][:4] == (0, self.Tq, 0, self.Tk):  # q_start, q_stop, k_start, k_stop
            return calls[0], kpos
        return None

    def uncovered_rows(self):
        """[(a, b)]: runs of query rows of this rank that no block call of any step covers (padding rows, rows that
        see no key): the rows whose O_r, L_r no block writes, so the ring sets them to 0, -inf itself."""
        return _uncovered(self.P, self.r, self.nq, self.nk, self.layout, self.causal, self.window, self.runs,
                          self.todo)

    def without_padding(self, do):
        """do with its padding rows (a suffix of the shard) set to 0: a padded query row then sends no gradient."""
        valid = int((self.qpos() < self.nq).sum())
        if valid == self.Tq:
            return do
        do = do.copy()
        do.view(f"u{do.itemsize}")[:, :, valid:] = 0  # bit pattern 0 is +0.0 in every float dtype
        return do


@functools.lru_cache(maxsize=256)
def _uncovered(P, r, nq, nk, layout, causal, window, runs, todo):
    seen = np.zeros(shard_len(nq, P, layout), bool)
    for s in todo:
        for c in _step_calls(P, r, nq, nk, layout, causal, window, runs, s, None)[0]:
            seen[c.q_start:c.q_stop] = True
    edges = np.flatnonzero(np.diff(np.concatenate([[False], ~seen, [False]]).astype(np.int8)))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def check_block(block, version, where="ring attention"):
    """block must be a key of BLOCKS; version is for the flash blocks only (the naive block has none)."""
    if block not in BLOCKS:
        raise ValueError(f"{where}: block {block!r} is not known; use one of {sorted(BLOCKS)}")
    if block == "naive" and version is not None:
        raise ValueError(f"{where}: block='naive' (stage 00) has no versions, got version={version!r}; "
                         "pass version=None, or block='flash' to run a stage 02/03 version")
    return block


def check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where):
    """(window, opts): the window as the ring uses it (None when unbounded) and the checked variants.Options. The ring
    takes every variant of stage 00 but packed variable-length batches: grouped-query k, v, window, softcap, ALiBi
    and dropout."""
    opts = variants.check(q, k, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          dropout_p=dropout_p, seed=seed, where=where)
    window = None if opts.left < 0 and opts.right < 0 else (opts.left, -1 if causal else opts.right)
    return window, opts


def check_dropout_tiles(prob, block, where):
    """Dropout through the CUDA kernels: they draw the mask 16 x 16 blocks at a time, so every block call of this
    rank must start at a global query row and key that are multiples of 16 (variants.check_kernel_origin). That holds
    when the shards are whole 16-row tiles (the backward's halves are cut on the grid too), with a left window side
    only where the band's calls (which start one key apart) still land on the grid.
    A clear error before the ring turns, instead of one in the middle of it."""
    if not prob.dropout_p or block != "flash" or prob.xp is np:
        return
    qpos = prob.qpos()
    call_sets = ([prob.gathered_calls()] if prob.scheme == "allgather" else
                 [prob.calls(s, h) for s in prob.todo  # the forward's whole blocks, the backward's halves
                  for h in [None, *range(len(prob.key_halves))]])
    for calls, kpos in call_sets:
        for c in calls:
            if qpos[c.q_start] % 16 or kpos[c.k_start] % 16:
                raise ValueError(
                    f"{where}: dropout on the GPU: the kernels draw the mask in 16 x 16 blocks of the whole "
                    f"problem, and with {prob.P} ranks, layout {prob.layout}, nq={prob.nq}, nk={prob.nk} and "
                    f"window {prob.window} a block call starts at query {qpos[c.q_start]}, key {kpos[c.k_start]}. "
                    "Use lengths whose shards are whole 16-row tiles (N a multiple of 16 P contiguous, 32 P zigzag) "
                    "and no left window side off that grid (a band's calls start one key apart), or block='naive'")


def prologue(q, k, v, comm, *, nq, nk, causal, scale, layout, block, version, window, softcap, alibi_slopes, dropout_p,
             seed, scheme, extra=()):
    """Checks shared by forward and backward (extra: the backward's o, lse, do), agreed by every rank; a Problem.
    comm: this rank's communicator (comm.py); the other keywords are ring_forward's.

    The local checks run first and their error (if any) is shared with the agreement check, so a bad input on
    one rank is an error on every rank."""
    P, r = comm.size, comm.rank
    where = "ring attention backward" if extra else "ring attention"
    prob = None
    try:
        xp, B, H, Tq, Tk, D = (check_backward_inputs(q, k, v, *extra, where=where, gqa=True) if extra
                               else check_attention_inputs(q, k, v, where=where, gqa=True))
        check_block(block, version, where)
        check_layout(layout, where)
        causal = check_causal(causal, where)
        window, opts = check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where)
        softcap = opts.softcap or None
        nq, nk = nq or P * Tq, nk or P * Tk
        if Tq != shard_len(nq, P, layout) or Tk != shard_len(nk, P, layout):
            raise ValueError(f"{where}: shards have {Tq} query / {Tk} key rows; with {P} ranks, layout {layout}, "
                             f"nq={nq} and nk={nk} they must have {shard_len(nq, P, layout)} / "
                             f"{shard_len(nk, P, layout)} (cut them with ring.shard)")
        scale = resolve_scale(scale, D)
        check_scheme(scheme, P, H, k.shape[1], opts.dropout_p, where)
        prob = Problem(P=P, r=r, xp=xp, B=B, H=H, Hkv=k.shape[1], Tq=Tq, Tk=Tk, D=D, nq=nq, nk=nk, layout=layout,
                       causal=causal, scale=scale, window=window, softcap=softcap, alibi_slopes=opts.alibi_slopes,
                       dropout_p=opts.dropout_p, seed=opts.seed, todo=tuple(steps(P, nq, nk, layout, causal, window)),
                       scheme=scheme)
        check_dropout_tiles(prob, block, where)
        slopes = None if opts.alibi_slopes is None else tuple(cast(opts.alibi_slopes, np.float64).ravel().tolist())
        facts = dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), dtype=str(q.dtype),
                     device=type(q).__module__.split(".")[0], nq=nq, nk=nk, causal=bool(causal), scale=float(scale),
                     layout=layout, window=window, softcap=softcap, alibi_slopes=slopes, dropout_p=opts.dropout_p,
                     seed=opts.seed, scheme=scheme,
                     **{f"arg{i}": (tuple(t.shape), str(t.dtype)) for i, t in enumerate(extra)})
    except (TypeError, ValueError) as e:
        facts = {"problem": f"{type(e).__name__}: {e}"}
    check_same_everywhere(comm, **facts)
    return prob


def check_api(q, k, *, causal, scale, D, layout, ranks, block, version, where, window, softcap, alibi_slopes,
              dropout_p, seed, scheme):
    """The options of the one-process API, checked before any shard is cut (so an error quotes the caller's
    arrays, not a shard)."""
    check_causal(causal, where)
    resolve_scale(scale, D)
    check_layout(layout, where)
    check_ranks(ranks, where)
    check_block(block, version, where)
    _, opts = check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where)
    check_scheme(scheme, ranks, q.shape[1], k.shape[1], opts.dropout_p, where)


def plain_problem(q, k, layout, causal, scale, block):
    """(array module, scale, block functions) of ring.py's plain ring, after its checks: shards of N = P T tokens."""
    if layout not in LAYOUTS:
        raise ValueError(f"plain ring: layout {layout!r} is not known; use one of {LAYOUTS}")
    if causal and (q.shape[2] != k.shape[2] or (layout == "zigzag" and q.shape[2] % 2)):
        raise ValueError("plain ring: causal shards must have as many query as key rows (an even number for zigzag): "
                         "a sequence of N = P T tokens with no padding (ring_forward takes any length)")
    return array_module(q), resolve_scale(scale, q.shape[3]), BLOCKS[default_block(block, q)]
