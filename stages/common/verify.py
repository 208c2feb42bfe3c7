"""Checks shared by tests and run.py: a stage against the fp64 oracle by the tolerance rule.

    errs = check_forward(flash_v1.forward, q, k, v, causal=True)        # raises if a row is out of tolerance
    errs = check_backward(flash_v1.backward, q, k, v, do, causal=True)

The oracle is stage 00 in float64 (for a backward: from the o and lse it is given); the bound, one per row of each
output, is the tolerance rule of tolerance.py. The errors returned are those of each output's worst row (largest
error / bound).
"""
import os

import numpy as np

from . import tolerance
from .inputs import cast
from .memo import last_call

# When True, launchers fill outputs with NaN before the kernel runs, so an element the
# kernel forgets to write fails every check. Tests switch it on; ATTN_POISON=1 does too.
POISON_OUTPUTS = os.environ.get("ATTN_POISON", "0") == "1"


def empty(xp, shape, dtype):
    """An output buffer: uninitialised, or NaN-poisoned when POISON_OUTPUTS is on."""
    if POISON_OUTPUTS:
        return cast(xp.full(shape, np.nan, dtype=np.float32), dtype)
    return xp.empty(shape, dtype=dtype)


def backward_start(q, o64, lse64):
    """What a backward under test starts from: the oracle's o in the inputs' dtype and its lse in float32, on
    the inputs' device."""
    o_in, lse_in = cast(o64, q.dtype), lse64.astype(np.float32)
    if isinstance(q, np.ndarray):
        return o_in, lse_in
    import cupy

    return cupy.asarray(o_in), cupy.asarray(lse_in)


def _check_like(names, outs, likes):
    for name, x, like in zip(names, outs, likes):
        if tuple(x.shape) != tuple(like.shape) or np.dtype(x.dtype) != np.dtype(like.dtype):
            raise AssertionError(f"{name}: got shape {tuple(x.shape)} {x.dtype}, expected {tuple(like.shape)} "
                                 f"{like.dtype}")


def check_forward(forward, q, k, v, *, causal=False, scale=None, opts=None, with_bounds=False, yardstick=None,
                  what="", **kw):
    """Run forward(q, k, v, **opts, **kw) and check o and lse by the tolerance rule, row by row; return {"o": err,
    "lse": err} at each output's worst row ({name: (err, bound)} with_bounds). opts: variant options (window, softcap,
    alibi_slopes, dropout_p, seed), given to the oracle too. yardstick: the yardstick's forward in stage 00's place
    (tolerance.forward_yardsticks); what: the start of the error message."""
    opts = opts or {}
    o, lse = forward(q, k, v, causal=causal, scale=scale, **opts, **kw)
    _check_like(tolerance.NAMES_FORWARD, (o, lse), (q, np.empty(q.shape[:3], np.float32)))
    refs, bounds = forward_rule(q, k, v, causal, scale, opts, yardstick)
    res = tolerance.assert_within(tolerance.NAMES_FORWARD, (o, lse), refs, bounds, what=what)
    return res if with_bounds else {n: e for n, (e, _) in res.items()}


def check_backward(backward, q, k, v, do, *, causal=False, scale=None, opts=None, with_bounds=False, **kw):
    """Run backward from the oracle's o and lse (in the inputs' dtype, backward_start) and check dq, dk, dv by the
    rule, row by row, against the exact gradients from that o and lse; return {name: err} at each output's worst row
    ({name: (err, bound)} with_bounds)."""
    opts = opts or {}
    refs, bounds, (o_in, lse_in) = backward_rule(q, k, v, do, causal, scale, opts)
    grads = backward(q, k, v, o_in, lse_in, do, causal=causal, scale=scale, **opts, **kw)
    _check_like(tolerance.NAMES_BACKWARD, grads, (q, k, v))
    res = tolerance.assert_within(tolerance.NAMES_BACKWARD, grads, refs, bounds)
    return res if with_bounds else {n: e for n, (e, _) in res.items()}


@last_call
def forward_rule(q, k, v, causal, scale, opts, yardstick=None):
    """(refs, bounds) of the forward on these inputs: the oracle's (o, lse) and one bound per row of each
    (tolerance.bounds), remembered for the last inputs, so that checks of several forwards share them."""
    kw = dict(causal=causal, scale=scale, **opts)
    refs = tolerance.oracle(q, k, v, **kw)
    ys = tolerance.forward_yardsticks(q, k, v, yardstick=yardstick, **kw)
    return refs, tolerance.bounds(refs, ys, tolerance.forward_s_terms(q, k, v, **kw))


@last_call
def backward_rule(q, k, v, do, causal, scale, opts):
    """(refs, bounds, start) of the backward on these inputs: the exact (dq, dk, dv) from start, one bound per row
    of each, and start = (o, lse) a backward under test starts from (backward_start); remembered for the last
    inputs."""
    kw = dict(causal=causal, scale=scale, **opts)
    o_in, lse_in = backward_start(q, *tolerance.oracle(q, k, v, **kw))
    refs = tolerance.backward_oracle(q, k, v, o_in, lse_in, do, **kw)
    ys = tolerance.backward_yardsticks(q, k, v, o_in, lse_in, do, **kw)
    return refs, tolerance.bounds(refs, ys, tolerance.backward_s_terms(q, k, v, o_in, do, **kw)), (o_in, lse_in)


