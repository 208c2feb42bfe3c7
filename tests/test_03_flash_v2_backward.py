"""Stage 03: FlashAttention-2 backward. The numpy tile mirror (CPU) and the CUDA kernels (gpu) against the
fp64 oracle by the tolerance rule, on the full case list, every version, dtype, head dim and dQ mode;
deterministic mode bit-identical across runs (compiles for every architecture: tests/test_portability.py)."""
import numpy as np
import pytest

from stages import flash_v2_backward as fb
from stages import naive
from stages.common import (
    bfloat16, cast, check_backward, check_forward, fast_path, make_inputs, max_error, to_numpy, tolerance, verify,
)
from tests.conftest import CASE_IDS, CASES, case_inputs

COMBOS = [("fp32", np.float32), ("tc", np.float16), ("tc", bfloat16), ("fp32x3", np.float32)]
COMBO_IDS = ["fp32", "tc-fp16", "tc-bf16", "fp32x3"]
MODES = [False, True]
MODE_IDS = ["atomic", "deterministic"]


def _modes(version):
    """The dQ modes a version runs: fp32x3 adds dQ atomically only (deterministic=True is version fp32's)."""
    return [False] if version == "fp32x3" else MODES


def _inputs(case, dtype, xp=np):
    """q, k, v at the case's input scale; dO at unit scale (tests/conftest.py case_inputs)."""
    return case_inputs(case, dtype, xp=xp)


def _check(q, k, v, do, causal, version, det):
    """check_backward by the rule, and the same call with out_dtype=float32: it rounds to exactly the default
    (deterministic mode: the same sums; float32 inputs: the same outputs)."""
    errs = check_backward(fb.backward, q, k, v, do, causal=causal, version=version, deterministic=det)
    if not det and version == "fp32x3":
        return errs
    o64, lse64 = tolerance.oracle(q, k, v, causal=causal)
    o, lse = verify.backward_start(q, o64, lse64)
    a = fb.backward(q, k, v, o, lse, do, causal=causal, version=version, deterministic=True)
    b = fb.backward(q, k, v, o, lse, do, causal=causal, version=version, deterministic=True, out_dtype=np.float32)
    for x, y in zip(a, b):
        assert y.dtype == np.float32
        np.testing.assert_array_equal(to_numpy(cast(y, q.dtype)).view(np.uint8), to_numpy(x).view(np.uint8))
    return errs


# ---------------------------------------------------------------- CPU: the tile mirror


# Every case x (fp32, tc-fp16, tc-bf16, fp32x3), but for CI time (this file must run in ~90 s on 2 cores) the one
# N = 4097 x 4097 case runs without tc-fp16 and fp32x3: float16's mirror code is tc-bf16's with another rounding
# (float16 there costs ~10 s of numpy), fp32x3's is fp32's with three matmuls for one; the GPU tests run both on it.
MIRROR_PARAMS = [pytest.param(case, combo, id=f"{cid}-{comboid}")
                 for case, cid in zip(CASES, CASE_IDS) for combo, comboid in zip(COMBOS, COMBO_IDS)
                 if not (case[2] * case[3] > 4_000_000 and comboid in ("tc-fp16", "fp32x3"))]


@pytest.mark.parametrize("case,combo", MIRROR_PARAMS)
def test_mirror_against_oracle(case, combo):
    version, dtype = combo
    (q, k, v, do), causal = _inputs(case, dtype)
    # the atomic order and the separate dQ pass, both; at N = 4097 x 4097 one mode each (CI time)
    modes = _modes(version) if q.shape[2] * k.shape[2] < 4_000_000 else [version == "tc"]
    for det in modes:
        errs = _check(q, k, v, do, causal, version, det)
        assert all(np.isfinite(e) for e in errs.values())


@pytest.mark.parametrize("version,D", [(v, d) for v in fb.VERSIONS for d in fb.HEAD_DIMS[v]])
@pytest.mark.parametrize("shape", [(2, 1, 100, 37, False), (1, 2, 100, 60, True), (1, 1, 200, 300, True)])
def test_mirror_every_head_dim(version, D, shape):
    B, H, Nq, Nk, causal = shape
    for dtype in fb.DTYPES[version]:
        q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, grad=True)
        for det in _modes(version):
            check_backward(fb.backward, q, k, v, do, causal=causal, version=version, deterministic=det)


