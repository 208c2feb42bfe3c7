"""Stage 05: checking a hand-written backward by central finite differences (float64, on the CPU).

For a scalar loss f(x), the derivative along one coordinate is, up to O(eps^2),
    df/dx_i ~ (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)
In float64 with eps ~ 1e-6 this agrees with an exact gradient to about 1e-8 relative: a backward that is
wrong anywhere (a missing term, a transposed matrix, a wrong constant) misses by far more.

The layers are checked through the scalar sum(y * dy) with a random dy: its gradient with respect to x is
exactly what the layer's backward returns when handed dy.
"""
import numpy as np


def numerical_grad(f, x, eps=1e-6, index=None):
    """Central differences of the scalar f() with respect to the array x (changed in place and restored).

    index: the flat indices to probe (default: every element); the others are left NaN."""
    g = np.full(x.shape, np.nan)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size) if index is None else index:
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def rel_error(a, b):
    """max |a - b| / max(max |b|, tiny): one number for how far an analytic gradient is from a numerical one."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mask = ~np.isnan(b)
    return float(np.max(np.abs(a[mask] - b[mask])) / max(float(np.max(np.abs(b[mask]))), 1e-30))


def probe(x, n, rng):
    """n random flat indices of x (all of them if it has no more than n): a cheap, seeded sample."""
    return np.arange(x.size) if x.size <= n else rng.choice(x.size, size=n, replace=False)
