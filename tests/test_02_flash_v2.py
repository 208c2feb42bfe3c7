"""Stage 02: FlashAttention-2 forward, versions fp32, fp32_overlap, tc, pipelined, fp32x3.

CPU (CI): the numpy tile mirror of every version and dtype against the fp64 oracle over the case list, its
loop order and skipped tiles, fp32 against stage 01, the 3xTF32 split; bad inputs (every kernel is compiled with
NVRTC in tests/test_portability.py). GPU (marker gpu): every version x dtype x supported head dim over the full case
list against the oracle; the speed layer's replay of a call against the plain launcher, bit for bit. Outputs are
NaN-poisoned before every launch (conftest's autouse fixture)."""
import numpy as np
import pytest

from stages import flash_v2, naive
from stages.common import (
    bfloat16, cast, check_forward, fast_path, make_inputs, max_error, to_numpy,
)
from tests.conftest import CASE_IDS, CASES, case_inputs

LOW = {"fp16": np.dtype(np.float16), "bf16": bfloat16}
# (version, dtype name) pairs the mirror runs: fp32 takes float32, the tensor-core versions fp16 and bf16 (the mirror
# of fp32_overlap is fp32's, same tiles and arithmetic: test_mirror_of_fp32_overlap_is_fp32s)
MIRROR_RUNS = [("fp32", "fp32")] + [(v, d) for v in ("tc", "pipelined") for d in LOW] + [("fp32x3", "fp32")]
FP32_CUDA_CORES = ("fp32", "fp32_overlap")  # the versions on CUDA cores, any head dim 1..128
DTYPE = {"fp32": np.dtype(np.float32), **LOW}
FP32_DIMS = (32, 64, 128)  # every CASES row runs at these on the GPU; 80 and odd dims on a smaller list
FP32_ODD_DIMS = (1, 7, 16, 80, 100)


def _check(q, k, v, causal, version):
    """flash_v2.forward (mirror for numpy, kernel for CuPy) against the fp64 oracle by the tolerance rule, and
    the same call with out_dtype=float32: its o rounds to exactly the default o (one rounding, at the end)."""
    check_forward(flash_v2.forward, q, k, v, causal=causal, version=version)
    o, lse = flash_v2.forward(q, k, v, causal=causal, version=version)
    o32, lse32 = flash_v2.forward(q, k, v, causal=causal, version=version, out_dtype=np.float32)
    assert o32.dtype == np.float32
    np.testing.assert_array_equal(to_numpy(cast(o32, q.dtype)).view(np.uint8), to_numpy(o).view(np.uint8))
    np.testing.assert_array_equal(to_numpy(lse32), to_numpy(lse))
    return o, lse


# ---------------------------------------------------------------- the mirror (CPU, CI)


@pytest.mark.parametrize("version,dt", MIRROR_RUNS, ids=[f"{v}-{d}" for v, d in MIRROR_RUNS])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_mirror_against_oracle(case, version, dt):
    (q, k, v), causal = case_inputs(case, DTYPE[dt], grad=False)
    o, _ = _check(q, k, v, causal, version)
    assert np.isfinite(o.astype(np.float32)).all()


@pytest.mark.parametrize("D", FP32_ODD_DIMS + (128,))
def test_mirror_fp32_head_dims(D):
    """Any head dim 1..128 (stage 01's forward passes the same rule on the same inputs: tests/test_01)."""
    q, k, v = make_inputs(2, 2, 100, 77, D, dtype=np.float32)
    _check(q, k, v, True, "fp32")


def test_mirror_of_fp32_overlap_is_fp32s():
    """Versions fp32 and fp32_overlap compute the same thing on the same tiles (the overlap moves loads, not math):
    their mirror results are equal bit for bit, and the tiles equal."""
    q, k, v = make_inputs(1, 2, 150, 130, 48, dtype=np.float32)
    assert flash_v2.tiles("fp32", 48) == flash_v2.tiles("fp32_overlap", 48)
    for a, b in zip(flash_v2.forward(q, k, v, causal=True, version="fp32"),
                    flash_v2.forward(q, k, v, causal=True, version="fp32_overlap")):
        np.testing.assert_array_equal(a, b)


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