def test_mirror_fully_masked_rows_are_zero_not_nan():
    q, k, v, do = make_inputs(1, 2, 100, 60, 64, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v, causal=True)
    assert np.isneginf(lse[:, :, :40]).all()
    for det in MODES:
        dq, dk, dv = fb.backward(q, k, v, o, lse, do, causal=True, deterministic=det)
        assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
        assert (dq[:, :, :40] == 0).all()


def test_mirror_modes_agree():
    """The atomic-order dQ and the separate dQ pass compute the same sum (up to fp32 reordering)."""
    q, k, v, do = make_inputs(2, 2, 150, 170, 64, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v, causal=True)
    a = fb.backward(q, k, v, o, lse, do, causal=True, deterministic=False)
    b = fb.backward(q, k, v, o, lse, do, causal=True, deterministic=True)
    np.testing.assert_array_equal(a[1], b[1])  # dk, dv: the same code path
    np.testing.assert_array_equal(a[2], b[2])
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)


def test_auto_version_and_errors():
    assert fb.resolve_version("auto", np.float32) == "fp32"
    assert fb.resolve_version("auto", np.float16) == "tc" and fb.resolve_version("auto", bfloat16) == "tc"
    q, k, v, do = make_inputs(1, 1, 8, 8, 64, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v)
    with pytest.raises(TypeError, match="version 'tc' takes float16, bfloat16"):
        fb.backward(q, k, v, o, lse, do, version="tc")
    with pytest.raises(ValueError, match="unknown version"):
        fb.backward(q, k, v, o, lse, do, version="pipelined")
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    with pytest.raises(TypeError, match="float64 is not supported"):
        fb.backward(q64, k64, v64, o.astype(np.float64), lse, do64)
    qh, kh, vh, doh = make_inputs(1, 1, 8, 8, 80, dtype=np.float16, grad=True)
    oh, lseh = naive.forward(qh, kh, vh)
    with pytest.raises(ValueError, match="head_dim 80 is not supported by version 'tc'"):
        fb.backward(qh, kh, vh, oh, lseh, doh)
    q2, k2, v2, do2 = make_inputs(1, 1, 8, 8, 256, dtype=np.float32, grad=True)  # d = 256: float32 says where it runs
    o2, lse2 = naive.forward(q2, k2, v2)
    with pytest.raises(ValueError, match="head_dim 256 is not supported by version 'fp32'.*'tc' .float16/bfloat16"):
        fb.backward(q2, k2, v2, o2, lse2, do2)
    q3, k3, v3, do3 = make_inputs(1, 1, 8, 8, 80, dtype=np.float32, grad=True)
    o3, lse3 = naive.forward(q3, k3, v3)
    with pytest.raises(ValueError, match="head_dim 80 is not supported by version 'fp32x3'.*one of .32, 64, 128"):
        fb.backward(q3, k3, v3, o3, lse3, do3, version="fp32x3")
    with pytest.raises(ValueError, match="'fp32x3' adds dQ with atomics.*deterministic=True runs in version 'fp32'"):
        fb.backward(q, k, v, o, lse, do, version="fp32x3", deterministic=True)
    with pytest.raises(ValueError, match="lse"):
        fb.backward(q, k, v, o, lse[..., :3], do)


def test_tc_tiles_are_named_and_checked():
    """The tc kernel's configurations are TcTiles records, the first one per head dim TC_BR x TC_BC; every candidate
    is one the kernel takes, and tiles_error says what is wrong with one it does not take. The pair layout's shared
    memory holds P^T too: Bc x (Br + 8) 16-bit values more."""
    from stages.flash_v2_backward import fp32x3, mirror, tc

    for D, cands in tc.TC_CANDIDATES.items():
        assert fb.tc_tiles(D) == cands[0] and cands[0][:2] == (tc.TC_BR[D], tc.TC_BC[D])
        for t in cands:
            assert isinstance(t, fb.TcTiles) and fb.tiles_error(D, *t) is None
            one, two = fb.smem_bytes("tc", D, t.br, t.bc, 1)[0], fb.smem_bytes("tc", D, t.br, t.bc, 2)[0]
            assert two - one == 2 * t.bc * (t.br + 8)
    assert fb.tiles_error(128, 64, 128, 3) == "wq must be 1 or 2, got 3"
    assert "Bc of 32 (wq=2)" in fb.tiles_error(128, 64, 48, 2)
    assert fb.tiles_error(128, 64, 48, 1) is None
    assert "needs min(Br, 32) to be a multiple of 32" in fb.tiles_error(256, 16, 32, 2)
    assert "dividing 128" in fb.tiles_error(64, 256, 128, 1)
    assert "dividing 128" in fb.tiles_error(64, 96, 128, 1)  # a multiple of 16 whose last tile would read past PAD
    assert "multiple of 16" in fb.tiles_error(64, 40, 128, 1)
    for D, cands in fp32x3.FP32X3_CANDIDATES.items():  # version fp32x3: the mirror's tiles are its first choice
        assert fb.fp32x3_tiles(D) == cands[0] and (cands[0].br, cands[0].bc) == mirror.tiles("fp32x3", D)
        assert all(isinstance(c, fb.Fp32x3Tiles) and fp32x3.fp32x3_smem(D, c) <= 227 * 1024 for c in cands)