def rule(q, k, v, do=None, *, causal=False, scale=None, opts=None):
    """Everything the rule needs for these inputs, computed once: (refs, bounds, start) where refs are the
    oracle's (o, lse[, dq, dk, dv]) (the gradients from start), bounds the matching bounds (one per row), and start =
    (o, lse) a backward under test must start from (backward_start), or None without do. opts: variant options, as
    check_forward takes them."""
    opts = opts or {}
    refs, bounds = forward_rule(q, k, v, causal, scale, opts)
    if do is None:
        return refs, list(bounds), None
    grads, grad_bounds, start = backward_rule(q, k, v, do, causal, scale, opts)
    return (*refs, *grads), [*bounds, *grad_bounds], start


def errors_and_bounds(errs):
    """{name: (err, bound)} as a learner reads it: "o 3.8e-07 (bound 1.2e-06), lse ..." (each output's worst
    row)."""
    return ", ".join(f"{n} {e:.1e} (bound {b:.1e})" for n, (e, b) in errs.items())


def check_outputs(outs, refs, bounds, *, what=""):
    """Assert the rule on outputs computed elsewhere (e.g. gathered from the ranks of a ring), with
    (refs, bounds) from rule(); returns {name: (error, bound)} at each output's worst row."""
    names = (tolerance.NAMES_FORWARD + tolerance.NAMES_BACKWARD)[:len(outs)]
    return tolerance.assert_within(names, outs, refs, bounds, what=what)


def check_varlen(forward_varlen, backward_varlen, q, k, v, do, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                 scale=None, opts=None, **kw):
    """A packed batch (stages/common/varlen.py) checked sequence by sequence: forward_varlen once for the batch,
    then each sequence's rows of o and lse against the rule for that sequence alone (a batch of one); with
    backward_varlen (not None), the backward once from the per-sequence oracle starts, each sequence's dq, dk, dv
    against its rule. Rows of an empty sequence pair must come out as o = 0, lse = -inf, zero gradients."""
    from . import varlen

    opts = dict(opts or {})
    cq, ck = varlen.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    o, lse = forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale, **opts, **kw)
    _check_like(tolerance.NAMES_FORWARD, (o, lse), (q, np.empty((q.shape[1], q.shape[0]), np.float32)))
    seqs = [(cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(cq.size - 1)]
    rules = []
    for a, b, c, d in seqs:
        qs, ks, vs, dos = (varlen.as_batch(x[lo:hi]) for x, lo, hi in ((q, a, b), (k, c, d), (v, c, d), (do, a, b)))
        if b == a or d == c:  # nothing to attend: the definition's zeros and -inf
            rules.append(None)
            tolerance.assert_within(("o",), (varlen.as_batch(o[a:b]),), (np.zeros(qs.shape),), (0.0,),
                                    what=f"varlen sequence rows {a}:{b} with keys {c}:{d}")
            if b > a and not bool((lse[:, a:b] == -np.inf).all()):
                raise AssertionError(f"varlen: rows {a}:{b} see no key but their lse is not -inf")
            continue
        rules.append(rule(qs, ks, vs, dos if backward_varlen is not None else None, causal=causal, scale=scale,
                          opts=opts))
        refs, bounds, _ = rules[-1]
        check_outputs((varlen.as_batch(o[a:b]), lse[None, :, a:b]), refs[:2], bounds[:2],
                      what=f"varlen sequence rows {a}:{b}, keys {c}:{d}")
    if backward_varlen is None:
        return
    xp = np if isinstance(q, np.ndarray) else __import__("cupy")
    o_in, lse_in = xp.zeros_like(o), xp.full(lse.shape, -np.inf, np.float32)
    for (a, b, c, d), r in zip(seqs, rules):
        if r is not None:
            o_in[a:b], lse_in[:, a:b] = r[2][0][0].swapaxes(0, 1), r[2][1][0]
    grads = backward_varlen(q, k, v, o_in, lse_in, do, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale,
                            **opts, **kw)
    _check_like(tolerance.NAMES_BACKWARD, grads, (q, k, v))
    for (a, b, c, d), r in zip(seqs, rules):
        g = [varlen.as_batch(x[lo:hi]) for x, lo, hi in zip(grads, (a, c, c), (b, d, d))]
        what = f"varlen sequence rows {a}:{b}, keys {c}:{d} (backward)"
        if r is None:  # no (query, key) pair: zero gradients
            tolerance.assert_within(tolerance.NAMES_BACKWARD, g, [np.zeros(x.shape) for x in g], (0.0,) * 3,
                                    what=what)
        else:
            tolerance.assert_within(tolerance.NAMES_BACKWARD, g, r[0][2:], r[1][2:], what=what)