# ------------------------------------------- the kernels compile (CPU, CI): see tests/test_portability.py


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
    with pytest.raises(ValueError, match="head_dim 160 is not supported by the fp32_overlap kernel.*1 to 128"):
        flash_v2.forward(*make_inputs(1, 1, 8, 8, 160, dtype=np.float32))
    q256 = make_inputs(1, 1, 8, 8, 256, dtype=np.float32)  # d = 256: float32 says which version takes it
    with pytest.raises(ValueError, match="fp32 kernel.*1 to 128; version 'pipelined' takes head_dim 256"):
        flash_v2.forward(*q256, version="fp32")
    with pytest.raises(ValueError, match="fp32x3 kernel.*version 'pipelined' takes head_dim 256"):
        flash_v2.forward(*q256, version="fp32x3")
    with pytest.raises(ValueError, match=r"\(version 'tc'\): use 32, 64, 96, 128.*'pipelined' takes head_dim 256"):
        flash_v2.forward(*(x.astype(np.float16) for x in q256), version="tc")
    with pytest.raises(ValueError, match="rank 4"):
        flash_v2.forward(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="scale"):
        flash_v2.forward(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="numpy or CuPy"):
        flash_v2.forward(q.tolist(), k, v)
    with pytest.raises(ValueError, match="config= sets the CUDA-core kernels' tiles"):
        flash_v2.forward(q, k, v, version="fp32", config=(4, 4))  # numpy: the mirror has no config
    assert flash_v2.resolve_version("auto", np.float32) == "fp32_overlap"
    assert flash_v2.resolve_version("auto", bfloat16) == "pipelined"


def test_backward_is_stage_03():
    """Stage 02 is the forward only and imports no later stage: its backward is an error that names stage 03."""
    q, k, v, do = make_inputs(1, 1, 40, 40, 32, dtype=np.float32, grad=True)
    o, lse = flash_v2.forward(q, k, v, causal=True)
    with pytest.raises(NotImplementedError, match="stage 03.*flash_v2_backward.backward"):
        flash_v2.backward(q, k, v, o, lse, do, causal=True)


# ---------------------------------------------------------------- the kernels (GPU)