BACKWARD_KERNEL_FILES = ["flash_v2_backward_pre.cu", "flash_v2_backward_fp32.cu", "flash_v2_backward_fp32x3.cu",
                         "flash_v2_backward_tc.cu", "flash_v2_backward_dq.cu"]


def _kernels(source):
    """{name: (parameters, lines)} of every __global__ function of CUDA source text: its parameter count (top-level
    commas of the list before the body, + 1) and its length from the __global__ line to the body's closing brace.
    Comments are blanked first (keeping the line breaks), so a brace or comma in one counts for nothing."""
    import re

    code = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m[0]), source, flags=re.S)
    out = {}
    for m in re.finditer(r"\b__global__\b", code):
        body = code.index("{", m.end())
        close, depth = code.rindex(")", m.end(), body), 0
        for opening in range(close, m.end(), -1):  # the parenthesis that opens the parameter list
            depth += {")": 1, "(": -1}.get(code[opening], 0)
            if depth == 0:
                break
        params, depth, count = code[opening + 1:close], 0, 0
        for ch in params:
            depth += {"(": 1, "<": 1, "[": 1, ")": -1, ">": -1, "]": -1}.get(ch, 0)
            count += ch == "," and depth == 0
        name = re.findall(r"(\w+)\s*$", code[m.end():opening])[0]
        depth, end = 0, body
        for end in range(body, len(code)):
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            if depth == 0:
                break
        out[name] = (count + 1 if params.strip() else 0, code.count("\n", m.start(), end) + 1)
    return out


def test_every_backward_kernel_takes_one_struct_and_reads_in_a_sitting():
    """The backward kernels take BwdParams, as the forward's take FwdParams (at most 8 parameters; kernels/params.cuh),
    and no kernel function is over 250 lines. The parser finds every kernel of the files, and a 9-parameter kernel
    and a long one, built here, fail the bounds."""
    from stages.common import kernels

    found = {}
    for name in BACKWARD_KERNEL_FILES:
        found.update(_kernels((kernels.KERNELS_DIR / name).read_text()))
    assert set(found) == {"bwd_preprocess", "bwd_convert_dq", "flash_bwd_fp32", "flash_bwd_dq_fp32", "flash_bwd_fp32x3",
                          "flash_v2_backward_tc", "flash_v2_backward_dq_tc"}
    assert {n: p for n, (p, _) in found.items() if p > 8} == {}
    assert {n: lines for n, (_, lines) in found.items() if lines > 250} == {}
    assert all(p == 1 for n, (p, _) in found.items() if n != "bwd_convert_dq")  # const __grid_constant__ BwdParams p
    wide = "template <int D>\n__global__ void __launch_bounds__(128, 2) k(const float* a, float (&b)[D], " + \
           "int c, int d, int e, int f, int g, int h, int i) {\n" + "  // {\n" * 260 + "}\n"
    assert _kernels(wide) == {"k": (9, 262)}


def test_run_py_runs_the_versions_that_take_the_head_dim(capsys):
    """run.py --version all (the default) runs each version that takes --head-dim, and stops with the supported
    head dims when none does."""
    import importlib

    run = importlib.import_module("stages.flash_v2_backward.run")
    assert run.parse(["--head-dim", "256"]).versions == ("tc",)
    assert run.parse(["--head-dim", "32"]).versions == ("fp32", "fp32x3")
    assert run.parse([]).versions == ("fp32", "tc", "fp32x3")
    for bad in (["--head-dim", "80"], ["--head-dim", "256", "--version", "fp32"]):
        with pytest.raises(SystemExit):
            run.parse(bad)
        assert "version fp32 takes head dims 32, 64, 128" in capsys.readouterr().err


