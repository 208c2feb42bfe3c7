"""Random inputs and dtype helpers (bfloat16 comes from ml_dtypes on numpy and CuPy alike)."""
import numpy as np

from .checks import array_module

try:
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    bfloat16 = None


def to_numpy(x):
    """Any array (numpy or CuPy) as a numpy array."""
    if isinstance(x, np.ndarray):
        return x
    return x.get()


def cast(x, dtype):
    """x.astype(dtype) that also works for bfloat16 on CuPy (through float32)."""
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x
    return x.astype(np.float32, copy=False).astype(dtype) if dtype == bfloat16 else x.astype(dtype)


def make_inputs(B, H, Nq, Nk, D, *, dtype=np.float32, xp=np, seed=None, scale=1.0, grad=False):
    """Fresh random q, k, v (and do if grad) of shape (B, H, N, D), drawn in float64 then cast.

    scale multiplies the inputs (scale=100 gives huge logits: the no-overflow check).
    A seed of None draws fresh inputs every call, as the tests require.
    """
    rng = np.random.default_rng(seed)
    shapes = [(B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, D)] + ([(B, H, Nq, D)] if grad else [])
    out = []
    for s in shapes:
        a = cast(rng.standard_normal(s) * scale, dtype)  # (B, H, N, D) on the host
        out.append(xp.asarray(a) if xp is not np else a)
    array_module(*out)
    return tuple(out)
