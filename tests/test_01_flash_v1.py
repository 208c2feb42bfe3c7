"""Stage 01: FlashAttention v1 (fp32). The numpy tile mirror against the fp64 oracle (CPU), the kernels
compiled with NVRTC for sm_80 and sm_90 (CPU), and the kernels against the oracle and the mirror (gpu).
Outputs are NaN-poisoned before every launch (conftest's autouse fixture)."""
import numpy as np
import pytest

from stages import flash_v1, naive
from stages.common import check_backward, check_forward, compile_only, make_inputs
from stages.common import kernels as kernel_loader
from tests.conftest import CASE_IDS, CASES, case_inputs, with_head_dim

HEAD_DIMS = (32, 64, 128)  # every CASES row runs at each of these head dims
ODD_HEAD_DIMS = (1, 16, 80, 96)  # supported too (any 1..128): a smaller case list
# (case with its head dim replaced, id): the full case list (tests/conftest.py) at every head dim above
CASES_BY_D = with_head_dim(CASES, CASE_IDS, HEAD_DIMS)


def _check(q, k, v, do, causal):
    """flash_v1 forward and backward (mirror for numpy, kernels for CuPy) by the tolerance rule."""
    errs = check_forward(flash_v1.forward, q, k, v, causal=causal)
    errs.update(check_backward(flash_v1.backward, q, k, v, do, causal=causal))
    assert all(np.isfinite(e) for e in errs.values())
    return errs


# ---------------------------------------------------------------- the mirror (CPU, CI)


@pytest.mark.parametrize("case", [c for c, _ in CASES_BY_D], ids=[i for _, i in CASES_BY_D])
def test_mirror_against_oracle(case):
    (q, k, v, do), causal = case_inputs(case)
    _check(q, k, v, do, causal)


@pytest.mark.parametrize("D", ODD_HEAD_DIMS)
def test_mirror_odd_head_dims(D):
    q, k, v, do = make_inputs(2, 2, 100, 77, D, dtype=np.float32, grad=True)
    check_forward(flash_v1.forward, q, k, v, causal=True)
    check_backward(flash_v1.backward, q, k, v, do, causal=True)


@pytest.mark.parametrize("Nq,Nk,causal", [(100, 100, False), (100, 100, True), (37, 100, True), (100, 37, True),
                                          (130, 70, True)])
def test_mirror_loop_order_and_skipped_tiles(Nq, Nk, causal):
    """j (K/V tiles) outside, i (Q tiles) inside, and a tile is skipped exactly when it is fully masked."""
    q, k, v, do = make_inputs(1, 1, Nq, Nk, 8, dtype=np.float32, grad=True)
    trace_f, trace_b = [], []
    o, lse = flash_v1.mirror.forward(q, k, v, causal=causal, scale=0.3, trace=trace_f)
    flash_v1.mirror.backward(q, k, v, o, lse, do, causal=causal, scale=0.3, trace=trace_b)
    Br, Bc = flash_v1.BR, flash_v1.BC
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    mask = naive.causal_mask(Nq, Nk) if causal else np.ones((Nq, Nk), bool)  # (Nq, Nk)
    expected = [(j, i) for j in range(Tc) for i in range(Tr) if mask[i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc].any()]
    assert trace_f == expected and trace_b == expected
    if causal and Nq != Nk:
        assert len(expected) < Tr * Tc  # some tiles really were skipped


def test_mirror_fully_masked_rows():
    q, k, v, do = make_inputs(1, 2, 100, 60, 32, dtype=np.float32, grad=True)
    o, lse = flash_v1.forward(q, k, v, causal=True)
    assert np.all(o[:, :, :40] == 0) and np.all(np.isneginf(lse[:, :, :40])) and np.isfinite(lse[:, :, 40:]).all()
    dq, dk, dv = flash_v1.backward(q, k, v, o, lse, do, causal=True)
    assert np.all(dq[:, :, :40] == 0) and all(np.isfinite(g).all() for g in (dq, dk, dv))


# ---------------------------------------------------------------- the kernels compile (CPU, CI)


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_broken_kernel_source_fails_the_compile_test(which, monkeypatch):
    """What CI relies on: a kernel source that does not compile makes compile_only raise, naming the file."""
    name = f"flash_v1_{which}.cu"
    good = kernel_loader._source(name)
    defines = {"HEAD_DIM": 64, "BR": flash_v1.BR, "BC": flash_v1.BC}
    broken = good.replace("const int Tr =", "const int Tr = undeclared_name +", 1)
    assert broken != good
    monkeypatch.setattr(kernel_loader, "_source", lambda filename: broken)
    with pytest.raises(RuntimeError, match=f"{name} does not compile for sm_90"):
        compile_only(name, arch="sm_90", defines=defines)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="head dim 1..128"):  # the kernel's own static_assert
        compile_only(name, arch="sm_90", defines=dict(defines, HEAD_DIM=160))


# ---------------------------------------------------------------- bad inputs (CPU)


