"""Stage 06's launchers without a GPU: every kernel compiles for sm_90a within its limits, each launcher's
configuration (the rules, the instantiation, the shared memory, the grid, the parameter struct, the tensor maps) is
what its kernel expects, and off Hopper (numpy arrays, no GPU, another GPU) the API refuses with an error that names
the stage 02 / 03 versions to use, before any CUDA call. The arithmetic the kernels rely on:
tests/test_06_hopper_cpu.py; the kernels themselves: tests/test_06_hopper_gpu*.py."""
import inspect

import numpy as np
import pytest

from stages.common import bfloat16, device, variants
from stages.common import params as variants_params
from stages.hopper import (
    backward_steps, flash_v3, flash_v3_backward, flash_v3_backward_variants, flash_v3_variants, fp8, fp32x3, probes,
    sm90a,
)

H100 = device.emulate("sm_90")  # an H100's limits (emulated: the launchers refuse it, the limit checks read it)
COMPILED = {  # what: (instantiations, threads a block, dynamic shared memory of each, at most the H100's)
    "probes": (probes.instantiations(), 128, []),
    **{v: (flash_v3.instantiations(v), flash_v3.config(v, 64).threads,
           [flash_v3.config(v, D, w).smem for D, _, w in flash_v3.launch_choices(v)]) for v in flash_v3.VERSIONS},
    "fp32x3": (fp32x3.instantiations(), fp32x3.CONFIGS[64].threads, [fp32x3.smem_bytes(D) for D in fp32x3.HEAD_DIMS]),
    **{f"backward {v}": (flash_v3_backward.instantiations(v), flash_v3_backward.CONFIGS[v].threads,
                         [flash_v3_backward.smem_bytes(v, D) for D in flash_v3_backward.VERSION_HEAD_DIMS[v]])
       for v in flash_v3_backward.VERSIONS},
    "forward variants": (flash_v3_variants.instantiations(), 384,
                         [flash_v3_variants.tiles(D)[1] for D in flash_v3_variants.HEAD_DIMS]),
    "backward variants": (flash_v3_backward_variants.instantiations(), 384,
                          [backward_steps.smem_bytes("ws", D) for D in flash_v3_backward_variants.HEAD_DIMS]),
    "fp8": ([x for x in fp8.instantiations() if x[0] == fp8.ATTENTION_FILE], 384, [fp8.smem_bytes()]),
    "fp8 pre-pass": ([x for x in fp8.instantiations() if x[0] == fp8.FILE], fp8.THREADS, []),
}


@pytest.mark.slow  # up to a minute each: started first (conftest.py)
@pytest.mark.parametrize("what", list(COMPILED))
def test_every_stage_06_kernel_compiles_for_sm90a_within_limits(what):
    from stages.common import kernel_resources

    items, threads, smems = COMPILED[what]
    (file,) = {f for f, _ in items}
    names = [n for _, n in items]
    assert all(s <= H100.smem_optin for s in smems)  # Q_i and the K/V stages fit, the wide tiles too
    usage = kernel_resources.resource_usage(file, arch="sm_90a", name_expressions=[n for n in names if "<" in n])
    for name in names:
        u = usage[name]
        assert u["spill"] == 0, f"{name} spills {u['spill']} bytes"
        assert not u["wgmma_serialized"], f"ptxas serializes the wgmma instructions of {name}"
        assert u["registers"] * threads <= 65536 and u["static_smem"] <= device.STATIC_SMEM_LIMIT, (name, u)


def test_the_compiled_kernels_are_every_kernel_a_launcher_may_launch():
    """The compile test above and dev/compare_cubins_hopper.py both cover stages.hopper.instantiations(), each kernel
    once; the fp32x3 kernels' threads are one number for both head dims."""
    from stages import hopper

    listed = hopper.instantiations()
    assert len(set(listed)) == len(listed)
    assert sorted(x for items, _, _ in COMPILED.values() for x in items) == sorted(listed)
    assert {c.threads for c in fp32x3.CONFIGS.values()} == {COMPILED["fp32x3"][1]}


