"""Stage 02: FlashAttention-2 forward, versions fp32, tc, pipelined, fp32x3.

CPU (CI): the numpy tile mirror of every version and dtype against the fp64 oracle over the case list, its
loop order and skipped tiles, fp32 against stage 01, the 3xTF32 split; every kernel compiled with NVRTC for
sm_80 and sm_90; bad inputs. GPU (marker gpu): every version x dtype x supported head dim over the full case
list against the oracle and against the version before it (fp32 against stage 01, tc against fp32, pipelined
against tc, fp32x3 against fp32). Outputs are NaN-poisoned before every launch (conftest's autouse fixture)."""
import numpy as np
import pytest

from stages import flash_v1, flash_v2, naive
from stages.common import (
    bfloat16, cast, check_forward, compile_only, make_inputs, max_error, to_numpy,
)
from tests.conftest import CASE_IDS, CASES

LOW = {"fp16": np.dtype(np.float16), "bf16": bfloat16}
# (version, dtype name) pairs the mirror runs: fp32 takes float32, the tensor-core versions fp16 and bf16
MIRROR_RUNS = [("fp32", "fp32")] + [(v, d) for v in ("tc", "pipelined") for d in LOW] + [("fp32x3", "fp32")]
DTYPE = {"fp32": np.dtype(np.float32), **LOW}
FP32_DIMS = (32, 64, 128)  # every CASES row runs at these on the GPU; 80 and odd dims on a smaller list
FP32_ODD_DIMS = (1, 7, 16, 80, 100)


def _case(case, D=None):
    B, H, Nq, Nk, D0, causal, s = case
    return B, H, Nq, Nk, D or D0, causal, s


# Large logits (inputs x100) in float32: the max error of ANY float32 attention there is decided by the few
# rows whose two largest logits nearly tie (|S| ~ 1e4, one ulp ~ 1e-3), and ONE naive float32 run is a noisy
# yardstick (stage 01 measured ~5% failures per case for an equally valid summation order). As in
# tests/test_01_flash_v1.py, the yardstick is the worst of NAIVE_SAMPLES naive float32 runs, each summing the
# head dim in another order (columns of q and k permuted alike: the same maths). Float16/bfloat16 and inputs
# x1 use one naive run: the shared rule of stages.common.check_forward.
NAIVE_SAMPLES = 8


# Float16 with inputs x100: the shared yardstick (stage 00's naive attention in float16) rounds S to float16,
# and |S| ~ 1e5 > 65504 overflows to inf: its error is inf and the rule would pass anything. There the yardstick
# keeps S in float32 (naive.forward(..., round_scores=False)), as every FlashAttention kernel keeps it (P~ and O
# still rounded to the input dtype), and one unit in the last place of O's dtype is allowed on top: with logits
# ~1e5 most rows are one-hot, where that yardstick is exact (P = 1, O = a row of V), while a kernel that folds
# the scale into one FMA (exp2(s * scale log2e - m), as FlashAttention-2 does) gets P~ = 2^(rounding residue of
# S) = 1 +- 0.005 for the row max, rounds it to float16 for P~ V but sums l from the float32 P~, and lands one
# float16 ulp off (measured on an H100: version pipelined, 0.25 on |o| ~ 300).


def _oracle_and_bounds(q, k, v, causal, samples=1):
    """The fp64 oracle (o, lse) and the tolerance rule's bounds {"o", "lse"}: 2x the worst error of `samples`
    naive runs in the inputs' dtype (the first in the natural order of the D sum) + 1e-5."""
    qh, kh, vh = (to_numpy(x) for x in (q, k, v))
    refs = naive.forward(*(cast(x, np.float64) for x in (qh, kh, vh)), causal=causal)
    rng = np.random.default_rng()
    worst, ulp = [0.0, 0.0], 0.0
    for t in range(samples):
        perm = np.arange(qh.shape[-1]) if t == 0 else rng.permutation(qh.shape[-1])  # order of the D sum
        with np.errstate(over="ignore", invalid="ignore"):
            lows = naive.forward(qh[..., perm], kh[..., perm], vh, causal=causal)  # (B, H, N, D) cols permuted
        if qh.dtype != np.float32 and not np.isfinite(max_error(lows[0], refs[0])):
            lows = naive.forward(qh, kh, vh, causal=causal, round_scores=False)  # fp16 S overflowed: see above
            ulp = float(np.spacing(np.abs(refs[0]).max().astype(qh.dtype)))  # one ulp of O's dtype at max |O|
        worst = [max(w, max_error(low, ref)) for w, low, ref in zip(worst, lows, refs)]
    assert all(np.isfinite(w) for w in worst), "the naive yardstick is not finite: the rule would test nothing"
    return refs, {"o": 2 * worst[0] + 1e-5 + ulp, "lse": 2 * worst[1] + 1e-5}