@pytest.mark.parametrize("causal", [False, True])
def test_mirror_fp32_against_stage01(causal):
    """The fp32 version (its numpy mirror here) against stage 01's backward on the same inputs."""
    from stages import flash_v1

    q, k, v, do = make_inputs(2, 2, 150, 97, 64, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)
    ours = fb.backward(q, k, v, o, lse, do, causal=causal, version="fp32")
    theirs = flash_v1.backward(q, k, v, o, lse, do, causal=causal)
    for a, b in zip(ours, theirs):
        assert max_error(a, b) <= 1e-5 * float(np.abs(b).max()) + 1e-6


def test_forward_is_the_shared_api():
    """forward() delegates to stage 02 (or stage 01 for float32 while stage 02 is missing)."""
    q, k, v = make_inputs(1, 2, 70, 50, 64, dtype=np.float32)
    check_forward(fb.forward, q, k, v, causal=True)


# ---------------------------------------------------------------- GPU: the kernels

# every (version, dtype, head dim) the kernels take
KERNEL_COMBOS = [(v, dt, D) for v in fb.VERSIONS for dt in fb.DTYPES[v] for D in fb.HEAD_DIMS[v]]
KERNEL_IDS = [f"{v}-{np.dtype(dt).name}-d{D}" for v, dt, D in KERNEL_COMBOS]


def _check_both_modes(q, k, v, do, causal, version):
    """The rule for the atomic and the deterministic dQ modes, outputs poisoned before launch."""
    for det in _modes(version):
        _check(q, k, v, do, causal, version, det)


@pytest.mark.gpu
@pytest.mark.parametrize("combo", KERNEL_COMBOS, ids=KERNEL_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_against_oracle(case, combo):
    """The full case list, at every head dim of every version and dtype, both dQ modes, poisoned outputs."""
    import cupy

    version, dtype, D = combo
    case = case[:4] + (D,) + case[5:]  # the case at this head dim
    (q, k, v, do), causal = _inputs(case, dtype, xp=cupy)
    _check_both_modes(q, k, v, do, causal, version)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] in (7, 100, 1000)], ids=lambda c: f"q{c[2]}k{c[3]}")
def test_tc_other_dq_order(case, D, dtype):
    """The tc kernel with the non-default order of its atomic dQ (tc_config defer_dq: not TC_DEFER_DQ) still passes.
    A call with a tc_config (a dict) is never kept by the speed layer, so this runs the other instantiation, not a plan
    kept from another test of the same shapes."""
    import cupy

    from stages.flash_v2_backward import tc

    (q, k, v, do), causal = _inputs(case[:4] + (D,) + case[5:], dtype, xp=cupy)
    check_backward(fb.backward, q, k, v, do, causal=causal, version="tc",
                   tc_config={"defer_dq": not tc.TC_DEFER_DQ})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] in (7, 100, 1000)], ids=lambda c: f"q{c[2]}k{c[3]}")
def test_tc_warp_layouts_agree(case, D, dtype):
    """Both warp layouts of the tc kernel (TcTiles.wq = 1: a warp per 16 key rows; 2: pairs of warps per 32 rows, P^T
    and dS^T through shared memory) at the head dim's first tiles that take both on this GPU (or the architecture
    ATTN_ARCH names) pass the rule in both dQ modes, and give dK_j, dV_j bit for bit alike: every sum runs in the
    same order, only which warp computes a product moves. In deterministic mode dQ is alike too (its pass is the
    same kernel)."""
    import cupy

    from stages.common import device
    from stages.flash_v2_backward import tc

    dev = device.device()
    both = [(t.br, t.bc) for t in tc.TC_CANDIDATES[D]
            if all(not fb.tiles_error(D, t.br, t.bc, wq) and device.fits(dev, fb.smem_bytes("tc", D, t.br, t.bc, wq)[0])
                   for wq in (1, 2))]
    if not both:
        pytest.skip(f"no tiles of d={D} take both warp layouts within {dev.arch.name}'s shared memory")
    br, bc = both[0]
    (q, k, v, do), causal = _inputs(case[:4] + (D,) + case[5:], dtype, xp=cupy)
    o, lse = verify.backward_start(q, *tolerance.oracle(q, k, v, causal=causal))
    for det in (False, True):
        if det and not device.fits(dev, fb.smem_bytes("tc", D, br, bc)[1]):
            continue  # the deterministic dQ pass does not fit this architecture (its own test says so)
        grads = []
        for wq in (1, 2):
            cfg = {"br": br, "bc": bc, "wq": wq}
            check_backward(fb.backward, q, k, v, do, causal=causal, version="tc", deterministic=det, tc_config=cfg)
            grads.append(fb.backward(q, k, v, o, lse, do, causal=causal, deterministic=det, tc_config=cfg))
        for a, b in list(zip(*grads))[0 if det else 1:]:
            np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=["fp32", "bf16"])
