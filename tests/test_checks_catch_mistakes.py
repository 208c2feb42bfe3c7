"""The checks catch mistakes: every wrong answer below fails the real check_forward / check_backward (the checks
every test and run.py use, and the ones the ring is checked with) on every case of the case list, every dtype,
at inputs x1 and x100, in every draw, except where the draw proves that the mistake cannot show (below).

A stage under test is a function with the one API that computes a correct answer as a kernel would (stage 00 in
the inputs' dtype: for float16/bfloat16 that is already the tensor-core precision model), wrapped by a mistake:

  forward (o, lse)                 backward (dq, dk, dv), started from the oracle's o, lse as check_backward does
  o = 0                            reads o as 0 (so D_i = rowsum(dO * O) = 0)
  o x 1.1                          reads o x 1.1
  one row of o swapped             one row of dq swapped with another (rows whose values differ)
  lse + 0.01                       reads lse + 0.01
  -                                dq = 0
  -                                dk and dv swapped
  one NaN in o                     one NaN in dq, dk or dv
  causal diagonal off by one (+1 and -1: query i sees key j <= i + (Nk - Nq) +- 1)
  scale off by 5% (scale x 1.05, everywhere the kernel uses it)
  the last key tile dropped (tile of 64 keys: keys 64*floor((Nk-1)/64) .. Nk-1 never seen; Nk <= 64: every key)

The ring (stage 04, one-process API, simulated ranks, block="naive") is checked by the same two functions. Its
output mistakes are applied to the ring's gathered output; its algorithm mistakes are made by every block kernel
(ring.BLOCKS["naive"] replaced by a block that carries the mistake, as a buggy stage 02/03 kernel would).
Layouts and rank counts alternate over the draws (contiguous / zigzag, 2 / 3 / 4 ranks): the ring's mistakes run in
the first RING_DRAWS = 6 draws, which cover every pair; the correct ring runs in every draw. The ring runs on the
cases with Nq, Nk <= RING_MAX = 1000 (it is the same check; a simulated ring at 4097 queries costs minutes a draw).

Every case runs DRAWS = 50 draws, except the large ones named in FEWER_DRAWS (Nq * Nk > 100000: 2 draws at 1000
queries, 1 at 4097), where one draw costs seconds; every mistake and dtype runs there too.

A mistake that the check does not catch is a failure, unless the draw proves that the mistake cannot show. Five
kinds of proof are accepted, and nothing else:
  (a) bit-identical: the wrong stage's outputs equal the correct stage's outputs byte for byte (e.g. scale x 1.05
      at one key, where P = 1 either way). Then no check whatsoever could see the mistake.
  (b) the same answer in float64: CANNOT_SHOW names the case and the reason (one query: no row to swap; one key:
      the true dq is 0; no causal diagonal to shift; the ring plans a one-row causal block as a non-causal call),
      and the wrong stage (the wrong ring), run in float64, gives what the correct one gives in float64 (to
      EXACT = 1e-9 relative). Where it does not (e.g. the zigzag ring at Nq = Nk = 1 shows a padded key to a
      diagonal shifted by +1), the check must catch the mistake like any other.
  (c) below the rounding the inputs allow: BELOW_ROUNDING names the (mistake, input scale) and the reason, and the
      mistake's effect on the exact answer (max |wrong - right|, both in float64) is, for every output, at most
      the rule's first-order rounding term for that output (tolerance.forward_s_terms / backward_s_terms: the
      largest change float32 or 16-bit rounding alone can make on these inputs). Such a mistake looks exactly
      like a correct kernel's rounding, so no rule that passes every correct kernel can catch it; a mistake whose
      effect is larger than the term is a miss even where the table names it.
  (d) within the rounding reach of the dtype: BELOW_PRECISION names the (mistake, dtype, input scale) and the
      reason, and the mistake's effect on the exact answer is, for every output, at most REACH = 1.5 times the
      rule's bound (without its slack) plus half an ulp of the output's dtype. A kernel that makes a mistake also
      rounds while making it, like a correct kernel, by up to what the rule grants a correct kernel (half the
      bound); so a check is certain to see a mistake only when its effect exceeds the bound by that much. This is
      what inputs x100 need: there |S| ~ 1e4, a float32 ulp of S is ~1e-3 and a float32 dot product of 64 terms is
      off by several (the rule's S term is one ulp of sum_d |scale Q_id K_jd|, ~5e-3), so lse + 0.01 is a few S
      roundings, and on saturated (one-hot) rows the exact dq is itself that small. A larger effect is a miss.
  (e) an effect that vanishes with the inputs: VANISHES names the (mistake, case condition) and the reason, and the
      mistake's effect is, for every output, at most REACH times the rule's whole bound (its slack included) plus
      half an ulp of the output's dtype. With one key, scale x 1.05 moves lse by 5% of S and dv by 5% of S times
      dO (P = exp(1.05 S - L) = exp(0.05 S)): on a draw where |S| is small, the move is within the bound's 1e-5
      slack (lse) or within the 16-bit rounding of P, which puts P back to exactly 1 (dv). Under the causal mask at
      Nk = 64 t + 1 keys, dropping the last tile drops the single key Nk - 1, which only the last query sees: every
      output moves by that one weight, about 1 / Nk, less on draws where its score is low. On every other draw the
      check must catch it.
A miss is reported with the bounds, the mistake's effect in float64 and the rounding terms.

A positive control runs in every draw: the correct stage and the correct ring pass the check, and the test's own
copy of stage 00 (the one the algorithm mistakes are made in) reproduces stage 00 bit for bit.

Speed: the check is a pure function of the inputs, so the tolerance pieces it computes (oracle, yardsticks, first-
order S terms, the bounds) are memoised within one draw and shared by all the mistakes of that draw; check_forward and
check_backward themselves run unchanged for every mistake. Seeds: each draw's inputs come from
make_inputs(seed=[the run's base seed (pytest --seed N / ATTN_SEED, see tests/conftest.py), case, dtype, scale,
draw]); every message carries that seed.
"""