def test_bad_inputs_raise_clear_errors():
    q, k, v = make_inputs(1, 2, 8, 8, 32, dtype=np.float32)
    with pytest.raises(TypeError, match="float16 is not supported; use one of: float32"):
        flash_v1.forward(*(x.astype(np.float16) for x in (q, k, v)))
    with pytest.raises(TypeError, match="not supported"):
        flash_v1.forward(*(x.astype(np.float64) for x in (q, k, v)))
    big = make_inputs(1, 1, 8, 8, 160, dtype=np.float32)
    with pytest.raises(ValueError, match="head_dim 160 is not supported.*from 1 to 128"):
        flash_v1.forward(*big)
    with pytest.raises(ValueError, match="unknown version 'fast'"):
        flash_v1.forward(q, k, v, version="fast")
    with pytest.raises(ValueError, match="rank 4"):
        flash_v1.forward(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="scale"):
        flash_v1.forward(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="empty input"):
        flash_v1.forward(q[:, :, :0], k, v)
    for bad in ("no", "yes", 0.5, None):  # causal takes True or False, as every stage does
        with pytest.raises(TypeError, match="causal must be True or False"):
            flash_v1.forward(q, k, v, causal=bad)
    o, lse = flash_v1.forward(q, k, v)
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_v1.backward(q, k, v, o, lse, o, causal="no")
    with pytest.raises(ValueError, match="lse"):
        flash_v1.backward(q, k, v, o, lse[..., :3], o)
    with pytest.raises(ValueError, match="head_dim 160"):
        bo = np.zeros_like(big[0])
        flash_v1.backward(*big, bo, np.zeros((1, 1, 8), np.float32), bo)


# ---------------------------------------------------------------- the kernels (gpu)


def _gpu_inputs(B, H, Nq, Nk, D, s):
    import cupy

    return make_inputs(B, H, Nq, Nk, D, dtype=np.float32, xp=cupy, scale=s, grad=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c, _ in CASES_BY_D], ids=[i for _, i in CASES_BY_D])
def test_kernel_against_oracle_and_mirror(case):
    """The kernels against stage 00 in fp64 by the tolerance rule, outputs poisoned before launch; and the same
    rows fully masked (lse = -inf) as in the mirror on the same inputs."""
    import cupy

    (q, k, v, do), causal = case_inputs(case, xp=cupy)
    _check(q, k, v, do, causal)
    lse_gpu = flash_v1.forward(q, k, v, causal=causal)[1].get()
    lse_cpu = flash_v1.forward(*(x.get() for x in (q, k, v)), causal=causal)[1]
    np.testing.assert_array_equal(np.isneginf(lse_gpu), np.isneginf(lse_cpu))


@pytest.mark.gpu
@pytest.mark.parametrize("D", ODD_HEAD_DIMS)
def test_kernel_odd_head_dims(D):
    q, k, v, do = _gpu_inputs(2, 2, 100, 77, D, 1.0)
    check_forward(flash_v1.forward, q, k, v, causal=True)
    check_backward(flash_v1.backward, q, k, v, do, causal=True)


@pytest.mark.gpu
def test_kernel_is_deterministic():
    """One block owns a (batch, head) and its loops run in a fixed order: two runs agree bit for bit."""
    q, k, v, do = _gpu_inputs(2, 3, 300, 257, 64, 1.0)
    o1, lse1 = flash_v1.forward(q, k, v, causal=True)
    o2, lse2 = flash_v1.forward(q, k, v, causal=True)
    g1 = flash_v1.backward(q, k, v, o1, lse1, do, causal=True)
    g2 = flash_v1.backward(q, k, v, o1, lse1, do, causal=True)
    for a, b in zip((o1, lse1) + g1, (o2, lse2) + g2):
        assert bool((a == b).all())


@pytest.mark.gpu
def test_kernel_memory_is_linear_in_n():
    from stages.common import PeakMemory

    peaks = []
    for n in (1024, 2048):
        q, k, v, do = _gpu_inputs(1, 2, n, n, 64, 1.0)
        with PeakMemory(True) as mem:
            o, lse = flash_v1.forward(q, k, v, causal=True)
            flash_v1.backward(q, k, v, o, lse, do, causal=True)
        peaks.append(mem.peak)
    assert peaks[1] <= 2.5 * peaks[0]  # O(N): doubling N about doubles the peak (O(N^2) would give 4x)
    assert peaks[1] < naive.score_matrix_bytes(1, 2, 2048, 2048)  # less than one score matrix


@pytest.mark.gpu
def test_kernel_non_contiguous_inputs_and_mixed_devices():
    import cupy

    q, k, v, do = _gpu_inputs(1, 2, 50, 40, 32, 1.0)
    qt = cupy.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)  # same values, strided
    o, lse = flash_v1.forward(qt, k, v, causal=True)
    o_ref, lse_ref = flash_v1.forward(q, k, v, causal=True)
    assert bool((o == o_ref).all())
    with pytest.raises(TypeError, match="mixed numpy and CuPy"):
        flash_v1.forward(q.get(), k, v)