@pytest.mark.parametrize("version", ["wgmma", "ws"])
def test_the_backwards_exponentials_are_straight_line_code(version):
    """P^T's exponentials (hopper_bwd_tiles.cuh: probabilities_t) form one basic block in the PTX of every backward
    instantiation: no label and no branch between the first ex2 and the last. Written as `seen ? exp2(x) : 0`, each
    exponential sits behind a branch of its own, and the warp waits for each one in turn."""
    import re

    from stages.common import kernels

    names = [n for _, n in flash_v3_backward.instantiations(version)]
    ptx, _, lowered = kernels._compile(flash_v3_backward.FILES[version], "compute_90a", [], names, False)  # one module
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    bodies = {entry.split("(")[0].split()[-1]: entry for entry in text.split(".entry ")[1:]}
    for name in names:
        lines = bodies[lowered[name]].splitlines()
        at = [i for i, line in enumerate(lines) if "ex2.approx" in line]
        assert len(at) >= 32, f"{name}: {len(at)} exponentials in its PTX"
        jumps = [line for line in lines[at[0]:at[-1]] if re.match(r"\s*\$\w+:", line) or re.search(r"\bbra\b", line)]
        assert not jumps, f"{name}: {len(jumps)} labels or branches among P^T's exponentials: {jumps[:4]}"


def test_a_cubin_comes_back_whole():
    """CuPy's getCUBIN leaves off the cubin's last byte; kernels._whole_elf restores it from the ELF header."""
    from stages.common import kernels

    cubin = kernels.compile_only(probes.FILE, arch="sm_90a")
    assert kernels._whole_elf(cubin) == cubin and kernels._whole_elf(cubin[:-1]) == cubin
    assert cubin[-1] == 0


# ---------------------------------------------------------------- off Hopper: the error that names what to use
class _CupyLike:
    """Stands in for a CuPy array on a machine without a GPU: its class is from the cupy package (what stage 06 looks
    at first), and it has a shape and a dtype."""
    __module__ = "cupy._core.core"

    def __init__(self, shape, dtype):
        self.shape, self.dtype, self.ndim = shape, np.dtype(dtype), len(shape)


def _calls(xs, dtype):
    """(direction, call) of every public stage 06 function on arrays xs(shape, dtype)."""
    from stages import hopper

    q, lse = xs((1, 2, 64, 128), dtype), xs((1, 2, 64), np.float32)
    return [("forward", lambda: hopper.forward(q, q, q)), ("forward", lambda: flash_v3.forward(q, q, q, version="fp8")),
            ("backward", lambda: hopper.backward(q, q, q, q, lse, q)),
            ("backward", lambda: flash_v3_backward.backward(q, q, q, q, lse, q, causal=True))]


def _no_cuda(monkeypatch):
    """No CUDA call may happen: device.device (stage 06's only way to the GPU before a launch) fails the test."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(device, "device", lambda: pytest.fail("stage 06 asked for the GPU before refusing"))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32])
def test_numpy_arrays_are_refused_before_any_cuda_call_naming_stages_02_and_03(monkeypatch, dtype):
    _no_cuda(monkeypatch)
    for direction, call in _calls(lambda shape, dt: np.zeros(shape, dt), dtype):
        names = ("For float32 use stage 02 version 'fp32x3'" if dtype == np.float32 and direction == "forward" else
                 "Use stage 02 version 'pipelined' .forward. and stage 03 version 'tc'")
        with pytest.raises(TypeError, match=f"runs on an sm_90 GPU, on CuPy arrays; got ndarray. {names}"):
            call()


def test_without_a_gpu_stage_06_says_what_to_use(monkeypatch):
    """CuPy arrays, but CuPy sees no GPU (no driver, or CUDA_VISIBLE_DEVICES empty): device.UnsupportedDevice naming
    stages 02 and 03, not the CUDA runtime's error; takes() says no."""
    def no_gpu():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(device, "device", no_gpu)
    for _, call in _calls(_CupyLike, bfloat16):
        with pytest.raises(device.UnsupportedDevice, match="needs an sm_90 GPU .* sees no CUDA GPU .*stage 02 version"):
            call()
    assert not flash_v3.takes(bfloat16, 128)


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_89"])
def test_on_another_gpu_stage_06_says_what_to_use(monkeypatch, arch):
    """On an sm_75 / sm_80 / sm_89 GPU (its limits, no GPU needed) every public function refuses and names the stage
    02 / 03 versions that compute the same attention: the tensor-core ones for 16 bits, fp32x3 / fp32 for float32;
    so do the probes, and takes() says no."""
    gpu = device.emulate(arch)._replace(emulated=False, name=f"an {arch} GPU")
    monkeypatch.setattr(device, "device", lambda: gpu)
    for _, call in _calls(_CupyLike, np.float16):
        with pytest.raises(device.UnsupportedDevice, match=f"needs an sm_90 GPU .* is {arch}. Use stage 02 version "
                                                           "'pipelined' .forward. and stage 03 version 'tc'"):
            call()
    x = _CupyLike((1, 1, 64, 64), np.float32)
    with pytest.raises(device.UnsupportedDevice, match="float32 use stage 02 version 'fp32x3'"):
        flash_v3.forward(x, x, x)
    with pytest.raises(device.UnsupportedDevice, match="stage 02 version 'pipelined'"):
        probes.qk_scores(_CupyLike((64, 64), np.float16), _CupyLike((64, 64), np.float16))
    assert not flash_v3.takes(bfloat16, 128)
    with pytest.raises(device.UnsupportedDevice, match="sm_90"):  # an H100's plans under ATTN_ARCH=sm_90 emulation
        sm90a.require_hopper(dev=H100)


