"""Stage 00: the naive attention oracle, its backward against finite differences, the shared
plumbing (tolerance rule, input checks, kernel loader), and the CuPy path on a GPU."""
import numpy as np
import pytest

from stages import naive
from stages.common import (
    attention_flops, bfloat16, check_backward, check_forward, compile_only, make_inputs, max_error, tolerance,
    tolerance_report, verify,
)
from tests.conftest import CASE_IDS, CASES, case_inputs

# ---------------------------------------------------------------- forward against a direct formula


def _softmax_reference(q, k, v, causal, scale):
    """softmax(scale Q K^T) V written the obvious way, row by row (float64, numpy)."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    o = np.zeros_like(q)
    lse = np.full((B, H, Nq), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Nq):
                keys = [j for j in range(Nk) if not causal or j <= i + Nk - Nq]
                if not keys:
                    continue
                s = scale * (k[b, h, keys] @ q[b, h, i])  # (n_keys,)
                w = np.exp(s - s.max())
                o[b, h, i] = (w / w.sum()) @ v[b, h, keys]
                lse[b, h, i] = s.max() + np.log(w.sum())
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 5), (7, 3), (3, 9)])
def test_forward_matches_formula(nq, nk, causal):
    q, k, v = make_inputs(2, 2, nq, nk, 8, dtype=np.float64)
    o, lse = naive.forward(q, k, v, causal=causal)
    o_ref, lse_ref = _softmax_reference(q, k, v, causal, 1 / np.sqrt(8))
    assert lse.dtype == np.float64 and o.shape == q.shape
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)], rtol=1e-12, atol=1e-14)  # L near 0


def test_causal_alignment_is_bottom_right():
    mask = naive.causal_mask(2, 4)
    # the last query sees every key; with Nq > Nk the first rows see none
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert not naive.causal_mask(4, 2)[:2].any() and naive.causal_mask(4, 2)[3].all()


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v, do = make_inputs(1, 2, 6, 2, 4, dtype=np.float64, grad=True)
    o, lse = naive.forward(q, k, v, causal=True)
    assert np.all(o[:, :, :4] == 0) and np.all(np.isneginf(lse[:, :, :4]))
    dq, dk, dv = naive.backward(q, k, v, o, lse, do, causal=True)
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()
    assert np.all(dq[:, :, :4] == 0)


def test_large_logits_do_not_overflow():
    q, k, v = make_inputs(1, 1, 64, 64, 32, dtype=np.float32, scale=100.0)
    o, lse = naive.forward(q, k, v)
    assert np.isfinite(o).all() and np.isfinite(lse).all()
    o64, _ = naive.forward(*(x.astype(np.float64) for x in (q, k, v)))
    assert max_error(o, o64) < 1e-3 * np.abs(o64).max()


# ---------------------------------------------------------------- backward against finite differences


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(5, 5), (6, 3), (3, 7)])
def test_backward_matches_central_finite_differences(nq, nk, causal):
    """d/dx sum(O * dO), by central differences in float64, for every element of q, k and v."""
    q, k, v, do = make_inputs(1, 2, nq, nk, 4, dtype=np.float64, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)
    grads = naive.backward(q, k, v, o, lse, do, causal=causal)
    eps = 1e-6
    for which, g in zip(range(3), grads):
        args = [q, k, v]
        fd = np.zeros_like(args[which])
        for idx in np.ndindex(*fd.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            f_plus = np.sum(naive.forward(*plus, causal=causal)[0] * do)
            f_minus = np.sum(naive.forward(*minus, causal=causal)[0] * do)
            fd[idx] = (f_plus - f_minus) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=f"gradient {'qkv'[which]}")


# ---------------------------------------------------------------- the full case list, lower precisions


def _eps(dtype):
    """Machine epsilon: 2^-10 for float16, 2^-7 for bfloat16."""
    return 2.0**-7 if np.dtype(dtype) == bfloat16 else float(np.finfo(dtype).eps)


def _condition(q, k, v, do, o, causal):
    """Elementwise sizes of what each float32 output is summed from (the classic componentwise error bound
    |fl(x) - x| <= gamma * size): o from P |V|, lse from |S|, dv from P^T |dO|, and dq, dk from dS = P (dP - D),
    whose dP and D are float32 dot products of size |dO| |V|^T and sum |dO O|.

    The backward recomputes P = exp(S - L) from the saved lse: S carries its rounding (size S_size = scale |Q| |K|^T)
    and L its rounding to float32 (size |L|), so P_ij is off by a relative P_size_ij = S_size_ij + |L_i| (times the
    unit roundoff), and that error multiplies all of (dP_ij - D_i) in dS_ij, not dP_ij alone: with P one-hot (x100
    logits) a small P_ij can meet a dP_ij near zero while D_i is not."""
    q, k, v, do, o = (x.astype(np.float64) for x in (q, k, v, do, o))
    scale = 1 / np.sqrt(q.shape[-1])
    s = naive.scores(q, k, scale, causal, np)  # (B, H, Nq, Nk)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isinf(m), 0, m)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total == 0, 1, total)
    lse = np.where(total == 0, 0, m + np.log(np.where(total == 0, 1, total)))  # fully masked rows: P = 0
    s_size = scale * np.abs(q) @ np.abs(k).swapaxes(-1, -2)  # size of each S_ij
    p_size = s_size + np.abs(lse)  # the backward's P = exp(S - L): S's rounding and L's
    d_row = (do * o).sum(-1, keepdims=True)  # D_i
    ds_size = p * (np.abs(do) @ np.abs(v).swapaxes(-1, -2) + np.abs(do * o).sum(-1, keepdims=True)
                   + p_size * np.abs(do @ v.swapaxes(-1, -2) - d_row))  # dP, D, and P's rounding times (dP - D)
    return (p @ np.abs(v) + (p * s_size) @ np.abs(v), (p * s_size).sum(-1) + np.abs(m[..., 0]),
            scale * ds_size @ np.abs(k), scale * ds_size.swapaxes(-1, -2) @ np.abs(q),
            p.swapaxes(-1, -2) @ np.abs(do) + (p * p_size).swapaxes(-1, -2) @ np.abs(do))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float32_against_oracle(case):
    """float32 naive attention is the yardstick of the float32 kernels, so it is checked against an a-priori
    bound, not against itself: its error is rounding only, so each element is within G u size of the float64
    oracle (u = 2^-24; size: see _condition; G = 4 sqrt(n) for sums of n terms, a probabilistic rounding bound
    with wide margin). A wrong formula is off by O(1) relative (test below)."""
    (q, k, v, do), causal = case_inputs(case)
    if q.shape[2] * k.shape[2] > 2_000_000:
        q, k, v, do = (x[:1, :1] for x in (q, k, v, do))  # the N=4097 rows: one head keeps CI fast
    u, G = 2.0 ** -24, 4 * np.sqrt(max(q.shape[-1], k.shape[2]))
    refs = tolerance.oracle(q, k, v, do, causal=causal)
    o_in, lse_in = verify.backward_start(q, refs[0], refs[1])
    outs = naive.forward(q, k, v, causal=causal) + naive.backward(q, k, v, o_in, lse_in, do, causal=causal)
    for name, x, ref, size in zip(("o", "lse", "dq", "dk", "dv"), outs, refs,
                                  _condition(q, k, v, do, o_in, causal)):
        assert x.dtype == np.float32
        both = np.isneginf(ref) & np.isneginf(x)  # a fully masked row: L_i = -inf in both, and that is right
        err = np.abs(np.subtract(x.astype(np.float64), ref, out=np.zeros_like(ref), where=~both))
        bound = G * u * size + 1e-30
        assert (err <= bound).all(), f"{name}: max error/bound {np.nanmax(err / bound):.2f} (NaN means NaN)"


def test_float32_check_fails_on_a_wrong_formula():
    """The a-priori bound above fails naive attention with the scale off by 1e-3, forward and backward (at unit
    inputs: with x100 logits P is one-hot, and a one-hot row is blind to the scale)."""
    q, k, v, do = make_inputs(1, 2, 50, 60, 32, grad=True)
    o64, lse64, *grads64 = tolerance.oracle(q, k, v, do)
    o_in, lse_in = verify.backward_start(q, o64, lse64)
    bad = 1.001 / np.sqrt(32)
    outs = naive.forward(q, k, v, scale=bad)[:1] + naive.backward(q, k, v, o_in, lse_in, do, scale=bad)
    sizes = _condition(q, k, v, do, o_in, False)
    for name, x_bad, ref, size in zip(("o", "dq", "dk", "dv"), outs, [o64] + grads64, sizes[:1] + sizes[2:]):
        assert (np.abs(x_bad - ref) > 4 * np.sqrt(60) * 2.0 ** -24 * size).any(), name


@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
def test_low_precision_rounds_like_a_tensor_core(dtype):
    q, k, v = make_inputs(1, 2, 50, 70, 64, dtype=dtype)
    o, lse = naive.forward(q, k, v, causal=True)
    assert o.dtype == dtype and lse.dtype == np.float32
    o64, _ = naive.forward(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    err = max_error(o, o64)
    eps = _eps(dtype)
    assert eps / 100 < err < 20 * eps  # rounded (not exact), but only by a few ulps


# ---------------------------------------------------------------- the tolerance helper itself


def test_tolerance_rule():
    ref = np.array([1.0, 2.0, -np.inf])
    naive_low = np.array([1.001, 2.0, -np.inf])  # naive error 1e-3
    assert tolerance_report(np.array([1.0019, 2.0, -np.inf]), ref, naive_low)[0]  # 1.9e-3 <= 2e-3 + 1e-5
    assert not tolerance_report(np.array([1.0021, 2.0, -np.inf]), ref, naive_low)[0]
    assert not tolerance_report(np.array([np.nan, 2.0, -np.inf]), ref, naive_low)[0]  # NaN never passes
    assert not tolerance_report(np.array([1.0, 2.0, 0.0]), ref, naive_low)[0]  # -inf must stay -inf
    assert not tolerance_report(np.array([1.0, 2.0, np.inf]), ref, naive_low)[0]
    ok, err, bound = tolerance_report(ref.copy(), ref, ref)  # exact naive: only the 1e-5 slack
    assert ok and err == 0 and bound == pytest.approx(1e-5)


def test_yardstick_keeps_s_in_float32():
    """The 16-bit yardstick keeps S (and dP) in float32: float16 inputs x100 give |S| ~ 1e4 to 1e5, past
    float16's 65504, yet its o and lse stay finite and close to the oracle; and a yardstick with an infinite
    error is refused (the rule would pass anything)."""
    q, k, v = make_inputs(1, 2, 64, 64, 64, dtype=np.float16, scale=100.0)
    refs = tolerance.oracle(q, k, v)
    o16, lse16 = naive.forward(q, k, v)
    assert np.isfinite(o16.astype(np.float32)).all() and np.isfinite(lse16).all()
    assert max_error(lse16, refs[1]) < 64 * 2.0 ** -24 * np.abs(refs[1]).max()  # float32 rounding of S, not inf
    with pytest.raises(ValueError, match="would pass anything"):
        tolerance.bounds([refs[0]], [(np.full_like(o16, np.inf),)])


def test_flop_count():
    assert attention_flops(4, 16, 4096, 4096, 64) == 4 * 4 * 16 * 4096 * 4096 * 64
    assert attention_flops(1, 1, 10, 10, 8, causal=True) == 4 * 10 * 10 * 8 / 2
    assert attention_flops(1, 1, 10, 10, 8, backward=True) == 2.5 * 4 * 10 * 10 * 8


# ---------------------------------------------------------------- bad inputs


def _qkv(nq=4, nk=4, d=8):
    return make_inputs(1, 2, nq, nk, d, dtype=np.float32)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (np.zeros((2, 4, 8), np.float32),) + _qkv()[1:], "rank 4"),
        (lambda: (_qkv()[0], _qkv(nk=5)[1], _qkv()[2]), "same shape"),
        (lambda: (_qkv()[0], _qkv(d=16)[1], _qkv(d=16)[2]), "agree in batch and head_dim"),
        (lambda: (_qkv()[0].astype(np.float64),) + _qkv()[1:], "share one dtype"),
        (lambda: tuple(x.astype(np.int32) for x in _qkv()), "not supported"),
        (lambda: _qkv(nq=0), "empty"),
        (lambda: (_qkv()[0].tolist(),) + _qkv()[1:], "numpy or CuPy"),
    ],
    ids=["rank", "k-v-shape", "head-dim", "mixed-dtype", "int-dtype", "empty", "list"],
)
def test_bad_inputs_raise_clear_errors(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        naive.forward(*make())


def test_bad_scale_and_backward_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        naive.forward(q, k, v, scale=-1.0)
    o, lse = naive.forward(q, k, v)
    with pytest.raises(ValueError, match="lse"):
        naive.backward(q, k, v, o, lse[..., :2], o)
    with pytest.raises(ValueError, match="do"):
        naive.backward(q, k, v, o, lse, o[:, :, :2])


# ---------------------------------------------------------------- kernel loader (no GPU needed)


def test_compile_only_reports_compile_errors(tmp_path, monkeypatch):
    from stages.common import kernels

    monkeypatch.setattr(kernels, "KERNELS_DIR", tmp_path)
    (tmp_path / "good.cu").write_text('extern "C" __global__ void k(float* x) { x[threadIdx.x] = 1.f; }\n')
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k(float* x) { x[threadIdx.x] = undefined; }\n')
    for arch in ("sm_80", "sm_90"):
        assert len(compile_only("good.cu", arch=arch)) > 0
        with pytest.raises(RuntimeError, match="undefined"):
            compile_only("bad.cu", arch=arch)


def test_common_cuh_compiles():
    """The shared plumbing header compiles (and its templates instantiate) for sm_80 and sm_90."""
    for arch in ("sm_80", "sm_90"):
        assert len(compile_only("common_cuh_check.cu", arch=arch)) > 0


# ---------------------------------------------------------------- the CuPy path (same code, GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cupy_path_against_oracle(case):
    import cupy

    (q, k, v, do), causal = case_inputs(case, xp=cupy)
    check_forward(naive.forward, q, k, v, causal=causal)
    check_backward(naive.backward, q, k, v, do, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
def test_cupy_low_precision(dtype):
    import cupy

    q, k, v = make_inputs(2, 2, 100, 77, 64, dtype=dtype, xp=cupy)
    o, lse = naive.forward(q, k, v, causal=True)
    assert isinstance(o, cupy.ndarray) and o.dtype == dtype and lse.dtype == np.float32
    o_cpu, _ = naive.forward(*(x.get() for x in (q, k, v)), causal=True)
    assert max_error(o, o_cpu) <= 4 * _eps(dtype) * float(np.abs(o_cpu.astype(np.float32)).max())


@pytest.mark.gpu
def test_mixed_devices_raise():
    import cupy

    q, k, v = _qkv()
    with pytest.raises(TypeError, match="mixed numpy and CuPy"):
        naive.forward(cupy.asarray(q), k, v)
