"""The tolerance rule: one rule, in one place, for the tests, every run.py, the benchmarks and the ring.

Each output is checked row by row: o, lse and dq per query row (b, h, i), dk and dv per key row (b, h, j).

    err_row(x) = max over the row of |x - x_oracle|        x_oracle: stage 00 in float64
    x passes   iff  for every row:  err_row(x) <= FACTOR * max(Y_row, A_row) + SLACK      (FACTOR = 2, SLACK = 1e-5)

    Y_row  the yardstick's own error in the row, in two summation orders of the head dim (natural and reversed: the
           columns of q and k permuted alike, the same Q K^T, other roundings);
    A_row  the largest, over the row's entries, of  first_order + u_out |x_oracle| + G * magnitude  (below).

NaN never passes, and an entry that is -inf in the oracle (the lse of a row that sees no key) must be -inf. A row
that is ill-conditioned (two nearly tied scores at large logits) widens only its own bound. For the backward the
oracle is stage 00 in float64 from the o and lse the backward is given (verify.backward_start rounds the exact ones
to the inputs' dtype and to float32): their rounding is the start's, not the backward's.

The reference. Stage 00 (naive attention) is both the oracle (in float64) and the yardstick (in the inputs' dtype).
stages.common imports no stage: stage 00 hands its forward, backward and scores to register_reference() when it is
imported, and the rule reads them from there (reference() says what to import when nothing is registered).

The yardstick is naive attention (stage 00) computed the way the kernels compute:
  float32 inputs:        everything in float32;
  float16 / bfloat16:    matmuls accumulated in float32, S and dP kept in float32, and only P, dS and the
                         outputs rounded to 16 bits (what a tensor-core kernel feeds to its 16-bit matmuls and
                         returns). Rounding S to 16 bits instead would make the yardstick's own error as large
                         as the output at large logits, and the rule would then pass o = 0.

Why Y alone is not enough. FlashAttention's own tests bound a kernel's error by twice the error of a reference
computed in the same precision. Taken row by row, one yardstick's error is a sample: in a row where its roundings
happen to cancel it is near zero, while a correct kernel's are not. Three kinds of a-priori knowledge make the
bound of every row hold on its own:

  first_order: the roundings the softmax amplifies, to first order: the sums S_ij = scale Q_i . K_j (through exp)
    and dP_ij - D_i (two sums of the same products on a one-hot row, which nearly cancel), each landing up to
    LAMBDA u sqrt(W) off whatever the kernel's summation order (W: the mean over orders of the sum of its squared
    partial sums), carried through the softmax to o, lse, dq, dk and dv. stages/common/rounding.py derives it.
  u_out |x_oracle|: the output's own rounding, half an ulp of its dtype (u_out = 2^-11 float16, 2^-8 bfloat16,
    2^-24 float32): a kernel's value off the oracle's by e rounds to within e + u_out |x| of it, to the far side of
    the oracle's value where e crosses a midpoint, which the yardstick's roundings need not show in the row (a row
    with a handful of large entries, whose roundings happen to be small, would otherwise bound a 16-bit output below
    half an ulp).
  G * magnitude: everything else (the accumulation of P V, dS K, dS^T Q, P^T dO; exp, log, the normalisation; the
    16-bit roundings of P and dS) rounds relative to the magnitude of what is summed:
        o: sum_j (P_ij + d P_ij) |V_jd|,   lse: |L_i| + 1 (L_i = m_i + log l_i rounds relative to |L_i|, and a
        relative error of l_i is an absolute one of log l_i),   dq: scale sum_j (|dS_ij| + d dS_ij) |K_jd|,
        dk: scale sum_i (|dS_ij| + d dS_ij) |Q_id|,   dv: sum_i (P_ij + d P_ij) |dO_id|.
    G is how large the yardstick's own such error is per unit of magnitude, at its worst over every entry of the
    output and both orders: G = max (|y - y_oracle| - first_order - u_out |x_oracle| - SLACK)+ / magnitude. It
    carries the yardstick's worst row to every row, scaled by that row's own magnitude.

FACTOR 2 is the room FlashAttention's rule gives a kernel over the yardstick (other orders, the online softmax's
rescaling, tiles), on all of it. Nothing else widens the bound: no factor per dtype, no count chosen by failure rates;
everything is a function of the inputs.

What the rule catches, and what no rule that passes correct kernels could, is measured: dev/catch_rates.py feeds the
real checks correct stages and wrong ones at inputs x1, x10 and x100 (results/catch_rates.csv; the tables in
README.md and docs/DESIGN.md are generated from it), and tests/test_checks_catch_mistakes.py holds the checks to it.
dev/check_margins.py measures the correct GPU kernels' largest error / bound.
"""
from typing import Callable, NamedTuple