def test_stage_06_offers_the_one_api():
    """forward(q, k, v, *, causal=False, scale=None) -> o, lse and backward(q, k, v, o, lse, do, *, causal=False,
    scale=None) -> dq, dk, dv, as every stage does (flash_v3.forward and flash_v3_backward.backward)."""
    from stages import hopper

    assert hopper.forward is flash_v3.forward and hopper.backward is flash_v3_backward.backward
    for fn, arrays in ((hopper.forward, ["q", "k", "v"]), (hopper.backward, ["q", "k", "v", "o", "lse", "do"])):
        params = inspect.signature(fn).parameters
        assert list(params)[:len(arrays)] == arrays
        assert all(params[n].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for n in arrays)
        assert params["causal"].default is False and params["scale"].default is None
        assert params["causal"].kind is params["scale"].kind is inspect.Parameter.KEYWORD_ONLY


def test_stage_06_is_taken_only_where_it_computes_the_problem(monkeypatch):
    """The ring and the GPT ask flash_v3.takes before they pick stage 06 (and takes_block for its backward blocks):
    never in float32, at a head dim it has no kernel for, or with k / v heads that do not divide the query heads; on an
    sm_90 GPU grouped-query heads are taken (H100's limits, the sm_90 check passed)."""
    assert not flash_v3.takes(np.float32, 128)
    assert not flash_v3.takes(bfloat16, 96)
    monkeypatch.setattr(flash_v3, "require_hopper", lambda *a, **k: H100)
    assert flash_v3.takes(bfloat16, 128, heads=8, kv_heads=2) and flash_v3.takes(np.float16, 256, heads=8, kv_heads=1)
    assert not flash_v3.takes(bfloat16, 128, heads=8, kv_heads=3) and not flash_v3.takes(np.float32, 128)
    assert flash_v3_backward.takes_block(bfloat16, 64, heads=8, kv_heads=2)
    assert not flash_v3_backward.takes_block(bfloat16, 256) and not flash_v3_backward.takes_block(bfloat16, 64, heads=6,
                                                                                                   kv_heads=4)


# ---------------------------------------------------------------- each launcher's configuration, recorded
@pytest.fixture
def compiled(monkeypatch):
    """[(file, name, smem)] of every sm90a.function call, and stage 03's preprocess lookups: nothing is compiled."""
    seen = []
    record = lambda file, name, smem: seen.append((file, name, smem)) or name  # noqa: E731

    class Stage03Module:
        def get_function(self, name):
            seen.append(("flash_v2_backward_pre.cu", name, 0))
            return name

    for module in (flash_v3, flash_v3_backward, fp8, flash_v3_variants, flash_v3_backward_variants):
        monkeypatch.setattr(module, "function", record)
    monkeypatch.setattr(backward_steps, "load_module", lambda f, **kw: Stage03Module())
    backward_steps.pre_function.cache_clear()
    for plans in (flash_v3_variants.launch_rows, flash_v3_backward_variants._plan):  # plans made with the real compile
        plans.cache_clear()
    yield seen
    backward_steps.pre_function.cache_clear()
    for plans in (flash_v3_variants.launch_rows, flash_v3_backward_variants._plan):
        plans.cache_clear()


