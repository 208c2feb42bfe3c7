"""The one API refuses what it cannot mean, at every public entry point, with an error that says what it takes.

scale: a finite positive number (an int or a float, Python's or numpy's); a string ('0.1'), a bool (True is 1 to
Python, never a scale) or NaN is an error, not a silent conversion. The variants' numbers alike: softcap and
dropout_p, and ALiBi's slopes, which must be finite real numbers (a NaN slope turns every score of its head NaN).
Every entry point goes through the shared checks (stages/common/checks.py and variants.check), so each case runs on
all of them: stages 00-03 (forward, backward and the packed varlen pair), the ring's one-process API, and stage 06's
backward mirror (the part of stage 06 that runs without a GPU).
"""
import numpy as np
import pytest

from stages import flash_v1, flash_v2, flash_v2_backward, naive, ring
from stages.common import make_inputs
from stages.hopper import backward_mirror

B, H, N, D = 1, 2, 16, 64
CU = np.array([0, 7, 16])  # two packed sequences of 7 and 9 tokens


def _batch():
    q, k, v, do = make_inputs(B, H, N, N, D, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v)
    return q, k, v, o, lse, do


def _packed():
    q, k, v, do = (x[0].swapaxes(0, 1).copy() for x in make_inputs(B, H, N, N, D, dtype=np.float32, grad=True))
    o, lse = naive.forward_varlen(q, k, v, CU, CU)
    return q, k, v, o, lse, do


def _fwd(fn, packed=False, **fixed):
    def call(**kw):
        q, k, v = (_packed() if packed else _batch())[:3]
        return fn(q, k, v, *((CU, CU) if packed else ()), **fixed, **kw)
    return call


def _bwd(fn, packed=False, **fixed):
    def call(**kw):
        return fn(*(_packed() if packed else _batch()), *((CU, CU) if packed else ()), **fixed, **kw)
    return call


# Every public entry point a learner calls with numpy arrays. VARIANTS: those that take the variants' options.
ENTRY_POINTS = {
    "naive.forward": _fwd(naive.forward),
    "naive.backward": _bwd(naive.backward),
    "naive.forward_varlen": _fwd(naive.forward_varlen, packed=True),
    "naive.backward_varlen": _bwd(naive.backward_varlen, packed=True),
    "flash_v1.forward": _fwd(flash_v1.forward),
    "flash_v1.backward": _bwd(flash_v1.backward),
    "flash_v2.forward": _fwd(flash_v2.forward),
    "flash_v2.forward_varlen": _fwd(flash_v2.forward_varlen, packed=True),
    "flash_v2_backward.backward": _bwd(flash_v2_backward.backward),
    "flash_v2_backward.backward_varlen": _bwd(flash_v2_backward.backward_varlen, packed=True),
    "ring.forward": _fwd(ring.forward, ranks=2),
    "ring.backward": _bwd(ring.backward, ranks=2),
    "hopper.backward_mirror.backward": _bwd(backward_mirror.backward),
}
VARIANTS = [name for name in ENTRY_POINTS if not name.startswith(("flash_v1", "hopper"))]


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_runs_its_plain_call(entry):
    """The calls below differ from this one by one bad option: this one must run, so each refusal is the option's."""
    out = ENTRY_POINTS[entry](causal=True, scale=0.125)
    assert all(np.isfinite(x).all() for x in out)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("scale,error", [
    ("0.1", TypeError), (True, TypeError), (np.bool_(True), TypeError), ([0.1], TypeError),
    (float("nan"), ValueError), (float("inf"), ValueError), (0.0, ValueError), (-0.125, ValueError),
], ids=["str", "bool", "numpy-bool", "list", "nan", "inf", "zero", "negative"])
def test_scale_must_be_a_finite_positive_number(entry, scale, error):
    with pytest.raises(error, match=r"scale must be a finite positive number \(a float or int > 0; None: "
                                    r"1/sqrt\(head_dim\)\), got"):
        ENTRY_POINTS[entry](scale=scale)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("scale", [1, np.float32(0.125), np.float64(0.125), np.int64(1)],
                         ids=["int", "float32", "float64", "int64"])
def test_scale_takes_any_real_number(entry, scale):
    ENTRY_POINTS[entry](scale=scale)


@pytest.mark.parametrize("entry", VARIANTS)
@pytest.mark.parametrize("bad,error,match", [
    (dict(alibi_slopes=np.array([0.5, np.nan])), ValueError, r"alibi_slopes must be finite.*got nan at index \(1,\)"),
    (dict(alibi_slopes=np.array([[np.inf, 0.5]])), ValueError, r"alibi_slopes must be finite.*at index \(0, 0\)"),
    (dict(alibi_slopes=[0.5, -np.inf]), ValueError, r"alibi_slopes must be finite"),
    (dict(alibi_slopes=np.array(["0.5", "0.25"])), TypeError, r"alibi_slopes must hold real numbers"),
    (dict(alibi_slopes=np.array([True, False])), TypeError, r"alibi_slopes must hold real numbers"),
    (dict(softcap="30"), TypeError, r"softcap must be a finite number > 0"),
    (dict(softcap=True), TypeError, r"softcap must be a finite number > 0"),
    (dict(softcap=float("nan")), ValueError, r"softcap must be a finite number > 0"),
    (dict(dropout_p="0.1"), TypeError, r"dropout_p must be a number in \[0, 1\)"),
    (dict(dropout_p=True), TypeError, r"dropout_p must be a number in \[0, 1\)"),
    (dict(dropout_p=float("nan")), ValueError, r"dropout_p must be in \[0, 1\)"),
], ids=["slope-nan", "slope-inf", "slope-list-inf", "slope-str", "slope-bool", "softcap-str", "softcap-bool",
        "softcap-nan", "p-str", "p-bool", "p-nan"])
def test_variant_options_must_be_finite_numbers(entry, bad, error, match):
    with pytest.raises(error, match=match):
        ENTRY_POINTS[entry](**bad)


@pytest.mark.parametrize("entry", VARIANTS)
def test_finite_slopes_run(entry):
    """The slope checks pass what they should: a list, float32, float64, one slope per head or per (batch, head)."""
    for slopes in ([0.5, 0.25], np.array([0.5, 0.25], np.float32), np.array([[0.5, 0.0]])):
        out = ENTRY_POINTS[entry](alibi_slopes=slopes)
        assert all(np.isfinite(x).all() for x in out)


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_causal_must_be_a_bool(entry):
    with pytest.raises(TypeError, match=r"causal must be True or False, got 2"):
        ENTRY_POINTS[entry](causal=2)


def test_the_hopper_backward_mirror_checks_its_arrays():
    """Stage 06's backward mirror takes (B, H, N, D) arrays as every stage does: a 3-D q is an error naming its rank,
    not a broadcasting error from deep inside the tile loop."""
    q, k, v, o, lse, do = _batch()
    with pytest.raises(ValueError, match=r"backward_mirror.backward: q has shape \(2, 16, 64\) \(rank 3\)"):
        backward_mirror.backward(q[0], k, v, o, lse, do)
    with pytest.raises(ValueError, match=r"backward_mirror.backward: lse has shape \(1, 2, 15\)"):
        backward_mirror.backward(q, k, v, o, lse[..., 1:], do)
