"""Input validation shared by every stage: errors that say what is supported."""
import functools
import math
import numbers

import numpy as np

try:  # bfloat16 for numpy and CuPy (CuPy >= 14 understands ml_dtypes.bfloat16)
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is in requirements.txt
    _BF16 = None

SUPPORTED_FLOAT_DTYPES = tuple(
    d for d in (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), _BF16) if d is not None
)


def array_module(*arrays):
    """numpy for numpy arrays, cupy for CuPy arrays; a clear error for anything else or a mix."""
    kinds = {_kind(type(a)) for a in arrays}
    if len(kinds) > 1:
        raise TypeError(
            "mixed numpy and CuPy arrays: put every input on one device "
            "(cupy.asarray(x) to move to the GPU, cupy.asnumpy(x) to move to the CPU)"
        )
    if kinds == {"cupy"}:
        import cupy

        return cupy
    return np


@functools.lru_cache(maxsize=None)
def _kind(cls):
    """"numpy" or "cupy" for an array class (cached per class: the launchers call this on every input)."""
    if issubclass(cls, np.ndarray):
        return "numpy"
    if cls.__module__.split(".")[0] == "cupy":
        return "cupy"
    raise TypeError(
        f"expected numpy or CuPy arrays, got {cls.__module__}.{cls.__name__}; "
        "convert with numpy.asarray(x) (CPU) or cupy.asarray(x) (GPU)"
    )


def _dtype_names(dtypes):
    return ", ".join(np.dtype(d).name for d in dtypes)


def check_attention_inputs(q, k, v, *, dtypes=SUPPORTED_FLOAT_DTYPES, head_dims=None, where="attention",
                           gqa=False):
    """Check q, k, v of shape (B, H, N, D); return (xp, B, H, Nq, Nk, D).

    dtypes: the dtypes this implementation supports; head_dims: the supported head dims (None: any);
    gqa: k and v may have fewer heads than q (grouped-query attention; variants.check says how many).
    """
    xp = array_module(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(
                f"{where}: {name} has shape {tuple(t.shape)} (rank {t.ndim}); expected rank 4, "
                "(batch, heads, seq, head_dim) as in torch scaled_dot_product_attention"
            )
    B, H, Nq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{where}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"{where}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch and head_dim "
            "(the sequence length may differ, and with grouped-query attention the heads)"
        )
    if k.shape[1] != H and not gqa:
        raise ValueError(
            f"{where}: q has {H} heads and k, v have {k.shape[1]}; this implementation needs the same number "
            "(grouped-query attention, fewer k/v heads, is in stage 00 and the tile mirrors)"
        )
    Nk = k.shape[2]
    if min(B, H, D) == 0 or Nq == 0 or Nk == 0:
        raise ValueError(f"{where}: empty input (q {tuple(q.shape)}, k {tuple(k.shape)}); every dim must be >= 1")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{where}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in dtypes:  # np.dtype == np.dtype or == a scalar type
        raise TypeError(f"{where}: dtype {q.dtype} is not supported; use one of: {_dtype_names(dtypes)}")
    if head_dims is not None and D not in head_dims:
        raise ValueError(
            f"{where}: head_dim {D} is not supported; use one of {sorted(head_dims)}"
        )
    return xp, B, H, Nq, Nk, D


def check_backward_inputs(q, k, v, o, lse, do, *, where="attention backward", **kw):
    """check_attention_inputs, plus o and do shaped like q and lse shaped (B, H, Nq) float32."""
    xp, B, H, Nq, Nk, D = check_attention_inputs(q, k, v, where=where, **kw)
    if array_module(q, o, lse, do) is not xp:  # pragma: no cover - array_module raises first
        raise TypeError(f"{where}: all arrays must be on one device")
    for name, t in (("o", o), ("do", do)):
        if tuple(t.shape) != tuple(q.shape):
            raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}; expected q's shape {tuple(q.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{where}: {name} has dtype {t.dtype}; expected q's dtype {q.dtype}")
    if tuple(lse.shape) != (B, H, Nq):
        raise ValueError(f"{where}: lse has shape {tuple(lse.shape)}; expected (B, H, Nq) = {(B, H, Nq)}")
    if lse.dtype != np.float32 and lse.dtype != np.float64:
        raise TypeError(f"{where}: lse has dtype {lse.dtype}; expected float32 (as forward returns it)")
    return xp, B, H, Nq, Nk, D


LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x log2 e); the kernels fold it into the scale (one MUFU.EX2)


def real_number(x, name, where="attention", what="a real number"):
    """x as a Python float when it is a real number: an int or a float, Python's or numpy's. A bool (True is 1 to
    Python, but never a meaningful scale or probability here), a string, None or an array is a TypeError that names
    `name` and says what it takes (`what`)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{where}: {name} must be {what}, got {x!r} ({type(x).__name__})")
    return float(x)


def resolve_scale(scale, D, where="attention"):
    """The softmax scale of S = scale Q K^T: 1/sqrt(head_dim) unless given; must be a finite positive number."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    what = "a finite positive number (a float or int > 0; None: 1/sqrt(head_dim))"
    scale = real_number(scale, "scale", where, what)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{where}: scale must be {what}, got {scale}")
    return scale


def check_causal(causal, where="attention"):
    """causal must be a bool (True/False, or numpy's bool); anything else (a string such as "no") is an error."""
    if isinstance(causal, (bool, np.bool_)) or (isinstance(causal, (int, np.integer)) and causal in (0, 1)):
        return bool(causal)
    raise TypeError(f"{where}: causal must be True or False, got {causal!r} ({type(causal).__name__})")


def check_out_dtype(out_dtype, dtype, where="attention"):
    """The dtype of a kernel's outputs: the inputs' dtype (None), or float32 (a block's unrounded partial result,
    for the ring's merge). Returns a numpy dtype."""
    if out_dtype is None:
        return np.dtype(dtype)
    try:
        out = np.dtype(out_dtype)
    except TypeError:
        out = None
    if out not in (np.dtype(dtype), np.dtype(np.float32)):
        raise TypeError(f"{where}: out_dtype {out_dtype!r} is not supported; use None (the inputs' dtype, "
                        f"{np.dtype(dtype).name}) or numpy.float32")
    return out