def _map_at(launch, field, params_type):
    return dict((off, tmap) for off, tmap in launch.maps)[getattr(params_type, field).offset]


def test_the_forward_launch_is_what_its_kernel_expects(compiled):
    """Version pingpong at D = 128 on rows 40..289 of q (300 rows a head) against keys 150..332 (333): the
    instantiation and shared memory of config(), one block per (Q tile, head) of the block's rows, the struct's sizes,
    and tensor maps that start at the rows' first and step over whole heads."""
    from stages.common import LOG2E

    B, H, Lq, Lk, D = 2, 3, 300, 333, 128
    launch = flash_v3.launch_rows("pingpong", np.dtype(np.float16), (B, H, Lq, D), Lk, (40, 290), (150, 333), True,
                                  0.1, merge=True)
    cfg = flash_v3.config("pingpong", D)
    assert compiled == [("flash_v3_forward_pingpong.cu", "flash_v3_forward_pingpong<__half,128,128,2,false>",
                         cfg.smem)]
    run = launch.launch
    assert run.grid == (2, B * H, 1) and run.block == (384, 1, 1) and run.smem == cfg.smem
    p = run.params
    assert (p.Nq, p.Nk, p.causal, p.o_rows, p.merge, p.heads) == (250, 183, 1, Lq, 1, B * H)
    assert p.scale_log2 == pytest.approx(0.1 * LOG2E)
    q_map, k_map = (_map_at(launch, f, flash_v3.HopperFwdParams) for f in ("map_q", "map_k"))
    assert q_map.dims == (D, 250, B * H) and q_map.strides == (D * 2, Lq * D * 2) and q_map.offset == 40 * D * 2
    assert k_map.box == (64, cfg.bc, 1) and k_map.offset == 150 * D * 2
    with pytest.raises(ValueError, match="only version pingpong launches a persistent grid, not 'ws'"):
        flash_v3.launch_rows("ws", np.dtype(np.float16), (1, 1, 64, 64), 64, (0, 64), (0, 64), False, 0.125,
                             merge=False, persistent=True)


def test_the_backward_launches_are_what_their_kernels_expect(compiled):
    """Version ws at D = 64: stage 03's preprocess, the main kernel (its instantiation, shared memory and a block per
    (K/V tile, head)), the dQ conversion or none (fuse_dq_rule); version wgmma does not convert dQ itself."""
    B, H, Nq, Nk, D = 1, 2, 100, 300, 64
    plan = flash_v3_backward.launches("ws", np.dtype(bfloat16), (B, H, Nq, D), Nk, False, 0.125, fuse_dq=False)
    assert ("flash_v3_backward_ws.cu", "flash_v3_backward_ws<__nv_bfloat16,64,2,128>",
            flash_v3_backward.smem_bytes("ws", 64)) in compiled
    assert {n for f, n, _ in compiled if f == "flash_v2_backward_pre.cu"} == {"bwd_preprocess<__nv_bfloat16>",
                                                                             "bwd_convert_dq<__nv_bfloat16>"}
    assert plan.main.launch.grid == (3, B * H, 1) and plan.convert is not None
    p = plan.main.launch.params
    assert (p.Nq, p.Nk, p.Nq_pad % flash_v3_backward.PAD, p.kv_rows, p.accumulate) == (Nq, Nk, 0, Nk, 0)
    fused = flash_v3_backward.launches("ws", np.dtype(bfloat16), (B, H, Nq, D), Nk, False, 0.125)
    assert fused.convert is None and flash_v3_backward.fuse_dq_rule("ws", Nq, D)
    with pytest.raises(ValueError, match="version 'wgmma' does not convert dQ itself"):
        flash_v3_backward.launches("wgmma", np.dtype(np.float16), (1, 1, 64, 64), 64, False, 0.125, fuse_dq=True)