def _assert_within(what, o, lse, refs, bounds):
    """max |x - ref| <= bound for o and lse; returns the errors."""
    errs = {}
    for name, x, ref in zip(("o", "lse"), (o, lse), refs):
        err = max_error(x, ref)
        assert err <= bounds[name], f"{what} {name}: max error {err:.3e} > bound {bounds[name]:.3e}"
        errs[name] = err
    return errs


def _assert_agree(what, o, lse, other, bounds):
    """Two versions against each other (the chain of checks). Each is already within `bounds` of the oracle,
    so their difference is bounded by the two errors together (triangle inequality): twice the bound."""
    return _assert_within(what, o, lse, other, {name: 2 * b for name, b in bounds.items()})


def _check(q, k, v, causal, s, version):
    """flash_v2.forward (mirror for numpy, kernel for CuPy) against the fp64 oracle by the tolerance rule;
    returns (o, lse, refs, bounds)."""
    o, lse = flash_v2.forward(q, k, v, causal=causal, version=version)
    assert o.dtype == q.dtype and lse.dtype == np.float32 and o.shape == q.shape and lse.shape == q.shape[:3]
    samples = NAIVE_SAMPLES if (s != 1.0 and q.dtype == np.float32) else 1
    refs, bounds = _oracle_and_bounds(q, k, v, causal, samples)
    _assert_within(f"{version} against the fp64 oracle:", o, lse, refs, bounds)
    return o, lse, refs, bounds


# ---------------------------------------------------------------- the mirror (CPU, CI)


@pytest.mark.parametrize("version,dt", MIRROR_RUNS, ids=[f"{v}-{d}" for v, d in MIRROR_RUNS])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_mirror_against_oracle(case, version, dt):
    B, H, Nq, Nk, D, causal, s = _case(case)
    q, k, v = make_inputs(B, H, Nq, Nk, D, dtype=DTYPE[dt], scale=s)
    o, lse, _, _ = _check(q, k, v, causal, s, version)
    assert np.isfinite(o.astype(np.float32)).all()


@pytest.mark.parametrize("D", FP32_ODD_DIMS + (128,))
def test_mirror_fp32_head_dims_and_stage01(D):
    """Any head dim 1..128; and the fp32 version agrees with stage 01 on the same inputs."""
    q, k, v = make_inputs(2, 2, 100, 77, D, dtype=np.float32)
    o, lse, _, bounds = _check(q, k, v, True, 1.0, "fp32")
    o1, lse1 = flash_v1.forward(q, k, v, causal=True)  # stage 01 as the reference of the tolerance rule
    _assert_agree("fp32 against stage 01:", o, lse, (o1, lse1), bounds)


@pytest.mark.parametrize("version", flash_v2.VERSIONS)
@pytest.mark.parametrize("Nq,Nk,causal", [(100, 100, False), (300, 300, True), (70, 300, True), (300, 70, True),
                                          (1, 200, True), (200, 1, True), (129, 129, True)])
def test_mirror_loop_order_and_skipped_tiles(Nq, Nk, causal, version):
    """i (Q tiles) outside, j (K/V tiles) inside; a tile is visited iff it has a visible key for some row of
    Q_i, and masked iff it needs it (keys right of the diagonal of Q_i's first row, or keys >= Nk)."""
    D = 64
    dtype = np.float32 if version in flash_v2.flash_v2.FP32_VERSIONS else np.float16
    q, k, v = make_inputs(1, 1, Nq, Nk, D, dtype=dtype)
    Br, Bc = flash_v2.tiles(version, D, causal)
    trace = []
    flash_v2.mirror.forward(q, k, v, causal=causal, scale=0.125, br=Br, bc=Bc, trace=trace)
    mask = naive.causal_mask(Nq, Nk) if causal else np.ones((Nq, Nk), bool)  # (Nq, Nk)
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    expected = []
    for i in range(Tr):
        for j in range(Tc):
            tile = mask[i * Br:(i + 1) * Br, j * Bc:(j + 1) * Bc]  # (br, bc)
            if tile.any():
                # needed: some (row < Nq, key) pair is masked, or the tile runs past Nk (padding keys)
                expected.append((i, j, not tile.all() or tile.shape[1] < Bc))
    got = [(i, j) for i, j, _ in trace]
    assert got == [(i, j) for i, j, _ in expected]  # the loop order, and exactly the visible tiles
    for (_, _, masked), (_, _, needed) in zip(trace, expected):
        assert masked or not needed  # never skip a mask that is needed
    if causal and Nq == Nk == 300:
        assert len(trace) < Tr * Tc  # tiles above the diagonal really were skipped


