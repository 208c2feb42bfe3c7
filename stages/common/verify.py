"""Checks shared by tests and run.py: a stage against the fp64 oracle by the tolerance rule.

    errs = check_forward(flash_v1.forward, q, k, v, causal=True)        # raises if out of tolerance
    errs = check_backward(flash_v1.backward, q, k, v, do, causal=True)

The oracle is stage 00 in float64; the bound is 2x the error of stage 00 run in the inputs'
own dtype, plus 1e-5 (see tolerance.py).
"""
import os

import numpy as np

from .inputs import cast, to_numpy
from .tolerance import assert_within_tolerance, max_error

# When True, launchers fill outputs with NaN before the kernel runs, so an element the
# kernel forgets to write fails every check. Tests switch it on; ATTN_POISON=1 does too.
POISON_OUTPUTS = os.environ.get("ATTN_POISON", "0") == "1"


def empty(xp, shape, dtype):
    """An output buffer: uninitialised, or NaN-poisoned when POISON_OUTPUTS is on."""
    if POISON_OUTPUTS:
        return cast(xp.full(shape, np.nan, dtype=np.float32), dtype)
    return xp.empty(shape, dtype=dtype)


def _naive():
    from stages import naive  # late import: stages.common must not depend on a stage at import

    return naive


def _host64(*arrays):
    return [to_numpy(a).astype(np.float64) for a in arrays]


def _host(*arrays):
    return [to_numpy(a) for a in arrays]


def _finite_against(lows, refs):
    with np.errstate(all="ignore"):
        return all(np.isfinite(max_error(low, ref)) for low, ref in zip(lows, refs))


def naive_forward_yardstick(q, k, v, refs, *, causal=False, scale=None):
    """Stage 00 in the inputs' dtype: the tolerance rule's yardstick (o, lse), host arrays.

    float16 naive attention rounds S to float16, which overflows (inf) once |S| > 65504 (inputs x100):
    its error is then infinite and the rule would pass anything. There the yardstick keeps S in float32
    (round_scores=False), as every FlashAttention kernel does; P and O are still rounded. Runs where the
    inputs are (numpy or CuPy)."""
    naive = _naive()
    with np.errstate(over="ignore", invalid="ignore"):
        lows = naive.forward(q, k, v, causal=causal, scale=scale)
    if not _finite_against(lows, refs):
        lows = naive.forward(q, k, v, causal=causal, scale=scale, round_scores=False)
    return lows


def naive_backward_yardstick(q, k, v, o, lse, do, refs, *, causal=False, scale=None):
    """Stage 00's backward in the inputs' dtype (dq, dk, dv); S in float32 where float16 S overflows, as in
    naive_forward_yardstick."""
    naive = _naive()
    args = (q, k, v, o, lse, do)
    with np.errstate(over="ignore", invalid="ignore"):
        lows = naive.backward(*args, causal=causal, scale=scale)
    if not _finite_against(lows, refs):
        lows = naive.backward(*args, causal=causal, scale=scale, round_scores=False)
    return lows


def check_forward(forward, q, k, v, *, causal=False, scale=None, **kw):
    """Run forward(q, k, v, **kw) and check o and lse; return {"o": err, "lse": err}."""
    naive = _naive()
    o, lse = forward(q, k, v, causal=causal, scale=scale, **kw)
    if tuple(o.shape) != tuple(q.shape) or tuple(lse.shape) != tuple(q.shape[:3]):
        raise AssertionError(f"forward returned shapes o {o.shape}, lse {lse.shape} for q {q.shape}")
    if o.dtype != q.dtype or lse.dtype != np.float32:
        raise AssertionError(f"forward returned dtypes o {o.dtype}, lse {lse.dtype}; expected {q.dtype}, float32")
    o_ref, lse_ref = naive.forward(*_host64(q, k, v), causal=causal, scale=scale)  # fp64 oracle
    o_low, lse_low = naive_forward_yardstick(*_host(q, k, v), (o_ref, lse_ref), causal=causal, scale=scale)
    return {
        "o": assert_within_tolerance("o", o, o_ref, o_low),
        "lse": assert_within_tolerance("lse", lse, lse_ref, lse_low),
    }


def check_backward(backward, q, k, v, do, *, causal=False, scale=None, **kw):
    """Run backward from the oracle's o and lse (cast to the inputs' dtype) and check dq, dk, dv."""
    naive = _naive()
    q64, k64, v64, do64 = _host64(q, k, v, do)
    o64, lse64 = naive.forward(q64, k64, v64, causal=causal, scale=scale)
    xp_o = cast(o64, q.dtype) if isinstance(q, np.ndarray) else _to_device(cast(o64, q.dtype))
    xp_lse = lse64.astype(np.float32) if isinstance(q, np.ndarray) else _to_device(lse64.astype(np.float32))
    grads = backward(q, k, v, xp_o, xp_lse, do, causal=causal, scale=scale, **kw)
    refs = naive.backward(q64, k64, v64, o64, lse64, do64, causal=causal, scale=scale)
    lows = naive_backward_yardstick(*_host(q, k, v), cast(o64, q.dtype), lse64.astype(np.float32), to_numpy(do), refs,
                                    causal=causal, scale=scale)
    errs = {}
    for name, g, ref, low, like in zip(("dq", "dk", "dv"), grads, refs, lows, (q, k, v)):
        if tuple(g.shape) != tuple(like.shape) or g.dtype != like.dtype:
            raise AssertionError(f"{name}: got {g.shape} {g.dtype}, expected {like.shape} {like.dtype}")
        errs[name] = assert_within_tolerance(name, g, ref, low)
    return errs


def _to_device(a):
    import cupy

    return cupy.asarray(a)
