"""Random inputs and dtype helpers (bfloat16 comes from ml_dtypes on numpy and CuPy alike).

Reproducible draws: every random input comes from one generator, `rng()`. It starts from a fresh random
seed, or from the environment variable ATTN_SEED; `seed_everything(n)` restarts it (the test suite does so
before every test, from `pytest --seed N`, and prints the seed of a failing test so it can be replayed).
"""
import os
import zlib

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


_STATE = {"seed": None, "rng": None}


def base_seed():
    """The seed the current draws started from (ATTN_SEED, or a fresh one chosen on first use)."""
    if _STATE["seed"] is None:
        env = os.environ.get("ATTN_SEED")
        seed_everything(int(env) if env else int(np.random.SeedSequence().entropy % 2**32))
    return _STATE["seed"]


def seed_everything(seed, name=""):
    """Restart the shared generator from `seed` (mixed with `name`, e.g. a test's id, so each test has its own
    stream and replays alone). Returns the seed."""
    _STATE["seed"] = int(seed)
    _STATE["rng"] = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    return _STATE["seed"]


def rng():
    """The shared generator every random draw uses."""
    base_seed()
    return _STATE["rng"]


def make_inputs(B, H, Nq, Nk, D, *, dtype=np.float32, xp=np, seed=None, scale=1.0, grad=False):
    """Random q, k, v (and do if grad) of shape (B, H, N, D), drawn in float64 then cast.

    scale multiplies the inputs (scale=100 gives huge logits: the no-overflow check); do stays at unit scale.
    seed=None draws from the shared generator rng() (fresh every call, replayable from its seed).
    """
    gen = rng() if seed is None else np.random.default_rng(seed)
    shapes = [(B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, D)] + ([(B, H, Nq, D)] if grad else [])
    out = []
    for n, s in enumerate(shapes):
        a = cast(gen.standard_normal(s) * (scale if n < 3 else 1.0), dtype)  # (B, H, N, D) on the host
        out.append(xp.asarray(a) if xp is not np else a)
    array_module(*out)
    return tuple(out)
