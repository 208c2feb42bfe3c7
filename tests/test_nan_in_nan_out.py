"""NaN in, NaN out, at every stage: a NaN in q (or in one key of k) makes the rows that see it NaN in o and lse, as
in stage 00. Never -inf: that lse means "this row saw no key", a different and valid answer.

CPU: stage 00, stage 01's mirror and every stage 02 version's mirror. gpu: the same calls through the CUDA kernels.
"""
import numpy as np
import pytest

from stages import flash_v1, flash_v2, naive
from stages.common import bfloat16, make_inputs, to_numpy

RUNS = [("naive", None, np.float32), ("flash_v1", None, np.float32), ("flash_v2", "fp32", np.float32),
        ("flash_v2", "fp32_overlap", np.float32),
        ("flash_v2", "tc", np.float16), ("flash_v2", "tc", bfloat16), ("flash_v2", "pipelined", np.float16),
        ("flash_v2", "pipelined", bfloat16), ("flash_v2", "fp32x3", np.float32)]
IDS = [f"{s}-{v or 'only'}-{np.dtype(d).name}" for s, v, d in RUNS]


def _forward(stage, version):
    if stage == "naive":
        return naive.forward
    if stage == "flash_v1":
        return flash_v1.forward
    return lambda q, k, v, **kw: flash_v2.forward(q, k, v, version=version, **kw)


def _nan_rows(stage, version, dtype, xp):
    """(o, lse) with a NaN in q's row 5 (head 0), and (o, lse) with a NaN in k's key 9 (head 1), causal."""
    fwd = _forward(stage, version)
    q, k, v = make_inputs(1, 2, 40, 40, 64, dtype=dtype, xp=xp, seed=3)
    q_bad, k_bad = q.copy(), k.copy()
    q_bad[0, 0, 5, 3] = np.nan
    k_bad[0, 1, 9, 0] = np.nan
    return ([to_numpy(x).astype(np.float32) for x in fwd(q_bad, k, v, causal=True)],
            [to_numpy(x).astype(np.float32) for x in fwd(q, k_bad, v, causal=True)])


def _check(stage, version, dtype, xp=np):
    (o_q, lse_q), (o_k, lse_k) = _nan_rows(stage, version, dtype, xp)
    assert np.isnan(lse_q[0, 0, 5]) and np.isnan(o_q[0, 0, 5]).all()  # the row whose query is NaN
    assert np.isfinite(lse_q[0, 0, :5]).all() and np.isfinite(lse_q[0, 1]).all()  # the others are untouched
    assert np.isnan(lse_k[0, 1, 9:]).all() and np.isnan(o_k[0, 1, 9:]).all()  # rows that see key 9 (causal: 9 on)
    assert np.isfinite(lse_k[0, 1, :9]).all() and np.isfinite(o_k[0, 1, :9]).all()  # rows before it do not see it
    assert not np.isneginf(lse_q).any() and not np.isneginf(lse_k).any()  # every row saw keys: none is -inf


@pytest.mark.parametrize("stage,version,dtype", RUNS, ids=IDS)
def test_nan_in_nan_out_on_the_cpu(stage, version, dtype):
    _check(stage, version, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("stage,version,dtype", RUNS, ids=IDS)
def test_nan_in_nan_out_on_the_gpu(stage, version, dtype):
    import cupy

    from stages.common import device

    if dtype != np.float32 and not device.device().arch.bf16:
        pytest.skip(f"version {version} needs sm_80+ tensor cores; this GPU is sm_{device.device().arch.cc}")
    _check(stage, version, dtype, cupy)