import numpy as np

from . import rounding
from .inputs import to_numpy
from .memo import last_call
from .rounding import Terms, host_options

SLACK = 1e-5
FACTOR = 2.0
NAMES_FORWARD = ("o", "lse")
NAMES_BACKWARD = ("dq", "dk", "dv")


def errors(x, ref):
    """|x - ref| entry by entry in float64: 0 where both are the same infinity (the -inf lse of a row that sees no
    key), infinite where x is NaN or only one side is infinite."""
    x = to_numpy(x).astype(np.float64)
    ref = to_numpy(ref).astype(np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}")
    same_inf = np.isinf(ref) & (x == ref)
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    return np.where(np.isnan(diff), np.inf, diff)  # NaN in x, or inf - inf where only one side is infinite


def rows(x):
    """The largest entry of each row: over the last axis of a (B, H, N, D) array (a query row of o or dq, a key row
    of dk or dv); an array of another rank (lse, (B, H, N)) is its own rows."""
    x = np.asarray(x)
    if x.ndim == 4:
        return x.max(axis=-1, initial=0.0)
    return x


def row_errors(x, ref):
    """max |x - ref| of each row (rows())."""
    return rows(errors(x, ref))


def max_error(x, ref):
    """max |x - ref| in float64; infinite where x is NaN or an infinity disagrees with ref."""
    e = errors(x, ref)
    return float(e.max()) if e.size else 0.0


def worst_row(x, ref, bound):
    """(error, bound, row index) of the row with the largest error / bound (bound: per row, or one number for all
    rows); a row with bound 0 counts as 0 / 0 = 0 when its error is 0, else as infinite."""
    err = row_errors(x, ref)
    b = np.broadcast_to(np.asarray(bound, dtype=np.float64), err.shape)
    if err.size == 0:
        return 0.0, float(np.max(b, initial=0.0)), ()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / b)
    i = np.unravel_index(int(np.argmax(ratio)), err.shape)
    return float(err[i]), float(b[i]), tuple(int(x) for x in i)


class Reference(NamedTuple):
    """What the rule compares with and measures by: stage 00's forward(q, k, v, *, causal, scale, **opts) -> (o, lse),
    backward(q, k, v, o, lse, do, *, causal, scale, **opts) -> (dq, dk, dv) and scores(q, k, scale, opts, xp) -> S,
    in float64 for float64 inputs (the oracle) and as the kernels compute for the others (the yardstick)."""
    forward: Callable
    backward: Callable
    scores: Callable


_REFERENCE = []  # [Reference] once stage 00 is imported


def register_reference(forward, backward, scores):
    """Stage 00 (stages/00_naive/__init__.py) hands the rule its naive attention when it is imported."""
    _REFERENCE[:] = [Reference(forward, backward, scores)]


def reference():
    """The registered Reference; an error that says what to import when there is none."""
    if not _REFERENCE:
        raise RuntimeError("the tolerance rule measures against stage 00 (naive attention), which is not imported: "
                           "`from stages import naive` first (stage 00 registers itself with "
                           "stages.common.tolerance when imported)")
    return _REFERENCE[0]


