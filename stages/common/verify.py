"""Checks shared by tests and run.py: a stage against the fp64 oracle by the tolerance rule.

    errs = check_forward(flash_v1.forward, q, k, v, causal=True)        # raises if out of tolerance
    errs = check_backward(flash_v1.backward, q, k, v, do, causal=True)

The oracle is stage 00 in float64; the bound is the tolerance rule of tolerance.py.
"""
import os

import numpy as np

from . import tolerance
from .inputs import cast

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


def check_forward(forward, q, k, v, *, causal=False, scale=None, opts=None, **kw):
    """Run forward(q, k, v, **opts, **kw) and check o and lse by the tolerance rule; return {"o": err, "lse": err}.
    opts: variant options (window, softcap, alibi_slopes, dropout_p, seed), given to the oracle too."""
    opts = opts or {}
    o, lse = forward(q, k, v, causal=causal, scale=scale, **opts, **kw)
    _check_like(tolerance.NAMES_FORWARD, (o, lse), (q, np.empty(q.shape[:3], np.float32)))
    refs = tolerance.oracle(q, k, v, causal=causal, scale=scale, **opts)
    ys = tolerance.forward_yardsticks(q, k, v, causal=causal, scale=scale, **opts)
    terms = tolerance.forward_s_terms(q, k, v, causal=causal, scale=scale, **opts)
    res = tolerance.check(tolerance.NAMES_FORWARD, (o, lse), refs, ys, terms)
    return {n: e for n, (e, _) in res.items()}


def check_backward(backward, q, k, v, do, *, causal=False, scale=None, opts=None, **kw):
    """Run backward from the oracle's o and lse (in the inputs' dtype) and check dq, dk, dv by the rule."""
    opts = opts or {}
    o64, lse64, *refs = tolerance.oracle(q, k, v, do, causal=causal, scale=scale, **opts)
    o_in, lse_in = backward_start(q, o64, lse64)
    grads = backward(q, k, v, o_in, lse_in, do, causal=causal, scale=scale, **opts, **kw)
    _check_like(tolerance.NAMES_BACKWARD, grads, (q, k, v))
    ys = tolerance.backward_yardsticks(q, k, v, o_in, lse_in, do, causal=causal, scale=scale, **opts)
    terms = tolerance.backward_s_terms(q, k, v, o_in, do, causal=causal, scale=scale, **opts)
    res = tolerance.check(tolerance.NAMES_BACKWARD, grads, refs, ys, terms)
    return {n: e for n, (e, _) in res.items()}


def rule(q, k, v, do=None, *, causal=False, scale=None, opts=None):
    """Everything the rule needs for these inputs, computed once: (refs, bounds, start) where refs are the
    oracle's (o, lse[, dq, dk, dv]), bounds the matching bounds, and start = (o, lse) a backward under test
    must start from (backward_start), or None without do. opts: variant options, as check_forward takes them."""
    kw = dict(causal=causal, scale=scale, **(opts or {}))
    o64, lse64, *grads = tolerance.oracle(q, k, v, do, **kw)
    bounds = tolerance.bounds((o64, lse64), tolerance.forward_yardsticks(q, k, v, **kw),
                              tolerance.forward_s_terms(q, k, v, **kw))
    if do is None:
        return (o64, lse64), bounds, None
    o_in, lse_in = backward_start(q, o64, lse64)
    bounds += tolerance.bounds(grads, tolerance.backward_yardsticks(q, k, v, o_in, lse_in, do, **kw),
                               tolerance.backward_s_terms(q, k, v, o_in, do, **kw))
    return (o64, lse64, *grads), bounds, (o_in, lse_in)


def check_outputs(outs, refs, bounds, *, what=""):
    """Assert the rule on outputs computed elsewhere (e.g. gathered from the ranks of a ring), with
    (refs, bounds) from rule(); returns {name: (error, bound)}."""
    names = (tolerance.NAMES_FORWARD + tolerance.NAMES_BACKWARD)[:len(outs)]
    return tolerance.assert_within(names, outs, refs, bounds, what=what)