import numpy as np
import pytest

from stages import naive, ring
from stages.common import bfloat16, cast, check_backward, check_forward, make_inputs, resolve_scale, tolerance
from stages.common.verify import backward_start
from tests.conftest import CASES, _base_seed

# "The same answer in float64": max |a - b| <= EXACT * (1 + max |b|). Far below any bound of the rule (its slack
# alone is 1e-5), and above float64's own rounding at inputs x100 (|S| ~ 1e4).
EXACT = 1e-9
DRAWS = 50
# Exemption (d): a kernel that makes a mistake also rounds while making it, as a correct kernel does: its output is
# within its own rounding (at most half the bound: what the rule grants a correct kernel) of the wrong exact answer.
# So the check is certain to catch a mistake only when the mistake's exact effect exceeds the bound by that much:
# effect > 1.5 x bound. Below REACH x bound a listed mistake may pass, and the test proves per draw that it is below.
REACH = 1.5
TILE = 64  # Bc of the kernels: the key tile the "last key tile dropped" mistake skips
SCALES = (1.0, 100.0)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}

# Every case of the case list, at inputs x1 AND x100 (the list's own x100 rows are the same shapes: deduplicated).
SHAPES = list(dict.fromkeys(c[:6] for c in CASES))


def _shape_id(s):
    return f"B{s[0]}H{s[1]}-q{s[2]}k{s[3]}-d{s[4]}-{'causal' if s[5] else 'full'}"


# Cases run with fewer than DRAWS draws, and why (measured on a 2-core CPU, OpenBLAS on one thread). Nothing else is
# reduced: every mistake, dtype, input scale, layout of the draws and the positive control run on these cases too.
_COST = ("one draw pushes every mistake through the float64 check and the simulated ring: {} s per dtype, input "
         "scale and direction; 50 draws would take hours on a CPU")
FEWER_DRAWS = {
    (1, 1, 1000, 1000, 64, True): (2, _COST.format("2-5")),
    (1, 1, 1000, 999, 64, False): (2, _COST.format("2-5")),
    (1, 1, 4097, 130, 64, False): (2, _COST.format("2-4")),
    (1, 1, 4097, 4097, 64, True): (1, _COST.format("13-70")),
}

# The ring is the same check_forward / check_backward on the ring's outputs; it runs on the cases with Nq, Nk <=
# RING_MAX (the simulated ring at 4097 queries costs minutes a draw on a CPU). Its mistakes run in the first
# RING_DRAWS draws of a case: the draws alternate layout (2) and rank count (3), so 6 draws cover every pair; the
# correct ring (the positive control) runs in every draw.
RING_MAX = 1000
RING_DRAWS = 6

# (mistake, condition) -> reason. A mistake is exempt on a case only where the condition holds AND the test shows
# that the wrong stage (the wrong ring), run in float64, gives the correct one's answer there, draw by draw; where it
# does not (e.g. the zigzag ring at Nq = Nk = 1 shows a padded key to a diagonal shifted by +1), the check must catch
# it as any other mistake.
# (mistake, input scale) -> reason: where a miss is allowed when, in that very draw, the mistake's effect on the exact
# answer (max |wrong - right|, both in float64) is at most the rule's first-order rounding term for every output
# (tolerance.forward_s_terms / backward_s_terms: the largest change float32 / 16-bit rounding alone can make on these
# inputs). Such a mistake is indistinguishable from a correct kernel's rounding, so no rule that passes every correct
# kernel can catch it; a larger effect is a miss.
# (mistake, dtype, input scale) -> reason: where a miss is allowed when, in that very draw, the mistake's effect on
# the exact answer is, for every output, at most the error the rule grants a correct attention in that dtype (the
# larger of the yardstick's measured error and the rounding term). A larger effect is a miss.
_X100 = "at inputs x100 (|S| ~ 1e4) float32 rounds S by ~5e-3 (one ulp of sum_d |scale Q_id K_jd|, several in a " \
        "kernel's order): "