def _orders(D):
    """The two summation orders of the head dim the yardstick is evaluated in: natural and reversed."""
    return [np.arange(D), np.arange(D)[::-1]]


@last_call
def oracle(q, k, v, do=None, *, causal=False, scale=None, **opts):
    """Stage 00 in float64 on the host: (o, lse) or, with do, (o, lse, dq, dk, dv). opts: the variant options
    (window, softcap, alibi_slopes, dropout_p, seed; stages/common/variants.py), passed to stage 00."""
    naive = reference()
    q64, k64, v64 = (to_numpy(x).astype(np.float64) for x in (q, k, v))
    opts = host_options(opts)
    o, lse = naive.forward(q64, k64, v64, causal=causal, scale=scale, **opts)
    if do is None:
        return o, lse
    return (o, lse) + naive.backward(q64, k64, v64, o, lse, to_numpy(do).astype(np.float64), causal=causal,
                                     scale=scale, **opts)


def backward_oracle(q, k, v, o, lse, do, *, causal=False, scale=None, **opts):
    """(dq, dk, dv): stage 00's backward in float64 on the host from the o and lse given (the exact gradients a
    backward started from them must compute; their own rounding is no error of that backward)."""
    naive = reference()
    q64, k64, v64, o64, do64 = (to_numpy(x).astype(np.float64) for x in (q, k, v, o, do))
    return naive.backward(q64, k64, v64, o64, to_numpy(lse).astype(np.float64), do64, causal=causal, scale=scale,
                          **host_options(opts))


def forward_yardsticks(q, k, v, *, causal=False, scale=None, yardstick=None, **opts):
    """[(o, lse), ...]: stage 00 in the inputs' dtype (host arrays), one per summation order. yardstick: another
    forward(q, k, v, causal=, scale=, **opts) on host arrays in stage 00's place, for a version whose roundings are
    not the inputs' dtype (stage 06's fp8: fp8.yardstick)."""
    forward = yardstick or reference().forward
    q, k, v = (to_numpy(x) for x in (q, k, v))
    opts = host_options(opts)
    out = []
    for perm in _orders(q.shape[-1]):
        out.append(forward(q[..., perm], k[..., perm], v, causal=causal, scale=scale, **opts))  # same Q K^T
    return out


def backward_yardsticks(q, k, v, o, lse, do, *, causal=False, scale=None, **opts):
    """[(dq, dk, dv), ...]: stage 00's backward in the inputs' dtype from the given o, lse (host arrays), one per
    summation order of S; dq, dk come back in the natural column order."""
    naive = reference()
    q, k, v, o, lse, do = (to_numpy(x) for x in (q, k, v, o, lse, do))
    opts = host_options(opts)
    out = []
    for perm in _orders(q.shape[-1]):
        inv = np.argsort(perm)
        dq, dk, dv = naive.backward(q[..., perm], k[..., perm], v, o, lse, do, causal=causal, scale=scale, **opts)
        out.append((dq[..., inv], dk[..., inv], dv))
    return out


OUTPUT_UNITS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def _output_unit(dtype):
    """The unit roundoff of an output stored in this dtype: |fl(x) - x| <= u |x| (OUTPUT_UNITS)."""
    name = np.dtype(dtype).name
    if name not in OUTPUT_UNITS:
        raise ValueError(f"the tolerance rule knows the rounding of outputs in {', '.join(OUTPUT_UNITS)}, not {name}")
    return OUTPUT_UNITS[name]


def forward_s_terms(q, k, v, *, causal=False, scale=None, **opts):
    """(Terms of o, Terms of lse): the a-priori terms (stages/common/rounding.py) with stage 00's scores."""
    return rounding.forward_s_terms(q, k, v, reference().scores, causal=causal, scale=scale, **opts)


def backward_s_terms(q, k, v, o, do, *, causal=False, scale=None, **opts):
    """(Terms of dq, dk, dv) from the o the backward starts from: the a-priori terms (stages/common/rounding.py)
    with stage 00's scores."""
    return rounding.backward_s_terms(q, k, v, o, do, reference().scores, causal=causal, scale=scale, **opts)