def test_version_fp8s_launches_are_what_its_kernels_expect(compiled):
    """The three pre-pass kernels and the e4m3 attention kernel (kernels/flash_v3_forward_fp8.cu), its maps over
    bytes: q' and k' in boxes of 128 values, v'^T of `row_keys` keys a row in boxes of 64 rows."""
    plan = fp8.launches(np.dtype(np.float16), (1, 2, 100, 128), 90, False, 0.1)
    assert [n for _, n, _ in compiled] == ["fp8_amax<__half>", "fp8_scale_qk<__half>", "fp8_scale_vt<__half>",
                                           "flash_v3_forward_fp8<__half>"]
    assert compiled[-1] == (fp8.ATTENTION_FILE, "flash_v3_forward_fp8<__half>", fp8.smem_bytes())
    v_map = _map_at(plan.attention, "map_v", flash_v3.HopperFwdParams)
    assert v_map.dtype == "UINT8" and v_map.dims == (fp8.row_keys(90), 128, 2) and v_map.box == (128, 64, 1)


def test_sm90a_compiles_for_the_arch_specific_target(monkeypatch):
    """sm90a.function: one NVRTC module per instantiation (a template by its name expression, an extern "C" kernel by
    its file), compiled for sm_90a, with the shared memory the launch asks for."""
    loads, functions = [], []
    monkeypatch.setattr(sm90a, "load_module", lambda f, **kw: loads.append((f, kw)) or f)
    monkeypatch.setattr(sm90a.kernels, "function", lambda m, name, smem: functions.append((m, name, smem)) or name)
    sm90a.function.cache_clear()
    try:
        assert sm90a.function("a.cu", "k<__half,64>", 1000) == "k<__half,64>"
        assert sm90a.function(probes.FILE, "tile_bytes", 2000) == "tile_bytes"
        assert loads == [("a.cu", {"name_expressions": ("k<__half,64>",), "target": "sm_90a"}),
                         (probes.FILE, {"name_expressions": None, "target": "sm_90a"})]
        assert functions == [("a.cu", "k<__half,64>", 1000), (probes.FILE, "tile_bytes", 2000)]
    finally:
        sm90a.function.cache_clear()


def test_the_forward_launches_a_persistent_grid_only_for_version_pingpong_on_short_unmasked_items():
    most = flash_v3.PERSISTENT_MAX_KEYS
    assert flash_v3.persistent_rule("pingpong", False, most) and flash_v3.persistent_rule("pingpong", False, 1)
    assert not flash_v3.persistent_rule("pingpong", False, most + 1)
    assert not flash_v3.persistent_rule("pingpong", True, 128)
    assert not flash_v3.persistent_rule("ws", False, 128) and not flash_v3.persistent_rule("wgmma", False, 128)
    names = [n for _, n in flash_v3.instantiations("pingpong")]  # CI compiles both grids' kernels, the wide tiles'
    assert sum(n.endswith(",true>") for n in names) == 2 * len(flash_v3.HEAD_DIMS)
    assert sum(n.endswith(",false>") for n in names) == 2 * len(flash_v3.HEAD_DIMS) + 2


def test_the_forward_takes_wide_key_tiles_only_for_version_pingpong_at_d128_on_long_unmasked_items():
    """wide_rule: K/V tiles of WIDE_BC keys where persistent_rule gives a block per item, at D = 128 without a mask;
    the tiles fit the H100's shared memory; another version or head dim refuses them."""
    long_keys = flash_v3.PERSISTENT_MAX_KEYS + 1
    persistent = flash_v3.persistent_rule("pingpong", False, long_keys)
    assert not persistent and flash_v3.wide_rule("pingpong", 128, False, persistent)
    assert not flash_v3.wide_rule("pingpong", 128, False, True) and not flash_v3.wide_rule("pingpong", 128, True, False)
    assert [(v, D) for v in flash_v3.VERSIONS for D in flash_v3.HEAD_DIMS
            if flash_v3.wide_rule(v, D, False, False)] == [("pingpong", 128)]
    wide = flash_v3.config("pingpong", 128, wide=True)
    assert wide.bc == flash_v3.WIDE_BC and flash_v3.WIDE_BC % 16 == 0 and wide.smem <= H100.smem_optin
    for ctype in ("__half", "__nv_bfloat16"):  # CI compiles the wide instantiations (block per item only)
        assert (flash_v3.FILES["pingpong"], f"flash_v3_forward_pingpong<{ctype},128,{flash_v3.WIDE_BC},2,false>") in \
            flash_v3.instantiations("pingpong")
    for version, D in (("ws", 128), ("pingpong", 64), ("pingpong", 256)):
        with pytest.raises(ValueError, match=f"tiles of {flash_v3.WIDE_BC} keys are version pingpong's at D = 128"):
            flash_v3.config(version, D, wide=True)