def test_gpu_a_repeated_call_is_checked_and_planned_like_the_first(dtype):
    """backward keeps each checked plain GPU call's planned launches under fast_path.call_key. A repeat gives
    the same gradients (deterministic mode: bit for bit); a call that differs in one argument, or new values of the
    same shape, is right by the rule; and bad input is still refused after a good call with the same shapes."""
    import cupy

    q, k, v, do = make_inputs(1, 2, 200, 150, 64, dtype=dtype, xp=cupy, grad=True)
    o, lse = verify.backward_start(q, *tolerance.oracle(q, k, v))
    first = fb.backward(q, k, v, o, lse, do, deterministic=True)
    assert fb.backward.plans.get(fast_path.call_key((q, k, v, o, lse, do), {"deterministic": True})) is not None
    again = fb.backward(q, k, v, o, lse, do, deterministic=True)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))
    for causal, scale, det in ((True, None, False), (False, 0.05, True), (True, 0.3, False), (False, None, False)):
        for _ in range(2):  # the first call checks, the second goes straight to the launches
            check_backward(fb.backward, q, k, v, do, causal=causal, scale=scale, deterministic=det)
    q2, k2, v2, do2 = make_inputs(1, 2, 200, 150, 64, dtype=dtype, xp=cupy, grad=True, scale=10.0)
    check_backward(fb.backward, q2, k2, v2, do2)
    with pytest.raises(TypeError, match="mixed numpy and CuPy"):
        fb.backward(q, k, v, o, lse, cupy.asnumpy(do))
    with pytest.raises(TypeError, match="causal must be True or False"):
        fb.backward(q, k, v, o, lse, do, causal="no")
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        fb.backward(q, k, v, o, lse, do, deterministic="yes")
    with pytest.raises(ValueError, match="scale must be a finite positive number"):
        fb.backward(q, k, v, o, lse, do, scale=0.0)
    if dtype != np.float32:  # tuning options of version tc: a bad value is refused, not read as another one
        with pytest.raises(ValueError, match="wq must be 1 or 2, got 0"):
            fb.backward(q, k, v, o, lse, do, tc_config={"wq": 0})
        with pytest.raises(ValueError, match="defer_dq, j_fast and fuse_dq must be True or False"):
            fb.backward(q, k, v, o, lse, do, tc_config={"j_fast": 1})
        with pytest.raises(ValueError, match="defer_dq, j_fast and fuse_dq must be True or False"):
            fb.backward(q, k, v, o, lse, do, tc_config={"fuse_dq": "no"})
        with pytest.raises(ValueError, match="takes the keys br, bc, wq, defer_dq, j_fast"):
            fb.backward(q, k, v, o, lse, do, tc_config={"order": 1})


# tc_config options that change who does what, not the answer: the block order and who converts dQ
TC_ORDERS_AND_DQ = [{"j_fast": False}, {"j_fast": True}, {"fuse_dq": False}, {"fuse_dq": True}]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TC_ORDERS_AND_DQ, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] in (7, 100, 1000)], ids=lambda c: f"q{c[2]}k{c[3]}")
def test_tc_block_orders_and_dq_conversions(case, D, dtype, cfg):
    """The tc kernel passes in either block order (tc_config j_fast; j_fast_order picks one by mask and length):
    the blocks of a head finish in another order, and whichever finishes last converts the head's dQ. And with
    dQ = scale * dQ_accum written by each head's last block or by bwd_convert_dq after the kernel (fuse_dq;
    fuse_dq_rule picks one by size), in the inputs' dtype and in float32 (the ring's partial gradients)."""
    import cupy

    def float32_then_rounded(*args, **kw):  # the float32 gradients, rounded to the inputs' dtype for the rule
        grads = fb.backward(*args, out_dtype=np.float32, **kw)
        assert all(g.dtype == np.float32 for g in grads)
        return tuple(cast(g, dtype) for g in grads)

    (q, k, v, do), causal = _inputs(case[:4] + (D,) + case[5:], dtype, xp=cupy)
    for backward in (fb.backward, float32_then_rounded) if "fuse_dq" in cfg else (fb.backward,):
        check_backward(backward, q, k, v, do, causal=causal, version="tc", tc_config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, bfloat16], ids=["fp16", "bf16"])