X100_REASONS = {
    "lse + 0.01": _X100 + "lse is known to that precision, and 0.01 is two such roundings",
    "reads lse + 0.01": _X100 + "P = exp(S - lse) is off by 0.01 relative, what an S rounded by 0.01 gives",
    "dq = 0": _X100 + "softmax rows are saturated (one-hot), so dS = P (dP - D) and the exact dq are as small as "
              "the rounding of S and of dP - D makes them",
    "dq row swapped": _X100 + "on saturated rows the exact dq is rounding-sized, and swapping two such rows moves it "
                      "by less than the rounding reach",
    "causal +1": _X100 + "the key one past the diagonal has weight exp(S_ij - L_i), negligible unless it is the "
                 "row's largest score",
    "causal -1": _X100 + "the diagonal key dropped has weight exp(S_ii - L_i), negligible unless it is the row's "
                 "largest score",
    "last key tile dropped": "at x100 only the row's largest score carries weight: a dropped tile without it is "
                             "invisible",
}
BELOW_PRECISION = {
    ("last key tile dropped", dtype, 1.0): "at N = 4097 the last tile of 64 keys is a single key, seen by one query "
                                           "(causal) among 4097: its share of the gradients is below 16-bit precision"
    for dtype in ("float16", "bfloat16")
} | {
    ("reads lse + 0.01", "bfloat16", 1.0): "bfloat16 keeps 8 bits: the P = exp(S - L) a kernel rounds before dV += "
                                           "P^T dO and dS = P (dP - D) is off by up to 2^-9 relative, and lse + 0.01 "
                                           "scales P by 0.99, about 2.5 such roundings; over ~1000 keys the rounding "
                                           "the rule grants dq, dk, dv is as large as that 1% move",
} | {
    (name, dtype, 100.0): why for name, why in X100_REASONS.items() for dtype in DTYPES
}

BELOW_ROUNDING = {
    ("lse + 0.01", 100.0): "at inputs x100 |S| ~ 1e4, where one ulp of a 16-bit kernel's float32 S (accumulated by "
                           "truncation) is ~2e-3 and the rule's lse term ~1e-2: 0.01 on lse is within rounding",
    ("reads lse + 0.01", 100.0): "P = exp(S - lse) x (1 - 0.01) is what an S rounded by 0.01 gives: at x100 the "
                                 "S rounding term is that large",
    ("dq = 0", 100.0): "at x100 softmax rows are saturated (one-hot): dS = P (dP - D) ~ 0 and the true dq is as "
                       "small as the rounding of dP - D and of S can make it",
    ("dq row swapped", 100.0): "at x100 every softmax row can be saturated (one-hot): the true dq is then rounding "
                               "noise in every row, and swapping two rows moves it by less than the rounding terms",
    ("last key tile dropped", 1.0): "at 4097 keys the dropped tile is the single key 4096, which only the last "
                                    "queries see, among 4097 keys: its weight is below 16-bit rounding of P",
    ("last key tile dropped", 100.0): "as at x1, the single key 4096 among 4097",
}

# (mistake, condition) -> reason: exemption (e), where the mistake's effect is proportional to a quantity of the
# inputs that a draw can make arbitrarily small; it applies only to draws whose effect is within REACH x the bound
# (slack included) plus half an ulp of the output.
_ONE_KEY_D = ("with one key o = v, so dP = dO v^T equals D = rowsum(dO o) and the true dS = P (dP - D) is 0; "
              "reading o' for o moves dS by D - D', with D' = rowsum(dO o'): ")
VANISHES = {
    ("scale x 1.05", "one key"): "with one key P = 1 for any scale, so only lse (by 5% of S) and, through "
                                 "P = exp(0.05 S) in the backward, dv (by 5% of S times dO) move; S ~ N(0, 1) is "
                                 "below 0.01 in about 1% of draws, and then the move is within the bound or the "
                                 "16-bit rounding of P",
    ("reads o x 1.1", "one key"): _ONE_KEY_D + "0.1 D plus the 16-bit rounding of 1.1 o summed over d terms, which "
                                  "cancel on draws where D is small (D is a sum of 64 products of either sign)",
    ("reads o = 0", "one key"): _ONE_KEY_D + "D itself, as small as a draw makes it",
    ("last key tile dropped", "causal, last tile of one key"): "the last tile is the single key Nk - 1, and under "
        "the causal mask only the last query sees it: o, lse and dq of that one row and the key's own dk, dv move by "
        "its weight P = exp(S - L), about 1 / Nk, and by less on draws where S is below the row's typical score",
}

CONDITIONS = {
    "one query": lambda Nq, Nk, causal: Nq == 1,
    "one key": lambda Nq, Nk, causal: Nk == 1,
    "Nq = Nk = 1, causal": lambda Nq, Nk, causal: causal and Nq == 1 and Nk == 1,
    "not causal": lambda Nq, Nk, causal: not causal,
    "causal, last tile of one key": lambda Nq, Nk, causal: causal and Nk > TILE and Nk % TILE == 1,
}
CANNOT_SHOW = {
    ("o row swapped", "one query"): "o has a single row: there is no other row to swap it with",
    ("dq row swapped", "one query"): "dq has a single row: there is no other row to swap it with",
    ("dq = 0", "one key"): "with one key P = 1 exactly, so dS = P (dP - D) = 0 and the true dq is 0",
    ("causal +1", "Nq = Nk = 1, causal"): "the only query already sees the only key; there is no key j = i + 1",
    ("causal +1", "not causal"): "the mistake exists only where there is a causal diagonal",
    ("causal -1", "not causal"): "the mistake exists only where there is a causal diagonal",
    ("causal -1", "Nq = Nk = 1, causal"): "the ring plans a one-row block as a non-causal call, so the wrong ring "
                                           "is the right ring (the stage, whose only query then sees no key, must be "
                                           "caught)",
}


# ----------------------------------------------------------------------------- stage 00, with an explicit mask
def _round(x, dtype):
    return cast(cast(x, dtype), x.dtype)