def test_the_backward_converts_dq_in_its_main_kernel_only_on_short_heads_of_version_ws():
    rule, most = flash_v3_backward.fuse_dq_rule, backward_steps.FUSE_DQ_MAX
    assert rule("ws", most // 128, 128) and rule("ws", most // 64, 64)
    assert not rule("ws", most // 128 + 1, 128) and not rule("wgmma", 64, 64)


def test_the_cubin_comparison_tells_identical_changed_renamed_and_missing_kernels(tmp_path):
    """dev/compare_cubins_hopper.py's verdicts, on cubins given as bytes (no compile): the same bytes are identical,
    other bytes changed, a kernel renamed by --rename is compared under its new name, and a kernel on one side only
    says so; without cuobjdump no SASS is compared."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "dev" / "compare_cubins_hopper.py"
    spec = importlib.util.spec_from_file_location("compare_cubins_hopper", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    before = {"a<1>": ("f.cu", b"x"), "b<1>": ("f.cu", b"y"), "old<1>": ("g.cu", b"z"), "gone": ("f.cu", b"w")}
    after = {"a<1>": ("f.cu", b"x"), "b<1>": ("f.cu", b"Y"), "new<1>": ("h.cu", b"z"), "added": ("f.cu", b"v")}
    rows = script.compare(before, after, {"old<1>": "new<1>"}, None, tmp_path)
    verdicts = {r["name"]: r["verdict"] for r in rows}
    assert verdicts == {"a<1>": "identical", "b<1>": "changed", "new<1>": "identical", "gone": "only before",
                        "added": "only after"}
    assert next(r for r in rows if r["name"] == "new<1>")["was"] == "old<1>"
    table = script.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| new<1> | h.cu | identical |" in table


# ---------------------------------------------------------------- the variants' launches
def test_the_variants_forward_launch_is_what_its_kernel_expects(compiled):
    """Grouped-query k, v (8 query heads, 2 k / v heads), a window and softcap at D = 128: the level-2 hooks'
    instantiation, one block per (Q tile, head), the variants' fields where the hooks read them (var), exp2's factor
    log2 e (ModScore applies the scale), k and v maps over the k / v heads, and the call's pointers past the maps."""
    from stages.common import LOG2E
    from stages.hopper import params

    opts = variants.check(np.zeros((2, 8, 1, 1)), np.zeros((2, 2, 1, 1)), causal=True, window=(100, -1),
                          softcap=30.0)
    launch = flash_v3_variants.launch_rows(np.dtype(bfloat16), (2, 8, 300, 128), (2, 2, 500, 128), (0, 300),
                                           (0, 500), True, 0.1, flash_v3_variants.plan_options(opts), merge=False)
    bc, smem = flash_v3_variants.tiles(128)
    assert compiled == [(flash_v3_variants.FILE, "flash_v3_forward_variants<__nv_bfloat16,128,128,WindowMask,ModScore>",
                         smem)] and bc == 128
    run = launch.launch
    assert run.grid == (3, 16, 1) and run.block == (384, 1, 1) and run.smem == smem
    p = run.params
    assert (p.Nq, p.Nk, p.heads, p.merge) == (300, 500, 16, 0) and p.scale_log2 == pytest.approx(LOG2E)
    assert (p.var.H, p.var.group, p.var.left, p.var.right, p.var.softcap) == (8, 4, 100, 0, 30.0)
    assert p.var.scale == pytest.approx(0.1) and p.var.a_off == 0
    k_map = _map_at(launch, "map_k", params.HopperVarFwdParams)
    assert k_map.dims == (128, 500, 4) and k_map.box == (64, 128, 1)
    assert launch.tail == tuple(params.HopperVarFwdParams.var.offset + getattr(variants_params.FwdParams, f).offset
                                for f in ("slopes", "cu_q", "cu_k"))
    plain = flash_v3_variants.plan_options(variants.check(np.zeros((1, 4, 1, 1)), np.zeros((1, 4, 1, 1)),
                                                          causal=False, window=(8, 8)))
    packed = flash_v3_variants.launch_rows(np.dtype(np.float16), (1, 4, 1000, 64), (1, 4, 900, 64), (0, 1000),
                                           (0, 900), False, 0.125, plain, merge=False, varlen=(5, 300))
    assert packed.launch.grid[:2] == (3, 20) and packed.launch.params.scale_log2 == pytest.approx(0.125 * LOG2E)
    assert compiled[-1][1] == "flash_v3_forward_variants<__half,64,128,WindowMask,PlainScore>"


def test_the_variants_backward_launches_are_what_their_kernel_expects(compiled):
    """Multi-query k, v (4 query heads, 1 k / v head) at D = 64: the preprocess over the query heads, one block per
    (K/V tile, k / v head) with the group's counters when the kernel converts dQ, L_i and D_i by unswizzled tensor
    maps in boxes of a Q tile's rows, k and v maps over the k / v heads."""
    from stages.hopper import params

    opts = flash_v3_variants.plan_options(variants.check(np.zeros((1, 4, 1, 1)), np.zeros((1, 1, 1, 1)),
                                                         causal=True))
    plan = flash_v3_backward_variants._plan(np.dtype(bfloat16), (1, 4, 100, 64), (1, 1, 300, 64), True, 0.125, opts)
    name = "flash_v3_backward_variants<__nv_bfloat16,64,128,WindowMask,PlainScore>"
    assert (flash_v3_backward_variants.FILE, name, backward_steps.smem_bytes("ws", 64)) in compiled
    main = plan.main.launch
    assert main.grid == (3, 1, 1) and plan.convert is None and plan.pre.grid[1] == 4  # fused: 4 x 100 x 64 values
    assert plan.pre.params.n_done == 1  # one counter: one k / v head
    p = main.params
    assert (p.Nq, p.Nk, p.kv_rows, p.var.H, p.var.group, p.var.right) == (100, 300, 300, 4, 4, 0)
    lse_map = _map_at(plan.main, "map_lse", params.HopperVarBwdParams)
    assert lse_map.swizzle == "NONE" and lse_map.box == (128, 1) and lse_map.dims == (p.Nq_pad, 4)
    assert _map_at(plan.main, "map_k", params.HopperVarBwdParams).dims == (64, 300, 1)
    long = flash_v3_backward_variants._plan(np.dtype(bfloat16), (1, 4, 3000, 64), (1, 1, 300, 64), True, 0.125, opts)
    assert long.convert is not None and long.pre.params.n_done == 0  # 4 heads x 3000 rows: converted after the kernel


def test_stage_06_refuses_dropout_and_names_where_it_runs():
    """Stage 06 takes grouped-query heads, windows, softcap and ALiBi; dropout is a clear error naming stages 02 and
    03 (checked before any GPU call); plain options give no variants at all."""
    q, k = np.zeros((1, 4, 8, 64)), np.zeros((1, 2, 8, 64))
    kw = dict(causal=False, window=None, softcap=None, alibi_slopes=None, seed=0, where="flash_v3.forward")
    with pytest.raises(ValueError, match="not dropout: dropout runs in stage 02 version 'pipelined'.*stage 03"):
        flash_v3_variants.check_options(q, k, dropout_p=0.1, **kw)
    assert flash_v3_variants.check_options(q, q, dropout_p=0.0, **kw) is None
    assert flash_v3_variants.check_options(q, q, dropout_p=0.0, **{**kw, "window": (-1, -1)}) is None
    assert flash_v3_variants.check_options(q, k, dropout_p=0.0, **kw).group == 2
    with pytest.raises(ValueError, match="head dims .64, 128.*stage 03 version 'tc'"):
        flash_v3_backward_variants.check_head_dim(256, "flash_v3_backward")
