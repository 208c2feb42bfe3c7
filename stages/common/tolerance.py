"""The tolerance rule, from FlashAttention's own tests.

A kernel's max error against the float64 oracle must be at most 2x the error of the
naive attention computed in the kernel's dtype, plus 1e-5. NaN never passes.
An entry that is -inf in the oracle (the lse of a fully masked row) must be -inf.
"""
import numpy as np

from .inputs import to_numpy

SLACK = 1e-5
FACTOR = 2.0


def max_error(x, ref):
    """max |x - ref| in float64; infinite where x is NaN or an infinity disagrees with ref."""
    x = to_numpy(x).astype(np.float64)
    ref = to_numpy(ref).astype(np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}")
    if x.size == 0:
        return 0.0
    if np.isnan(x).any():
        return float("inf")
    same_inf = np.isinf(ref) & (x == ref)  # -inf lse of a fully masked row, on both sides
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)  # inf - inf where only one side is infinite
    return float(diff.max())


def tolerance_report(out, oracle, naive_same_dtype, *, factor=FACTOR, slack=SLACK):
    """(ok, err, bound): err = max_error(out, oracle), bound = factor * naive's error + slack."""
    err = max_error(out, oracle)
    naive_err = max_error(naive_same_dtype, oracle)
    if not np.isfinite(naive_err):
        # e.g. float16 naive attention on large logits: S overflows 65504, its error is inf and the
        # rule would pass anything. Refuse rather than test nothing.
        raise ValueError(
            "the tolerance rule's yardstick (naive attention in the kernel's dtype) has an infinite or NaN "
            "error against the oracle, so the rule would pass anything; use a finite yardstick "
            "(naive attention with scores kept in float32, as tests/test_02_flash_v2.py does)"
        )
    bound = factor * naive_err + slack
    return err <= bound, err, bound


def assert_within_tolerance(name, out, oracle, naive_same_dtype, *, factor=FACTOR, slack=SLACK):
    """Raise AssertionError naming the tensor unless the tolerance rule holds; return the error."""
    ok, err, bound = tolerance_report(out, oracle, naive_same_dtype, factor=factor, slack=slack)
    if not ok:
        raise AssertionError(
            f"{name}: max error {err:.3e} against the fp64 oracle exceeds {factor}x the naive "
            f"same-dtype error + {slack:g} = {bound:.3e}"
        )
    return err