def _cd(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _visible(Nq, Nk, causal, shift=0, drop_tile=False):
    """(Nq, Nk) bool: which keys each query sees, with the diagonal shifted and/or the last key tile dropped."""
    i, j = np.arange(Nq)[:, None], np.arange(Nk)[None, :]
    vis = (j <= i + (Nk - Nq) + shift) if causal else np.ones((Nq, Nk), dtype=bool)
    if drop_tile:
        vis = vis & (j < TILE * ((Nk - 1) // TILE))
    return vis


def _scores(q, k, vis, scale):
    cd = _cd(q.dtype)
    s = np.matmul(cast(q, cd), cast(k, cd).swapaxes(-1, -2)) * scale
    return np.where(vis, s, -np.inf)


def _forward(q, k, v, vis, scale, out_dtype):
    """naive.forward, line for line, with the mask `vis` in place of the causal mask."""
    cd = _cd(q.dtype)
    s = _scores(q, k, vis, scale)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.matmul(_round(p, q.dtype), cast(v, cd))
    o = o / np.where(l == 0, 1.0, l)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    return cast(o, out_dtype), lse.astype(cd)


def _backward(q, k, v, o, lse, do, vis, scale, out_dtype):
    """naive.backward, line for line, with the mask `vis` in place of the causal mask."""
    cd = _cd(q.dtype)
    s = _scores(q, k, vis, scale)
    lse = cast(lse, cd)[..., None]
    lse = np.where(np.isneginf(lse), np.inf, lse)
    p = np.exp(s - lse)
    do_c, o_c = cast(do, cd), cast(o, cd)
    dv = np.matmul(_round(p, q.dtype).swapaxes(-1, -2), do_c)
    dp = np.matmul(do_c, cast(v, cd).swapaxes(-1, -2))
    d_i = (do_c * o_c).sum(axis=-1, keepdims=True)
    ds = _round(p * (dp - d_i), q.dtype)
    dq = scale * np.matmul(ds, cast(k, cd))
    dk = scale * np.matmul(ds.swapaxes(-1, -2), cast(q, cd))
    return cast(dq, out_dtype), cast(dk, out_dtype), cast(dv, out_dtype)


# ----------------------------------------------------------------------------- the mistakes
class Mistake:
    """name; direction "forward" or "backward"; either `output` (a function of the correct outputs and a
    numpy Generator) or algorithm parameters: shift, factor (on the scale), drop_tile, o_read, lse_add."""

    def __init__(self, name, direction, output=None, shift=0, factor=1.0, drop_tile=False, o_read=None,
                 lse_add=0.0):
        self.name, self.direction, self.output = name, direction, output
        self.shift, self.factor, self.drop_tile, self.o_read, self.lse_add = shift, factor, drop_tile, o_read, lse_add

    def __repr__(self):
        return self.name


def _row_pair(x, rng, gap=0.0):
    """(b, h, i, j) with rows i != j of x[b, h] really different, chosen at random; None if there is no such pair.
    Really different: by more than gap (the check's reach for this output, see _swap_rows) and by more than 1e-3 of
    x's largest entry. x is the oracle's output, so rounding noise never makes two rows 'different' (e.g. a one-key
    row's dq, 0 exactly, against a fully masked row's)."""
    x = np.asarray(x, dtype=np.float64)
    B, H, N, _ = x.shape
    if N < 2:
        return None
    tol = max(gap, 1e-3 * float(np.abs(x).max(initial=0.0)))
    cands = [(b, h, i) for b in range(B) for h in range(H) for i in range(N)]
    for t in rng.permutation(len(cands)):
        b, h, i = cands[t]
        others = np.flatnonzero((np.abs(x[b, h] - x[b, h, i]) > tol).any(axis=-1))
        if len(others):
            return b, h, i, int(rng.choice(others))
    return None


def _swap_rows(x, rng, like=None):
    """x with two rows swapped. like: (the oracle's output, gap): the rows are chosen (by rng) among rows of the
    oracle's output that differ by more than gap, REACH x the check's bound plus half an ulp (the grant of
    exemption (e)): two rows closer than that swap into an answer as close to the right one as the rule allows a
    correct kernel to be. If no two rows differ that much, x is returned as it is (exemption (a) then applies)."""
    ref, gap = (x, 0.0) if like is None else like
    pair = _row_pair(ref, rng, gap)
    x = x.copy()
    if pair is not None:
        b, h, i, j = pair
        x[b, h, [i, j]] = x[b, h, [j, i]]
    return x


def _one_nan(x, rng):
    x = x.copy()
    x[tuple(int(rng.integers(n)) for n in x.shape)] = np.nan
    return x


def _times(x, f):
    return cast(x.astype(np.float64) * f, x.dtype)


def _nan_in_a_grad(g, rng, like=None):
    g = list(g)
    n = int(rng.integers(3))
    g[n] = _one_nan(g[n], rng)
    return tuple(g)


FORWARD_MISTAKES = [
    Mistake("o = 0", "forward", output=lambda out, rng, like=None: (np.zeros_like(out[0]), out[1])),
    Mistake("o x 1.1", "forward", output=lambda out, rng, like=None: (_times(out[0], 1.1), out[1])),
    Mistake("o row swapped", "forward",
            output=lambda out, rng, like=None: (_swap_rows(out[0], rng, like and like[0]), out[1])),
    Mistake("lse + 0.01", "forward",
            output=lambda out, rng, like=None: (out[0], out[1] + out[1].dtype.type(0.01))),
    Mistake("one NaN in o", "forward", output=lambda out, rng, like=None: (_one_nan(out[0], rng), out[1])),
    Mistake("causal +1", "forward", shift=1),
    Mistake("causal -1", "forward", shift=-1),
    Mistake("scale x 1.05", "forward", factor=1.05),
    Mistake("last key tile dropped", "forward", drop_tile=True),
]
BACKWARD_MISTAKES = [
    Mistake("reads o = 0", "backward", o_read=0.0),
    Mistake("reads o x 1.1", "backward", o_read=1.1),
    Mistake("dq row swapped", "backward",
            output=lambda g, rng, like=None: (_swap_rows(g[0], rng, like and like[0]), g[1], g[2])),
    Mistake("reads lse + 0.01", "backward", lse_add=0.01),
    Mistake("dq = 0", "backward", output=lambda g, rng, like=None: (np.zeros_like(g[0]), g[1], g[2])),
    Mistake("dk and dv swapped", "backward", output=lambda g, rng, like=None: (g[0], g[2], g[1])),
    Mistake("one NaN in a gradient", "backward", output=_nan_in_a_grad),
    Mistake("causal +1", "backward", shift=1),
    Mistake("causal -1", "backward", shift=-1),
    Mistake("scale x 1.05", "backward", factor=1.05),
    Mistake("last key tile dropped", "backward", drop_tile=True),
]


def _alg_forward(m, out_dtype=None):
    """A forward (stage API, or a ring block when out_dtype is given) that makes algorithm mistake m."""
    def fwd(q, k, v, *, causal=False, scale=None, version=None, **block_kw):  # block_kw: the ring's out_dtype
        vis = _visible(q.shape[2], k.shape[2], causal, m.shift, m.drop_tile)
        return _forward(q, k, v, vis, resolve_scale(scale, q.shape[-1]) * m.factor,
                        block_kw.get("out_dtype") or out_dtype or q.dtype)
    return fwd


def _alg_backward(m, out_dtype=None):
    def bwd(q, k, v, o, lse, do, *, causal=False, scale=None, version=None, **block_kw):
        vis = _visible(q.shape[2], k.shape[2], causal, m.shift, m.drop_tile)
        if m.o_read is not None:
            o = _times(o, m.o_read)
        if m.lse_add:
            lse = lse + lse.dtype.type(m.lse_add)
        return _backward(q, k, v, o, lse, do, vis, resolve_scale(scale, q.shape[-1]) * m.factor,
                         block_kw.get("out_dtype") or out_dtype or q.dtype)
    return bwd


def _partial(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _exempt(m, Nq, Nk, causal):
    return [(cond, why) for (name, cond), why in CANNOT_SHOW.items()
            if name == m.name and CONDITIONS[cond](Nq, Nk, causal)]


# ----------------------------------------------------------------------------- memoised tolerance pieces
class _Memo:
    """Memoises the check's tolerance pieces (pure functions of q, k, v, do, causal, scale) within one draw."""

    NAMES = ("oracle", "forward_yardsticks", "forward_s_terms", "backward_yardsticks", "backward_s_terms")

    def __init__(self, monkeypatch):
        self.store = {}
        for name in self.NAMES:
            monkeypatch.setattr(tolerance, name, self._wrap(name, getattr(tolerance, name)))
        monkeypatch.setattr(tolerance, "bounds", self._bounds(tolerance.bounds))

    def _wrap(self, name, f):
        def g(*args, causal=False, scale=None):
            # backward_yardsticks gets o, lse made afresh from the (memoised) oracle: key on q, k, v, do only
            keyed = args[:3] + (args[-1],) if len(args) > 3 else args
            key = (name, tuple(id(a) for a in keyed), bool(causal), scale)
            if key not in self.store:
                self.store[key] = (f(*args, causal=causal, scale=scale), keyed)  # keep the arrays alive
            return self.store[key][0]
        return g

    def _bounds(self, f):
        def g(refs, yardsticks, terms=None, **kw):
            # every check of the draw passes the same (memoised) arrays: key on their identities
            keyed = (tuple(refs), tuple(tuple(y) for y in yardsticks), tuple(terms or ()))
            key = ("bounds", tuple(id(a) for a in keyed[0]), tuple(tuple(id(a) for a in y) for y in keyed[1]),
                   tuple(id(a) for a in keyed[2]), tuple(sorted(kw.items())))
            if key not in self.store:
                self.store[key] = (f(refs, yardsticks, terms, **kw), keyed)
            return self.store[key][0]
        return g

    def clear(self):
        self.store.clear()


# ----------------------------------------------------------------------------- the test
def _openblas():
    """(set, get) of the OpenBLAS thread count numpy uses, or None where it cannot be found."""
    import ctypes

    try:
        paths = sorted({line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()})
    except OSError:
        return None
    for path in paths:
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            setter, getter = (getattr(lib, f"{prefix}_{op}_num_threads{suffix}", None) for op in ("set", "get"))
            if setter is not None and getter is not None:
                return setter, getter
    return None


@pytest.fixture(autouse=True, scope="module")
def one_blas_thread():
    """OpenBLAS on one thread: its worker threads spin, and next to the ring's rank threads on a small CPU they make
    the many small matmuls here ~6x slower (measured: 10 s -> 1.8 s for one case). Every output and every bound
    is computed under the same setting."""
    blas = _openblas()
    if blas is None:
        yield
        return
    setter, getter = blas
    before = getter()
    setter(1)
    yield
    setter(before)


def _catches(fn, what):
    """(caught, detail): run one check; caught means it raised AssertionError."""
    try:
        errs = fn()
    except AssertionError as e:
        return True, str(e)
    return False, f"{what} passed: errors {errs}"


def _yardstick_errors(direction, q, k, v, do, causal):
    """{output: the yardstick's own error against the float64 oracle} (the larger of its two summation orders):
    how far a correct attention computed in this dtype is from the exact answer on these inputs."""
    if direction == "forward":
        refs = tolerance.oracle(q, k, v, causal=causal, scale=None)
        ys = tolerance.forward_yardsticks(q, k, v, causal=causal, scale=None)
        names = tolerance.NAMES_FORWARD
    else:
        o64, lse64, *refs = tolerance.oracle(q, k, v, do, causal=causal, scale=None)
        o_in, lse_in = backward_start(q, o64, lse64)
        ys = tolerance.backward_yardsticks(q, k, v, o_in, lse_in, do, causal=causal, scale=None)
        names = tolerance.NAMES_BACKWARD
    return {n: max(tolerance.max_error(y[i], refs[i]) for y in ys) for i, n in enumerate(names)}


def _bounds_text(direction, q, k, v, do, causal):
    """The bounds the check applied (from the memoised pieces), for a miss's report."""
    if direction == "forward":
        refs = tolerance.oracle(q, k, v, causal=causal, scale=None)
        b = tolerance.bounds(refs, tolerance.forward_yardsticks(q, k, v, causal=causal, scale=None),
                             tolerance.forward_s_terms(q, k, v, causal=causal, scale=None))
        return dict(zip(tolerance.NAMES_FORWARD, b))
    o64, lse64, *refs = tolerance.oracle(q, k, v, do, causal=causal, scale=None)
    o_in, lse_in = backward_start(q, o64, lse64)
    b = tolerance.bounds(refs, tolerance.backward_yardsticks(q, k, v, o_in, lse_in, do, causal=causal, scale=None),
                         tolerance.backward_s_terms(q, k, v, o_in, do, causal=causal, scale=None))
    return dict(zip(tolerance.NAMES_BACKWARD, b))


def _granted(direction, q, k, v, do, causal, with_slack=False):
    """{output: REACH x the bound without its slack (with_slack: with it), plus half an ulp of the output's dtype at
    its largest exact entry}: how large a mistake's exact effect can be and the wrong kernel still pass, see
    REACH."""
    b = _bounds_text(direction, q, k, v, do, causal)
    if direction == "forward":
        refs = tolerance.oracle(q, k, v, causal=causal, scale=None)
        dts = (q.dtype, np.float32)
    else:
        refs = tolerance.oracle(q, k, v, do, causal=causal, scale=None)[2:]
        dts = (q.dtype,) * 3
    eps = {n: float(_finfo(dt).eps) for n, dt in zip(b, dts)}
    top = {n: float(np.max(np.abs(r), initial=0.0, where=np.isfinite(r))) for n, r in zip(b, refs)}
    slack = 0.0 if with_slack else tolerance.SLACK
    return {n: REACH * (b[n] - slack) + 0.5 * eps[n] * top[n] for n in b}


def _finfo(dt):
    import ml_dtypes
    return ml_dtypes.finfo(dt) if np.dtype(dt) == bfloat16 else np.finfo(dt)


def _max_rel_diff(a, b):
    a, b = (np.asarray(x, dtype=np.float64) for x in (a, b))
    same = (a == b)  # -inf == -inf
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(a - b))
    return float(np.nan_to_num(d, nan=np.inf).max(initial=0.0)) / (1.0 + float(np.abs(b[np.isfinite(b)]).max(
        initial=0.0)))


def _exemption_holds(m, q, k, v, do, causal, rng, ring_kw, whos):
    """The wrong stage (the wrong ring) in float64 gives what the correct stage (the correct ring) gives in float64:
    [(who, relative difference)] for any output where they differ by more than EXACT; who in whos."""
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    if m.direction == "forward":
        right = {"stage": lambda: naive.forward(q, k, v, causal=causal),
                 "ring": lambda: ring.forward(q, k, v, causal=causal, block="naive", **ring_kw)}
        right = {who: f() for who, f in right.items() if who in whos}
        if m.output is not None:
            wrong = {who: m.output(out, rng) for who, out in right.items()}
        else:
            wrong = {"stage": lambda: _alg_forward(m)(q, k, v, causal=causal),
                     "ring": lambda: _ring_with(m, "forward", q, k, v, causal, ring_kw)}
            wrong = {who: f() for who, f in wrong.items() if who in whos}
    else:
        o64, lse64 = tolerance.oracle(q, k, v, causal=causal)
        right = {"stage": lambda: naive.backward(q, k, v, o64, lse64, do, causal=causal),
                 "ring": lambda: ring.backward(q, k, v, o64, lse64, do, causal=causal, block="naive", **ring_kw)}
        right = {who: f() for who, f in right.items() if who in whos}
        if m.output is not None:
            wrong = {who: m.output(out, rng) for who, out in right.items()}
        else:
            wrong = {"stage": lambda: _alg_backward(m)(q, k, v, o64, lse64, do, causal=causal),
                     "ring": lambda: _ring_with(m, "backward", q, k, v, causal, ring_kw, o64, lse64, do)}
            wrong = {who: f() for who, f in wrong.items() if who in whos}
    bad = []
    for who in whos:
        for x, r in zip(wrong[who], right[who]):
            d = _max_rel_diff(x, r)
            if not d <= EXACT:
                bad.append((who, d))
    return bad


def _effect(m, q, k, v, do, causal, rng_seed, refs, who="stage", ring_kw=None):
    """{output: max |wrong - right|, both in float64}: how much the mistake (as stage 00, or the ring of stage 00
    blocks, makes it) changes the exact answer. A backward that reads o x 1.1 reads it in the inputs' dtype (o x 1.1
    rounded), and its effect is that of the o it reads."""
    dtype = q.dtype
    q, k, v, do = (x.astype(np.float64) for x in (q, k, v, do))
    if m.direction == "forward":
        right = naive.forward(q, k, v, causal=causal)
        names = tolerance.NAMES_FORWARD
    else:
        o64, lse64 = tolerance.oracle(q, k, v, causal=causal)
        right = naive.backward(q, k, v, o64, lse64, do, causal=causal)
        names = tolerance.NAMES_BACKWARD
        o_read = o64
        if m.o_read is not None:  # the o such a kernel reads, exactly: o x factor rounded to the inputs' dtype
            o_read = cast(_times(cast(o64, dtype), m.o_read), np.float64)
            m = Mistake(m.name, "backward", shift=m.shift, factor=m.factor, drop_tile=m.drop_tile, lse_add=m.lse_add)
    if m.output is not None:  # the same choice of rows / position as in the draw (chosen on `refs`)
        wrong = m.output(right, np.random.default_rng(rng_seed), like=refs)
    elif who == "ring":  # the ring places the mistake inside its blocks: its own effect
        wrong = (_ring_with(m, "forward", q, k, v, causal, ring_kw) if m.direction == "forward" else
                 _ring_with(m, "backward", q, k, v, causal, ring_kw, o_read, lse64, do))
    elif m.direction == "forward":
        wrong = _alg_forward(m)(q, k, v, causal=causal)
    else:
        wrong = _alg_backward(m)(q, k, v, o_read, lse64, do, causal=causal)
    return {n: tolerance.max_error(x, r) for n, x, r in zip(names, wrong, right)}


def _g(d):
    return {n: float(f"{x:.3g}") for n, x in d.items()}


def _same_bytes(a, b):
    """Two output tuples are equal bit for bit (dtype, shape and bytes)."""
    a, b = tuple(np.asarray(x) for x in a), tuple(np.asarray(x) for x in b)
    return len(a) == len(b) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                    for x, y in zip(a, b))


def _rounding_terms(direction, q, k, v, do, causal):
    """{output: the largest entry of the rule's first-order rounding term} (tolerance.forward_s_terms /
    backward_s_terms, the memoised ones the check used): the largest change float32 / 16-bit rounding alone can
    make to that output on these inputs."""
    if direction == "forward":
        t = tolerance.forward_s_terms(q, k, v, causal=causal, scale=None)
        names = tolerance.NAMES_FORWARD
    else:
        o64, _ = tolerance.oracle(q, k, v, causal=causal, scale=None)
        t = tolerance.backward_s_terms(q, k, v, o64, do, causal=causal, scale=None)
        names = tolerance.NAMES_BACKWARD
    return {n: float(np.max(x, initial=0.0)) for n, x in zip(names, t)}


def _ring_with(m, direction, q, k, v, causal, ring_kw, o=None, lse=None, do=None):
    """The ring with every block making algorithm mistake m."""
    saved = ring.BLOCKS["naive"]
    pd = _partial(q.dtype)
    ring.BLOCKS["naive"] = (_alg_forward(m, pd), _alg_backward(m, pd))
    try:
        if direction == "forward":
            return ring.forward(q, k, v, causal=causal, block="naive", **ring_kw)
        return ring.backward(q, k, v, o, lse, do, causal=causal, block="naive", **ring_kw)
    finally:
        ring.BLOCKS["naive"] = saved


def _draws(shape):
    return FEWER_DRAWS.get(shape, (DRAWS, ""))[0]


def _ring_here(Nq, Nk):
    return Nq <= RING_MAX and Nk <= RING_MAX


@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("scale_in", SCALES, ids=[f"x{s:g}" for s in SCALES])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=[_shape_id(s) for s in SHAPES])
def test_checks_catch_mistakes(shape, dtype_name, scale_in, direction, monkeypatch, request):
    B, H, Nq, Nk, D, causal = shape
    base_seed = _base_seed(request.config)
    dtype = DTYPES[dtype_name]
    memo = _Memo(monkeypatch)
    mistakes = FORWARD_MISTAKES if direction == "forward" else BACKWARD_MISTAKES
    check = check_forward if direction == "forward" else check_backward
    misses, failures = [], []
    for d in range(_draws(shape)):
        memo.clear()
        seed = [base_seed, SHAPES.index(shape), list(DTYPES).index(dtype_name), SCALES.index(scale_in), d]
        where = f"[{_shape_id(shape)} {dtype_name} x{scale_in:g} {direction}, seed {seed}]"
        q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, scale=scale_in, grad=True, seed=seed)
        ring_kw = dict(layout=ring.LAYOUTS[d % 2], ranks=2 + d % 3)
        args = (q, k, v) if direction == "forward" else (q, k, v, do)
        ring_here = _ring_here(Nq, Nk)
        ring_mistakes = ring_here and d < RING_DRAWS

        # positive control: the correct stage and ring pass; the test's copy of stage 00 is stage 00 bit for bit
        if direction == "forward":
            good = naive.forward(q, k, v, causal=causal)
            good_ring = ring.forward(q, k, v, causal=causal, block="naive", **ring_kw) if ring_here else None
            mine = _alg_forward(Mistake("none", "forward"))(q, k, v, causal=causal)
        else:
            o64, lse64 = tolerance.oracle(q, k, v, causal=causal)
            o_in, lse_in = backward_start(q, o64, lse64)
            good = naive.backward(q, k, v, o_in, lse_in, do, causal=causal)
            good_ring = (ring.backward(q, k, v, o_in, lse_in, do, causal=causal, block="naive", **ring_kw)
                         if ring_here else None)
            mine = _alg_backward(Mistake("none", "backward"))(q, k, v, o_in, lse_in, do, causal=causal)
        for x, y in zip(mine, good):
            if not np.array_equal(x, y, equal_nan=True):
                failures.append(f"{where} the test's copy of stage 00 differs from stage 00")
        for who, out, kw in (("stage", good, {}), ("ring", good_ring, ring_kw))[:2 if ring_here else 1]:
            try:
                check(lambda *a, causal, scale, _o=out, **_: _o, *args, causal=causal, **kw)
            except AssertionError as e:
                failures.append(f"{where} control: the correct {who} {kw or ''} fails the check: {e}")

        # every mistake, in the stage and in the ring
        for n_m, m in enumerate(mistakes):
            rng = np.random.default_rng(seed + [1, n_m])
            whos = {"stage", "ring"} if ring_mistakes else {"stage"}
            exempt, shows = _exempt(m, Nq, Nk, causal), whos
            if exempt:  # exempt only where proven: where the mistake does change the answer, it must be caught
                bad = _exemption_holds(m, q, k, v, do, causal, np.random.default_rng(seed + [2]), ring_kw, whos)
                shows = {who for who, _ in bad}
                if not shows:
                    continue
            if m.output is not None:
                refs = (tolerance.oracle(q, k, v, causal=causal) if direction == "forward"
                        else tolerance.oracle(q, k, v, do, causal=causal)[2:])  # rows to swap: chosen on these
                gaps = _granted(direction, q, k, v, do, causal, with_slack=True)
                refs = [(r, gaps[n]) for n, r in zip(gaps, refs)]  # (oracle output, the check's reach on it)
                stage_out = m.output(good, rng, like=refs)
                ring_out = (m.output(good_ring, np.random.default_rng(seed + [1, n_m]), like=refs)
                            if "ring" in shows else None)
                runs = [("stage", lambda *a, _o=stage_out, **_: _o, {}),
                        ("ring", lambda *a, _o=ring_out, **_: _o, ring_kw)]
            else:
                stage_fn = _alg_forward(m) if direction == "forward" else _alg_backward(m)

                def ring_fn(q, k, v, *rest, causal, scale, _m=m, **kw):
                    return _ring_with(_m, direction, q, k, v, causal, kw, *rest)
                runs = [("stage", stage_fn, {}), ("ring", ring_fn, ring_kw)]
            for who, fn, kw in runs:
                if who not in shows:
                    continue
                seen = []

                def recorded(*a, _fn=fn, **kw_):
                    seen.append(_fn(*a, **kw_))
                    return seen[-1]
                caught, detail = _catches(lambda: check(recorded, *args, causal=causal, **kw), who)
                if caught:
                    continue
                # (a) the wrong outputs are the correct ones, bit for bit: no check whatsoever could see the mistake
                if seen and _same_bytes(seen[-1], good if who == "stage" else good_ring):
                    continue
                effect = _effect(m, q, k, v, do, causal, seed + [1, n_m], refs if m.output else None, who, kw)
                terms = _rounding_terms(direction, q, k, v, do, causal)
                # (c) the mistake moves the exact answer no more than rounding alone may move it on these inputs
                if (m.name, scale_in) in BELOW_ROUNDING and all(effect[n] <= terms[n] for n in effect):
                    continue
                # (d) the mistake moves the exact answer no more than the rule lets a correct attention be off it
                if (m.name, dtype_name, scale_in) in BELOW_PRECISION:
                    grant = _granted(direction, q, k, v, do, causal)
                    if all(effect[n] <= grant[n] for n in effect):
                        continue
                # (e) an effect proportional to something this draw made small, within the bound or the rounding
                if any(name == m.name and CONDITIONS[c](Nq, Nk, causal) for name, c in VANISHES):
                    grant = _granted(direction, q, k, v, do, causal, with_slack=True)
                    if all(effect[n] <= grant[n] for n in effect):
                        continue
                misses.append(f"{where} {who} {kw or ''}: mistake {m.name!r} NOT caught: {detail}; bounds "
                              f"{_bounds_text(direction, q, k, v, do, causal)}; effect in float64 "
                              f"{_g(effect)}; first-order rounding terms {_g(terms)}")
    assert not failures, "\n".join(failures)
    assert not misses, f"{len(misses)} misses:\n" + "\n".join(misses)


def test_exemption_tables_name_real_mistakes():
    """Every exemption names a mistake of this file and a known case condition (a typo would exempt nothing and
    hide nothing, but it would also leave its reason claiming an exemption that never applies)."""
    names = {m.name for m in FORWARD_MISTAKES + BACKWARD_MISTAKES}
    for name, cond in list(CANNOT_SHOW) + list(VANISHES):
        assert name in names and cond in CONDITIONS, (name, cond)
    for name, _ in BELOW_ROUNDING:
        assert name in names, name
    for name, dtype, scale in BELOW_PRECISION:
        assert name in names and dtype in DTYPES and scale in SCALES, (name, dtype, scale)