def test_plain_outputs_share_one_allocation(dtype):
    """A repeated plain tc backward (its plan kept by fast_path) carves dq, dk, dv from one allocation
    (fast_path.empties): each on its own 256-byte-aligned range, none overlapping, with the shapes and dtype of q, k,
    v (Nq != Nk); a forward's o and lse likewise."""
    import cupy

    from stages import flash_v2

    q, k, v, do = make_inputs(2, 3, 70, 45, 64, dtype=dtype, xp=cupy, grad=True)
    for _ in range(2):  # the first call plans, the second takes the kept plan
        o, lse = flash_v2.forward(q, k, v)
        grads = fb.backward(q, k, v, o, lse, do)
    for outs, like in ((grads, (q, k, v)), ((o, lse), (q, lse))):
        spans = sorted((x.data.ptr, x.data.ptr + x.nbytes) for x in outs)
        assert all(a % 256 == 0 for a, _ in spans) and all(e <= a for (_, e), (a, _) in zip(spans, spans[1:]))
        assert len({x.data.mem.ptr for x in outs}) == 1  # one pool allocation
        assert [(x.shape, x.dtype) for x in outs] == [(y.shape, y.dtype) for y in like]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [32, 64, 128])
def test_fp32_kernel_against_stage01(D, causal):
    """The fp32 version against stage 01's backward (FlashAttention v1, fp32) on the same inputs."""
    import cupy

    from stages import flash_v1

    q, k, v, do = make_inputs(2, 2, 300, 257, D, dtype=np.float32, xp=cupy, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)
    ours = fb.backward(q, k, v, o, lse, do, causal=causal, version="fp32")
    theirs = flash_v1.backward(q, k, v, o, lse, do, causal=causal)
    for a, b in zip(ours, theirs):
        scale = float(cupy.abs(b).max())
        assert max_error(a, b) <= 1e-5 * scale + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("combo", COMBOS[:3], ids=COMBO_IDS[:3])  # the versions with a deterministic mode
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_mode_is_bit_identical(combo, causal):
    import cupy

    version, dtype = combo
    q, k, v, do = make_inputs(2, 4, 1000, 1500, 64, dtype=dtype, xp=cupy, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)
    runs = [fb.backward(q, k, v, o, lse, do, causal=causal, version=version, deterministic=True) for _ in range(5)]
    for n, name in enumerate(("dq", "dk", "dv")):
        first = to_numpy(runs[0][n]).view(np.uint8)
        for r in runs[1:]:
            assert np.array_equal(first, to_numpy(r[n]).view(np.uint8)), f"{name} differs between runs"
    atomic = fb.backward(q, k, v, o, lse, do, causal=causal, version=version)
    assert max_error(atomic[0], runs[0][0]) < 1e-2 * float(np.abs(to_numpy(runs[0][0]).astype(np.float32)).max())


@pytest.mark.gpu
@pytest.mark.parametrize("version,D", [("fp32", 64), ("fp32x3", 64), ("fp32x3", 128)])
def test_kernel_matches_mirror(version, D):
    """The GPU kernel and the numpy mirror run the same algorithm: close to fp32 rounding."""
    import cupy

    q, k, v, do = make_inputs(1, 2, 333, 257, D, dtype=np.float32, grad=True)
    o, lse = naive.forward(q, k, v, causal=True)
    cpu = fb.backward(q, k, v, o, lse, do, causal=True, version=version)
    gpu = fb.backward(*(cupy.asarray(x) for x in (q, k, v, o, lse, do)), causal=True, version=version)
    for a, b in zip(cpu, gpu):
        np.testing.assert_allclose(to_numpy(b), a, rtol=1e-4, atol=1e-5)