def _cupy():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("version", FP32_CUDA_CORES)
@pytest.mark.parametrize("D", FP32_DIMS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_fp32_against_oracle(case, D, version):
    (q, k, v), causal = case_inputs(case, xp=_cupy(), D=D, grad=False)
    _check(q, k, v, causal, version)


@pytest.mark.gpu
@pytest.mark.parametrize("version", FP32_CUDA_CORES)
@pytest.mark.parametrize("D", FP32_ODD_DIMS)
@pytest.mark.parametrize("Nq,Nk,causal", [(1, 1, False), (100, 77, True), (77, 300, False), (1000, 999, True)])
def test_gpu_fp32_odd_head_dims(Nq, Nk, causal, D, version):
    cp = _cupy()
    q, k, v = make_inputs(2, 3, Nq, Nk, D, dtype=np.float32, xp=cp)
    check_forward(flash_v2.forward, q, k, v, causal=causal, version=version)
    o, lse = flash_v2.forward(q, k, v, causal=causal, version=version)
    o_m, lse_m = flash_v2.forward(*(x.get() for x in (q, k, v)), causal=causal, version=version)  # the mirror
    assert max_error(o, o_m) < 1e-5 and max_error(lse, lse_m) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("config", [(4, 2, True), (4, 4, False)], ids=["share_kv", "two-buffers"])
def test_gpu_fp32_tiles_of_small_gpus(config):
    """Version fp32's other configurations, which a GPU with less shared memory picks (SHARE_KV: V_j in K_j's
    buffer), on any GPU through config=: right by the rule, at an odd head dim and at d = 128."""
    cp = _cupy()
    for D in (7, 128):
        q, k, v = make_inputs(2, 3, 300, 257, D, dtype=np.float32, xp=cp)
        check_forward(flash_v2.forward, q, k, v, causal=True, version="fp32", config=config)


@pytest.mark.gpu
@pytest.mark.parametrize("D", (32, 64, 96, 128))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_fp32x3_against_oracle(case, D):
    """fp32x3 (3xTF32 tensor cores) against the oracle by the float32 rule."""
    assert D in flash_v2.head_dims("fp32x3")
    (q, k, v), causal = case_inputs(case, xp=_cupy(), D=D, grad=False)
    _check(q, k, v, causal, "fp32x3")


def _tc_dims():
    try:
        return sorted(set(flash_v2.head_dims("tc")) | set(flash_v2.head_dims("pipelined")))
    except ImportError:
        return [64, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("version", ["fp32", "fp32_overlap", "fp32x3"])
def test_gpu_float32_lse_at_inputs_x10(version):
    """A case from a check with inputs the suite does not draw: float32, one head of 129 queries and keys, d = 64,
    scale 0.125, q and k drawn x10 (scores of a few hundred, where a float32 ulp is ~3e-5, so the S roundings of the
    kernel's own summation order decide lse's error). 40 draws of that shape, each within the rule."""
    import cupy

    for seed in range(40):
        q, k, v = make_inputs(1, 1, 129, 129, 64, seed=seed, scale=10.0)
        check_forward(flash_v2.forward, *(cupy.asarray(x) for x in (q, k, v)), scale=0.125, version=version)


@pytest.mark.gpu
def test_gpu_auto_runs_fp32x3_for_float32_where_it_runs(monkeypatch):
    """version="auto" in float32 runs fp32x3 on a GPU with TF32 tensor cores (sm_80 on) at its head dims, and
    fp32_overlap otherwise: at head dim 80, with a config=, on older GPUs (as under ATTN_ARCH=sm_75); fp32 where
    fp32_overlap's tiles do not fit (a T4 at d > 64). Each result is right by the rule."""
    from stages.common import device

    cp = _cupy()
    dev = device.device()
    flash_v2.forward.plans.clear()  # every call below takes the plain path, which picks the version
    calls = []
    for mod, name in ((flash_v2.fp32x3, "forward"), (flash_v2.fp32, "forward_fp32"),
                      (flash_v2.fp32, "forward_fp32_overlap")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda q, *a, _n=name, _f=real, **kw: (calls.append((_n, q.shape[3])),
                                                                              _f(q, *a, **kw))[1])
    for D, kw in ((64, {}), (80, {}), (128, {"config": flash_v2.fp32.config("fp32_overlap", 128, dev)})):
        q, k, v = make_inputs(1, 1, 77, 91, D, xp=cp)
        check_forward(flash_v2.forward, q, k, v, causal=True, **kw)
    fp32x3_here = device.tf32_tensor_cores(dev)
    expected = [("forward" if fp32x3_here else "forward_fp32_overlap", 64)]
    expected += [("forward_fp32_overlap" if flash_v2.fp32.overlap_fits(D, dev) else "forward_fp32", D)
                 for D in (80, 128)]
    assert calls == expected


@pytest.mark.gpu
@pytest.mark.parametrize("dt", list(LOW))
@pytest.mark.parametrize("D", _tc_dims())
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gpu_tensor_cores_against_oracle(case, D, dt):
    """tc and pipelined against the oracle by the 16-bit rule, outputs poisoned before launch."""
    (q, k, v), causal = case_inputs(case, LOW[dt], xp=_cupy(), D=D, grad=False)
    for version in ("tc", "pipelined"):
        if D in flash_v2.head_dims(version):
            _check(q, k, v, causal, version)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_gpu_a_repeated_call_is_checked_and_planned_like_the_first(dt):
    """forward keeps each checked plain GPU call's plan under fast_path.call_key. A repeat gives the same o and lse bit
    for bit; a call that differs in one argument, or new values in arrays of the same shape, is right by the rule;
    and bad input is still refused after a good call with the same shapes."""
    cp = _cupy()
    q, k, v = make_inputs(1, 2, 200, 150, 64, dtype=DTYPE[dt], xp=cp)
    o1, lse1 = flash_v2.forward(q, k, v)
    assert flash_v2.forward.plans.get(fast_path.call_key((q, k, v), {})) is not None
    o2, lse2 = flash_v2.forward(q, k, v)
    np.testing.assert_array_equal(to_numpy(o2).view(np.uint8), to_numpy(o1).view(np.uint8))
    np.testing.assert_array_equal(to_numpy(lse2), to_numpy(lse1))
    for causal, scale in ((True, None), (False, 0.05), (True, 0.3)):
        for _ in range(2):  # the first call plans, the second goes straight to the kept plan
            check_forward(flash_v2.forward, q, k, v, causal=causal, scale=scale)
    q2, k2, v2 = make_inputs(1, 2, 200, 150, 64, dtype=DTYPE[dt], xp=cp, scale=10.0)
    check_forward(flash_v2.forward, q2, k2, v2)
    wide = make_inputs(1, 2, 400, 150, 64, dtype=DTYPE[dt], xp=cp)[0]
    check_forward(flash_v2.forward, wide[:, :, ::2], k2, v2)  # a strided view, the shape (and key) of q
    with pytest.raises(TypeError, match="mixed numpy and CuPy"):
        flash_v2.forward(q, cp.asnumpy(k), v)
    with pytest.raises(TypeError, match="causal must be True or False"):
        flash_v2.forward(q, k, v, causal="no")
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        flash_v2.forward(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="out_dtype"):
        flash_v2.forward(q, k, v, out_dtype=np.float16)
    with pytest.raises(TypeError, match="share one dtype"):
        flash_v2.forward(q, k.astype(np.float16), v)


# every version at its dtypes, plain and causal, float32 o from 16 bits (the ring's partial results), and the
# variants through version pipelined's hooks (a window; softcap, ALiBi slopes as a tuple, dropout; grouped-query)
REPLAYS = ([(v, "fp32", {}) for v in ("fp32", "fp32_overlap", "fp32x3")]
           + [(v, d, {}) for v in ("tc", "pipelined") for d in LOW]
           + [(v, "bf16", {"out_dtype": np.float32}) for v in ("tc", "pipelined")]
           + [("pipelined", "fp16", {"window": (45, 0)}),
              ("pipelined", "bf16", {"softcap": 20.0, "alibi_slopes": (0.5, 0.25, 0.125, 0.0625), "dropout_p": 0.2,
                                     "seed": 7}),
              ("pipelined", "fp16", {"kv_heads": 2})])


@pytest.mark.gpu
@pytest.mark.parametrize("version,dt,kw", REPLAYS, ids=[f"{v}-{d}-{'-'.join(kw) or 'plain'}" for v, d, kw in REPLAYS])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fast_path_replays_the_plain_launch_bit_for_bit(version, dt, kw, causal):
    """The speed layer (stages/common/fast_path.py) is speed only: the first call of a key (which it records), and
    the calls after it (which replay the kept plan: joint outputs, no checks), give o and lse bit for bit equal to
    the plain launcher's (forward.__wrapped__, which keeps nothing), on new arrays of the same key too."""
    from stages.common import device

    cp = _cupy()
    dev = device.device()
    if (version == "fp32x3" and not device.tf32_tensor_cores(dev)) or (dt == "bf16" and not dev.arch.bf16):
        pytest.skip(f"version {version} in {dt} does not run on {dev.name}")
    kw = dict(kw)
    groups = kw.pop("kv_heads", 4)

    def inputs():  # fresh draws: q (2, 4, 333, 64), k and v (2, groups, 290, 64)
        q, k, v = make_inputs(2, 4, 333, 290, 64, dtype=DTYPE[dt], xp=cp)
        return q, k[:, :groups].copy(), v[:, :groups].copy()

    q, k, v = inputs()
    call = dict(causal=causal, version=version, **kw)
    flash_v2.forward.plans.clear()
    plain = flash_v2.forward.__wrapped__(q, k, v, **call)
    assert not flash_v2.forward.plans  # the plain launcher keeps nothing
    recorded = flash_v2.forward(q, k, v, **call)
    assert flash_v2.forward.plans.get(fast_path.call_key((q, k, v), call)) is not None
    replayed = flash_v2.forward(q, k, v, **call)
    for got in (recorded, replayed):
        for a, b in zip(got, plain):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))
    q2, k2, v2 = inputs()  # new arrays, the same key: the kept plan on new values
    for a, b in zip(flash_v2.forward(q2, k2, v2, **call), flash_v2.forward.__wrapped__(q2, k2, v2, **call)):
        np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))


@pytest.mark.gpu
def test_gpu_mixed_devices_raise():
    cp = _cupy()
    q, k, v = make_inputs(1, 1, 8, 8, 64, dtype=np.float32)
    with pytest.raises(TypeError, match="mixed numpy and CuPy"):
        flash_v2.forward(cp.asarray(q), k, v)