@pytest.mark.parametrize("version,dt", MIRROR_RUNS, ids=[f"{v}-{d}" for v, d in MIRROR_RUNS])
def test_mirror_fully_masked_rows(version, dt):
    q, k, v = make_inputs(1, 2, 300, 60, 64, dtype=DTYPE[dt])  # causal, Nq - Nk = 240 rows see no key
    o, lse = flash_v2.forward(q, k, v, causal=True, version=version)
    o = o.astype(np.float32)
    assert np.all(o[:, :, :240] == 0) and np.all(np.isneginf(lse[:, :, :240]))
    assert np.isfinite(lse[:, :, 240:]).all() and np.isfinite(o).all()


@pytest.mark.parametrize("dt", list(LOW))
def test_mirror_rounds_p_like_a_tensor_core(dt):
    """The tensor-core mirror rounds P~_ij to the input dtype: it is NOT the fp32 computation on the same
    values, but stays within the tolerance rule of it (the 16-bit naive attention's error is the yardstick)."""
    q, k, v = make_inputs(1, 2, 200, 200, 64, dtype=DTYPE[dt])
    o_tc, lse_tc = flash_v2.forward(q, k, v, causal=True, version="tc")
    o_32, lse_32 = flash_v2.forward(*(cast(x, np.float32) for x in (q, k, v)), causal=True, version="fp32")
    err = max_error(o_tc, o_32)
    assert err > 0  # P (and O) were rounded
    o64, _ = naive.forward(*(cast(x, np.float64) for x in (q, k, v)), causal=True)
    o_low, _ = naive.forward(q, k, v, causal=True)
    assert err <= 2 * max_error(o_low, o64) + 1e-5
    assert max_error(lse_tc, lse_32) < 1e-5  # lse comes from the fp32 S and l: no 16-bit rounding