def _plain_rounding(errs, terms, slack):
    """G: the yardstick's largest error beyond its first-order terms and the slack, per unit of magnitude, over
    every entry of the output and both summation orders: max (|y - ref| - first_order - slack)+ / magnitude, over
    entries with magnitude > 0. (An error within the slack, such as a float32 underflow, needs no G.)"""
    g = 0.0
    ok = terms.magnitude > 0
    for e in errs:
        excess = np.maximum(e - terms.first_order - slack, 0.0)
        if ok.any():
            g = max(g, float((excess[ok] / terms.magnitude[ok]).max()))
    return g


def bounds(refs, yardsticks, terms=None, *, factor=FACTOR, slack=SLACK):
    """[bound per row of each output]: factor * max(the yardstick's error in the row, the row's largest
    first_order + G magnitude) + slack (see the module docstring); one number per row (rows()).

    refs: the oracle's outputs; yardsticks: a list of tuples shaped like refs; terms: a tuple of Terms shaped like
    refs (forward_s_terms / backward_s_terms) or None (then the yardstick's row error alone). A yardstick with an
    infinite or NaN error would make the rule pass anything: that is refused."""
    out = []
    for n, ref in enumerate(refs):
        errs = [errors(y[n], ref) for y in yardsticks]
        if any(not np.isfinite(e).all() for e in errs):
            raise ValueError(
                "the tolerance rule's yardstick (naive attention computed as the kernel computes) has an "
                "infinite or NaN error against the oracle, so the rule would pass anything")
        bound = rows(np.max(errs, axis=0))
        if terms is not None:
            # a-priori: the first-order terms and the output's own rounding, half an ulp of its dtype (the
            # yardstick's) at the entry: a kernel's value a little off the oracle's may round to its far side
            known = terms[n].first_order + _output_unit(yardsticks[0][n].dtype) * np.abs(
                np.where(np.isfinite(ref), ref, 0.0))
            g = _plain_rounding(errs, Terms(known, terms[n].magnitude), slack)
            bound = np.maximum(bound, rows(known + g * terms[n].magnitude))
        out.append(factor * bound + slack)
    return out


def tolerance_report(out, oracle_out, yardstick, *, factor=FACTOR, slack=SLACK):
    """(ok, err, bound) of one output against one yardstick output (the rule for a single tensor, without the
    first-order terms), at the row with the largest error / bound."""
    bound = bounds([oracle_out], [(yardstick,)], factor=factor, slack=slack)[0]
    err, b, _ = worst_row(out, oracle_out, bound)
    return bool((row_errors(out, oracle_out) <= bound).all()), err, b


def assert_within(names, outs, refs, bounds_, *, what=""):
    """Assert every row's max error against ref is within its bound (bounds_: per output, an array of one bound per
    row, or one number for every row); return {name: (error, bound)} at each output's row of largest error / bound.
    The message names the tensor, the worst row, its error and its bound."""
    result = {}
    for name, x, ref, bound in zip(names, outs, refs, bounds_):
        err_rows = row_errors(x, ref)
        err, b, row = worst_row(x, ref, bound)
        bad = ~(err_rows <= np.asarray(bound))
        if bad.any():
            raise AssertionError(
                f"{what}{name}: max error {err:.3e} against the fp64 oracle exceeds the bound {b:.3e} in row {row} "
                f"({int(bad.sum())} of {bad.size} rows out of bounds; the rule: {FACTOR:g} x the yardstick's error "
                f"or the rounding terms, + {SLACK:g})")
        result[name] = (err, b)
    return result


def check(names, outs, refs, yardsticks, terms=None, *, what=""):
    """The rule for every output (bounds from the yardsticks and terms); return {name: (error, bound)} at each
    output's worst row."""
    return assert_within(names, outs, refs, bounds(refs, yardsticks, terms), what=what)
