"""Stage 04: candidate changes to a rank's schedule, switched on one at a time to be measured (a measurement aid).

A rank of the ring loses time outside its block calls (fills, casts, copies, launches; dev/bench_rank.py shows where).
Each candidate below removes one such cost. None is on by default: a change is kept, as the default, only once the
rank benchmark (dev/bench_rank.py --variants base,fold,...) has measured that it pays on a GPU, all candidates in one
run on the same GPU. Every candidate gives the same result as the default (tests/test_04_ring.py holds them to it), so
switching one on never changes what the ring computes, only what it costs.

    with candidates.trying("fold", "serial-fwd"):    # these candidates, for the ring calls inside the block
        ring_forward(...)
    candidates.on("fold")                             # inside the ring: is this candidate switched on?

Inside the ring each candidate is one marked line, a measurement hook ("if candidates.on(...):  # measurement hook"),
and what a candidate does instead lives here (o_unfilled, zero_grads_at_once, cast_grads_at_once) or is one line
there (the "serial-*" candidates skip the side streams), so the ring's own code reads as the default runs it.

The switch is a module setting, not a keyword of ring_forward: it is for measuring, and the API stays what a learner
reads. It holds for every thread of the process (the simulated ranks of ring.forward see the same candidates).
"""
import contextlib

from stages.common import cast

CANDIDATES = {
    "fold": "the forward's float32 O_r is not filled with zeros: its first block writes it (the merge, like the "
            "kernels' epilogue, never reads O where L = -inf); only rows no block covers are zeroed. The backward "
            "zeroes a travelling half's dK, dV in one fill instead of two, and casts them in one pass instead of one "
            "per run of rows",
    "serial-fwd": "the forward's calls of a step one after another on the compute stream (no side streams)",
    "serial-bwd": "the backward's calls of a step one after another on the compute stream (no side streams)",
}

_ON = set()


def on(name):
    """Whether candidate `name` is switched on (the ring asks where the candidate acts)."""
    return name in _ON


def check(names):
    """The names as a tuple, each one of CANDIDATES ("base" alone: none)."""
    names = tuple(n for n in names if n != "base")
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown ring candidate(s) {unknown}; the candidates are {sorted(CANDIDATES)} (or base)")
    return names


@contextlib.contextmanager
def trying(*names):
    """Switch these candidates on for the ring calls inside the `with` block (the others off)."""
    names = check(names)
    saved = set(_ON)
    _ON.clear()
    _ON.update(names)
    try:
        yield names
    finally:
        _ON.clear()
        _ON.update(saved)


# ----------------------------------------------------------------------------- what candidate "fold" does instead
def o_unfilled(prob, shape, dtype):
    """The forward's float32 O_r, shape (B, H, Tq, D), left unfilled where a block call will write it first (merge()
    and the kernels' merge never let O's value through where L = -inf); only the rows no block call covers (padding,
    rows that see no key: Problem.uncovered_rows) are zeroed."""
    o_run = prob.xp.empty(shape, dtype=dtype)
    for a, b in prob.uncovered_rows():
        o_run[:, :, a:b] = 0
    return o_run


def zero_grads_at_once(slot):
    """A travelling half's dK_h and dV_h (adjacent in the slot's bytes, travel.Travel) zeroed in one fill instead of
    two (bit pattern 0 is +0.0)."""
    slot["bytes"][:slot["grad_bytes"]] = 0


def cast_grads_at_once(slot, shape, acc, dtype):
    """A half's dK_h and dV_h cast from the accumulators' dtype acc to dtype in one pass over both, instead of one
    cast per run of rows: (dK_h, dV_h), each of `shape` (B, Hkv, T_h, D)."""
    both = cast(slot["bytes"][:slot["grad_bytes"]].view(acc), dtype).reshape((2, *shape))
    return both[0], both[1]