def test_mirror_tf32_split():
    """big + small is x to ~2^-22 relative, both parts are TF32 (low 13 bits zero), big rounds to nearest (ties
    away); and the fp32x3 mirror is not the fp32 one (the split is really applied) but within the rule of it."""
    x = np.random.default_rng().standard_normal(10000).astype(np.float32) * np.float32(100)
    big, small = flash_v2.mirror.tf32_split(x)
    for part in (big, small):
        assert not np.any(part.view(np.uint32) & np.uint32(0x1FFF))
    assert np.all(np.abs((big.astype(np.float64) + small) - x) <= 2.0 ** -21 * np.abs(x))
    assert np.all(np.abs(big.astype(np.float64) - x) <= 2.0 ** -11 * np.abs(x))
    tie = np.array([1 + 2.0 ** -11, -(1 + 2.0 ** -11)], np.float32)  # exactly half a TF32 ulp above 1
    assert list(flash_v2.mirror.tf32_split(tie)[0]) == [1 + 2.0 ** -10, -(1 + 2.0 ** -10)]
    q, k, v = make_inputs(1, 2, 200, 200, 64, dtype=np.float32)
    o3, lse3 = flash_v2.forward(q, k, v, causal=True, version="fp32x3")
    o1, lse1 = flash_v2.forward(q, k, v, causal=True, version="fp32")
    o64, _ = naive.forward(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    o32, _ = naive.forward(q, k, v, causal=True)
    assert 0 < max_error(o3, o1) <= 2 * max_error(o32, o64) + 1e-5


# ---------------------------------------------------------------- the kernels compile (CPU, CI)


def _sources():
    try:
        return flash_v2.kernel_sources()
    except ImportError as e:  # tc.py missing: this must fail, not skip
        return [("tensor-core-launcher-missing", {}, (str(e),))]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp32_kernel_compiles(arch):
    fp32 = [s for s in _sources() if s[0] == "flash_v2_forward_fp32.cu"]
    assert {d["HEAD_DIM"] for _, d, _ in fp32} >= {1, 7, 32, 64, 80, 128}
    for filename, defines, names in fp32:
        assert len(compile_only(filename, arch=arch, defines=defines, name_expressions=names)) > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("version", ["tc", "pipelined"])
def test_tensor_core_kernels_compile(version, arch):
    """Every template instantiation tc.py launches (each dtype x head dim) compiles."""
    tc_sources = [s for s in _sources() if s[0] not in ("flash_v2_forward_fp32.cu", "flash_v2_forward_fp32x3.cu")]
    assert tc_sources, "stage 02 lists no tensor-core kernels"
    mine = [s for s in tc_sources if version in s[0]]
    assert mine, f"no kernel file for version {version!r} in {[s[0] for s in tc_sources]}"
    for filename, defines, names in mine:
        assert len(names) == len(LOW) * len(flash_v2.head_dims(version)), names
        assert len(compile_only(filename, arch=arch, defines=defines, name_expressions=names)) > 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp32x3_kernel_compiles(arch):
    """Every template instantiation fp32x3.py launches (one per head dim) compiles."""
    mine = [s for s in _sources() if s[0] == "flash_v2_forward_fp32x3.cu"]
    assert len(mine) == 1 and len(mine[0][2]) >= len(flash_v2.head_dims("fp32x3")) >= 2
    for filename, defines, names in mine:
        assert len(compile_only(filename, arch=arch, defines=defines, name_expressions=names)) > 0


def test_shared_memory_fits_an_a100():
    for D in (1, 32, 64, 65, 96, 128):  # sm_80 allows 163 KB of dynamic shared memory per block, sm_90 227 KB
        assert flash_v2.fp32_smem_bytes(D) < 163 * 1024
    for D in flash_v2.head_dims("fp32x3"):  # tuned for an H100: only the H100's limit is promised
        for causal in (False, True):
            assert flash_v2.flash_v2._fp32x3().smem_bytes(D, causal) <= 227 * 1024


# ---------------------------------------------------------------- bad inputs (CPU)


def test_bad_inputs_raise_clear_errors():
    q, k, v = make_inputs(1, 2, 8, 8, 64, dtype=np.float32)
    h = [x.astype(np.float16) for x in (q, k, v)]
    with pytest.raises(TypeError, match="version 'fp32' takes float32, got float16"):
        flash_v2.forward(*h, version="fp32")
    with pytest.raises(TypeError, match="version 'pipelined' takes float16/bfloat16, got float32"):
        flash_v2.forward(q, k, v, version="pipelined")
    with pytest.raises(TypeError, match="float64 is not supported"):
        flash_v2.forward(*(x.astype(np.float64) for x in (q, k, v)))
    with pytest.raises(ValueError, match="unknown version 'fast'"):
        flash_v2.forward(q, k, v, version="fast")
    q80 = make_inputs(1, 1, 8, 8, 80, dtype=np.float16)
    with pytest.raises(ValueError, match="head_dim 80 is not supported by the tensor-core kernel.*version='fp32'"):
        flash_v2.forward(*q80, version="tc")
    with pytest.raises(ValueError, match="head_dim 80 is not supported by the fp32x3 kernel: use 32, 64, 96, 128"):
        flash_v2.forward(*make_inputs(1, 1, 8, 8, 80, dtype=np.float32), version="fp32x3")
    with pytest.raises(TypeError, match="version 'fp32x3' takes float32, got float16"):
        flash_v2.forward(*h, version="fp32x3")
    with pytest.raises(ValueError, match="head_dim 160 is not supported by the fp32 kernel.*1 to 128"):
        flash_v2.forward(*make_inputs(1, 1, 8, 8, 160, dtype=np.float32))
    with pytest.raises(ValueError, match="rank 4"):
        flash_v2.forward(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="scale"):
        flash_v2.forward(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="numpy or CuPy"):
        flash_v2.forward(q.tolist(), k, v)
    assert flash_v2.resolve_version("auto", np.float32) == "fp32"
    assert flash_v2.resolve_version("auto", bfloat16) == "pipelined"


def test_backward_is_stage_03():
    """Stage 02 is forward only: backward hands over to stage 03 (or says that stage 03 is missing)."""
    q, k, v, do = make_inputs(1, 1, 40, 40, 32, dtype=np.float32, grad=True)
    o, lse = flash_v2.forward(q, k, v, causal=True)
    try:
        grads = flash_v2.backward(q, k, v, o, lse, do, causal=True)
    except NotImplementedError as e:
        assert "stage 03" in str(e)
        return
    ref = naive.backward(*(x.astype(np.float64) for x in (q, k, v, o)), lse.astype(np.float64),
                         do.astype(np.float64), causal=True)
    for g, r in zip(grads, ref):
        assert g.shape == r.shape and max_error(g, r) < 1e-4


# ---------------------------------------------------------------- the kernels (GPU)


def _cupy():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("D", FP32_DIMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_fp32_against_oracle_and_stage01(case, D):
    cp = _cupy()
    B, H, Nq, Nk, D, causal, s = _case(case, D)
    q, k, v = make_inputs(B, H, Nq, Nk, D, dtype=np.float32, xp=cp, scale=s)
    o, lse, refs, bounds = _check(q, k, v, causal, s, "fp32")  # the kernel against the fp64 oracle
    o1, lse1 = flash_v1.forward(q, k, v, causal=causal)  # the previous stage on the same inputs, as the reference
    _assert_agree("fp32 against stage 01:", o, lse, (o1, lse1), bounds)


@pytest.mark.gpu
@pytest.mark.parametrize("D", FP32_ODD_DIMS)
@pytest.mark.parametrize("Nq,Nk,causal", [(1, 1, False), (100, 77, True), (77, 300, False), (1000, 999, True)])
def test_gpu_fp32_odd_head_dims(Nq, Nk, causal, D):
    cp = _cupy()
    q, k, v = make_inputs(2, 3, Nq, Nk, D, dtype=np.float32, xp=cp)
    check_forward(flash_v2.forward, q, k, v, causal=causal, version="fp32")
    o, lse = flash_v2.forward(q, k, v, causal=causal, version="fp32")
    o_m, lse_m = flash_v2.forward(*(x.get() for x in (q, k, v)), causal=causal, version="fp32")  # the mirror
    assert max_error(o, o_m) < 1e-5 and max_error(lse, lse_m) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("D", (32, 64, 96, 128))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_fp32x3_against_oracle_and_fp32(case, D):
    """fp32x3 (3xTF32 tensor cores) against the oracle by the float32 rule (x100: the worst of NAIVE_SAMPLES naive
    float32 runs) and, by the same bounds, against the fp32 CUDA-core kernel on the same inputs."""
    cp = _cupy()
    assert D in flash_v2.head_dims("fp32x3")
    B, H, Nq, Nk, D, causal, s = _case(case, D)
    q, k, v = make_inputs(B, H, Nq, Nk, D, dtype=np.float32, xp=cp, scale=s)
    o, lse, refs, bounds = _check(q, k, v, causal, s, "fp32x3")
    o1, lse1 = flash_v2.forward(q, k, v, causal=causal, version="fp32")
    _assert_agree("fp32x3 against fp32:", o, lse, (o1, lse1), bounds)


def _tc_dims():
    try:
        return sorted(set(flash_v2.head_dims("tc")) | set(flash_v2.head_dims("pipelined")))
    except ImportError:
        return [64, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("D", _tc_dims())
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_tensor_cores_against_oracle_and_previous(case, D, dt):
    """tc against the oracle and against fp32 on the same (16-bit) values; pipelined against the oracle and tc."""
    cp = _cupy()
    B, H, Nq, Nk, D, causal, s = _case(case, D)
    q, k, v = make_inputs(B, H, Nq, Nk, D, dtype=LOW[dt], xp=cp, scale=s)
    refs, bounds = _oracle_and_bounds(q, k, v, causal)
    prev = ("fp32",) + flash_v2.forward(*(cast(x, np.float32) for x in (q, k, v)), causal=causal, version="fp32")
    for version in ("tc", "pipelined"):
        if D not in flash_v2.head_dims(version):
            continue
        o, lse = flash_v2.forward(q, k, v, causal=causal, version=version)
        assert o.dtype == LOW[dt] and lse.dtype == np.float32 and o.shape == q.shape
        _assert_within(f"{version} against the fp64 oracle:", o, lse, refs, bounds)
        # the previous version in place of the oracle: within the sum of both versions' bounds
        _assert_agree(f"{version} against {prev[0]}:", o, lse, prev[1:], bounds)
        prev = (version, o, lse)


@pytest.mark.gpu
def test_gpu_mixed_devices_raise():
    cp = _cupy()
    q, k, v = make_inputs(1, 1, 8, 8, 64, dtype=np.float32)
    with pytest.raises(TypeError, match="mixed numpy and CuPy"):
        flash_v2.forward(cp.asarray(q), k, v)
