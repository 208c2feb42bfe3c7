"""Inputs that start inside an allocation: a C-contiguous CuPy array whose first element is not on a 16-byte boundary,
as flat[1:].reshape(B, H, N, D) makes. The kernels read rows 16 bytes at a time (vector loads, cp.async, tensor maps),
so a row must start on a 16-byte boundary; every launcher hands them such inputs as an aligned copy
(kernels.row_major). Each result is checked by the tolerance rule, as for any other input.

CPU: row_major itself. gpu: every forward and backward version, through its public launcher.
"""
import numpy as np
import pytest

from stages import flash_v2, flash_v2_backward
from stages.common import bfloat16, kernels, make_inputs, verify

FORWARD = [("fp32", np.float32), ("fp32_overlap", np.float32), ("fp32x3", np.float32), ("tc", np.float16),
           ("pipelined", bfloat16)]
BACKWARD = [("fp32", np.float32), ("fp32x3", np.float32), ("tc", np.float16), ("tc", bfloat16)]
HOPPER = [np.float16, bfloat16, np.float32]


def _offset(x):
    """x's values in a C-contiguous CuPy array that starts one element past an allocation's start (CuPy's allocations
    start on 256-byte boundaries), so not on a 16-byte boundary."""
    import cupy

    flat = cupy.empty(x.size + 1, x.dtype)
    flat[1:] = cupy.asarray(x).ravel()
    y = flat[1:].reshape(x.shape)
    assert y.flags.c_contiguous and y.data.ptr % 16
    return y


def _with_offset_o_lse(backward):
    """backward, given o and lse (which the check computes) as offset arrays too."""
    return lambda q, k, v, o, lse, do, **kw: backward(q, k, v, _offset(o), _offset(lse), do, **kw)


def _inputs(dtype, D=64):
    return [_offset(x) for x in make_inputs(2, 3, 77, 130, D, dtype=dtype, grad=True)]


def test_row_major_keeps_aligned_arrays_and_copies_the_rest():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert kernels.row_major(x) is x  # numpy: C-contiguous is all it needs
    t = kernels.row_major(x.transpose(0, 2, 1))
    assert t.flags.c_contiguous and np.array_equal(t, x.transpose(0, 2, 1))


@pytest.mark.gpu
def test_row_major_on_the_gpu():
    import cupy

    x = cupy.arange(24, dtype=cupy.float32).reshape(2, 3, 4)
    assert kernels.row_major(x) is x
    y = _offset(x)
    z = kernels.row_major(y)
    assert z is not y and z.data.ptr % 16 == 0 and bool((z == x).all())


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version,dtype", FORWARD, ids=[f"{v}-{np.dtype(d).name}" for v, d in FORWARD])
def test_forward_of_offset_inputs(version, dtype, causal):
    q, k, v, _ = _inputs(dtype)
    verify.check_forward(flash_v2.forward, q, k, v, causal=causal, version=version)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version,dtype", BACKWARD, ids=[f"{v}-{np.dtype(d).name}" for v, d in BACKWARD])
def test_backward_of_offset_inputs(version, dtype, causal):
    q, k, v, do = _inputs(dtype)
    verify.check_backward(_with_offset_o_lse(flash_v2_backward.backward), q, k, v, do, causal=causal, version=version)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", HOPPER, ids=[np.dtype(d).name for d in HOPPER])
def test_stage_06_of_offset_inputs(dtype, causal):
    """Stage 06 (on an sm_90 GPU; elsewhere it refuses, a skip there): the forward, and for 16 bits the backward."""
    from stages.hopper import flash_v3, flash_v3_backward

    q, k, v, do = _inputs(dtype)
    verify.check_forward(flash_v3.forward, q, k, v, causal=causal)
    if dtype != np.float32:
        verify.check_backward(_with_offset_o_lse(flash_v3_backward.backward), q, k, v, do, causal=causal)
