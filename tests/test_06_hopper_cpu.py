"""Stage 06's CPU part: the swizzled layouts and the wgmma descriptor (layouts.py), the mbarrier pipeline and the
warpgroup schedules (schedules.py). Each property is also shown to fail on a wrong layout or protocol."""
import numpy as np
import pytest

from stages.hopper import layouts as L
from stages.hopper import schedules as S

MODES = (128, 64, 32)


@pytest.mark.parametrize("mode", MODES)
def test_swizzle_permutes_chunks_inside_each_pattern(mode):
    addr = np.arange(8 * 8 * mode)  # eight patterns of 8 lines
    out = L.swizzle(addr, mode)
    assert sorted(out) == list(addr)  # a bijection
    assert (out // (8 * mode) == addr // (8 * mode)).all()  # that stays inside its pattern
    assert (out % 16 == addr % 16).all()  # and moves whole 16-byte chunks
    assert (out[: 128] == addr[: 128]).all()  # line 0 is not moved


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows,cols", [(64, 64), (128, 128), (64, 256), (8, 64)])
def test_a_tile_fills_its_bytes_once(mode, rows, cols):
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = L.tile_offset(r, c, rows=rows, cols=cols, mode=mode)
    assert sorted(off.ravel() // 2) == list(range(rows * cols))


@pytest.mark.parametrize("mode", MODES)
def test_a_core_matrix_is_read_in_one_pass_only_when_swizzled(mode):
    cols = mode // 2  # one panel
    for chunk in range(mode // 16):
        for r0 in (0, 8, 24):
            rows8 = [L.tile_offset(r, chunk * 8, rows=64, cols=cols, mode=mode) for r in range(r0, r0 + 8)]
            assert L.wavefronts(rows8) == 1
            plain = [r * mode + chunk * 16 for r in range(r0, r0 + 8)]  # the same rows, not swizzled
            assert L.wavefronts(plain) == mode // 16  # 128 / mode rows per line: 8, 4, 2 passes

def test_a_wrong_swizzle_conflicts():
    wrong = [r * 128 + ((3 ^ (r % 4)) * 16) for r in range(8)]  # XOR with r mod 4: rows r and r + 4 collide
    assert L.wavefronts(wrong) == 2


def test_dq_stores_cover_the_buffer_once_and_take_one_pass_per_half_warp_only_in_the_kernels_order():
    for spread in (True, False):
        offsets = [o for nb in range(8) for upper in (False, True)
                   for o in L.dq_store_offsets(nb, upper=upper, spread=spread)]
        assert len(set(offsets)) == 512 and all(o % 8 == 0 for o in offsets)  # 16 rows x 32 pairs, each once
        logical = sorted(set(r * 128 + c * 8 + p * 8192 for r in range(16) for c in range(16) for p in (0, 1)))
        assert sorted(offsets) == sorted(L.swizzle(np.array(logical), 128).tolist())
        for nb in range(8):
            for upper in (False, True):
                off = L.dq_store_offsets(nb, upper=upper, spread=spread)
                passes = [L.wavefronts(off[h:h + 16], access_bytes=8) for h in (0, 16)]
                assert passes == ([1, 1] if spread else [2, 2])


def test_descriptor_fields():
    d = L.descriptor(1024, sbo=1024)
    assert d == 0x4000004000010040
    assert L.decode(d) == {"start": 1024, "lbo": 16, "sbo": 1024, "base_offset": 0, "mode": 128}
    assert L.decode(L.descriptor(2048 + 96, sbo=512, mode=64))["start"] == 2048 + 96


@pytest.mark.parametrize("start,kw,msg", [
    (1032, {}, "multiple of 16"), (1 << 18, {}, "256 KiB"), (1024 + 512, {}, "1024-byte boundary"),
    (1024, {"mode": 16}, "swizzle mode"), (1024, {"sbo": 1000}, "sbo"),
])
def test_descriptor_refuses_what_it_cannot_hold(start, kw, msg):
    with pytest.raises(ValueError, match=msg):
        L.descriptor(start, **{"sbo": 1024, **kw})


def _smem_with(tile, at, mode=128):
    smem = np.zeros(at + tile.nbytes, np.uint8)
    smem[at:] = L.store_tile(tile, mode=mode)
    return smem


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("rows", [64, 128])
def test_wgmma_reads_back_what_the_copy_engine_wrote(D, rows):
    """K-major operand, 128-byte swizzle: K step k (16 values, 32 bytes) of panel p is the descriptor of the panel's
    start, moved 32 bytes per step inside the 128-byte line."""
    x = np.arange(rows * D, dtype=np.uint16).reshape(rows, D)
    base = 3 * 1024
    smem = _smem_with(x, base)
    for k in range(D // 16):
        panel, within = divmod(k * 32, 128)
        desc = L.descriptor(base + panel * rows * 128 + within, sbo=1024)
        assert (L.read_operand(smem, desc, rows=rows) == x[:, 16 * k: 16 * k + 16]).all()


def test_a_wrong_descriptor_reads_other_values():
    x = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64)
    smem = _smem_with(x, 1024)
    right = x[:, 16:32]
    assert not (L.read_operand(smem, L.descriptor(1024 + 32, sbo=512), rows=64) == right).all()  # SBO: 8 rows apart
    assert not (L.read_operand(smem, L.descriptor(1024 + 32, sbo=1024, mode=0), rows=64) == right).all()  # no swizzle


@pytest.mark.parametrize("D", [64, 128, 256])
def test_an_mn_major_read_of_the_same_tile_gives_its_key_rows(D):
    """V's tile, written as K's is, read as wgmma's MN-major B: K step s (16 keys) starts 2048 bytes further, panels
    of 64 columns are LBO apart."""
    v = np.arange(64 * D, dtype=np.uint16).reshape(64, D)
    smem = _smem_with(v, 2048)
    for s in range(4):
        got = L.read_operand_mn(smem, L.descriptor(2048 + 2048 * s, sbo=1024, lbo=64 * 128), n=D)
        assert (got == v[16 * s:16 * s + 16]).all()
    if D > 64:  # a wrong panel offset reads other columns
        assert not (L.read_operand_mn(smem, L.descriptor(2048, sbo=1024, lbo=1024), n=D) == v[:16]).all()


# ---------------------------------------------------------------- the pipeline
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("t_load,t_compute", [(3, 2), (2, 3), (2, 2), (1, 5)])
def test_pipeline_time(stages, t_load, t_compute):
    n = 9
    run = S.simulate_pipeline(n, stages, t_load, t_compute)
    if stages == 1:
        assert run.ticks == n * (t_load + t_compute)  # nothing overlaps
    else:  # the first load, then one tile per max(load, compute), then the last compute
        assert run.ticks == t_load + (n - 1) * max(t_load, t_compute) + t_compute
    assert [c[0] for c in run.computes] == list(range(n))


def test_pipeline_mistakes_are_caught():
    with pytest.raises(S.RaceError, match="holds nothing"):  # the consumer's parity inverted: it does not wait
        S.simulate_pipeline(6, 2, 3, 2, consumer_parity=lambda n: (n & 1) ^ 1)
    with pytest.raises(S.RaceError, match="while tile"):  # the producer does not wait for empty stages
        S.simulate_pipeline(6, 2, 1, 3, producer_waits=False)
    with pytest.raises(RuntimeError, match="deadlock"):  # the producer waits for a release before the first use
        S.simulate_pipeline(6, 2, 1, 3, producer_parity=lambda n: n & 1)


def test_one_bit_of_phase_suffices_but_not_zero():
    b = S.MBarrier()
    assert b.try_wait_parity(1) and not b.try_wait_parity(0)  # phase 0 running: parity 1 "completed" (the start)
    b.arrive()
    assert b.try_wait_parity(0) and not b.try_wait_parity(1)


# ---------------------------------------------------------------- the warpgroups
@pytest.mark.parametrize("D", [64, 128])
def test_pingpong_keeps_the_tensor_cores_busy(D):
    g, s = S.tile_times(D)
    n = 64
    _, _, one = S.schedule_warpgroups(n, g, s, "one")
    _, _, together = S.schedule_warpgroups(n, g, s, "together")
    _, _, pingpong = S.schedule_warpgroups(n, g, s, "pingpong")
    _, _, overlap = S.schedule_warpgroups(n, g, s, "overlap")
    assert one == pytest.approx(2 * g / (2 * g + s))
    assert together == pytest.approx(4 * g / (4 * g + s))
    assert s <= 2 * g and pingpong > 0.99  # the softmax hides under the other warpgroup's two GEMMs
    assert overlap > one and pingpong > together


@pytest.mark.parametrize("g,s", [(1.0, 0.5), (1.0, 1.0), (1.0, 2.5)])
def test_overlap_hides_the_softmax_under_one_gemm(g, s):
    """Within one warpgroup a tile after the first costs one GEMM plus the longer of the softmax and the other GEMM
    (GEMM1 of the tile before, issued with GEMM0): the tensor cores are busy 2 g / (g + max(g, s)) in the long run."""
    n = 200
    iv, T, busy = S.schedule_warpgroups(n, g, s, "overlap")
    assert T == pytest.approx(g + s + (n - 1) * (g + max(g, s)) + g)
    assert busy == pytest.approx(2 * n * g / T)
    softmax = {label: (b, e) for u, label, b, e in iv if u == "wg0"}
    gemm1 = {label: (b, e) for u, label, b, e in iv if u == "tc" and label.startswith("G1")}
    b, _ = softmax["softmax 5"]
    assert gemm1["G1 4"][0] == pytest.approx(b)  # the softmax of tile 5 starts with GEMM1 of tile 4


def test_pingpong_is_bounded_by_the_softmax_when_it_is_longer():
    g, s = 1.0, 3.0  # a softmax longer than the other warpgroup's two GEMMs cannot hide
    _, T, u = S.schedule_warpgroups(64, g, s, "pingpong")
    assert u < 0.9 and T >= 64 * (g + s)


def test_schedules_refuse_bad_input():
    with pytest.raises(ValueError, match="policy"):
        S.schedule_warpgroups(4, 1.0, 1.0, "fast")
    with pytest.raises(ValueError):
        S.simulate_pipeline(0, 2, 1, 1)


# ---------------------------------------------------------------- the sm_90a kernels, compiled without a GPU
@pytest.mark.slow  # up to a minute each: started first (conftest.py)
@pytest.mark.parametrize("what", ["blocks", "wgmma", "ws", "pingpong", "fp32x3", "backward wgmma", "backward ws",
                                  "fp8", "fp8 pre-pass"])
def test_every_stage_06_kernel_compiles_for_sm90a_within_limits(what):
    from stages.common import device, kernel_resources
    from stages.hopper import blocks, flash_v3, flash_v3_backward, fp8, fp32x3

    if what == "blocks":
        file, names, threads = blocks.FILE, blocks.kernel_names(), 128
    elif what == "fp8":  # the e4m3 instantiations of the ping-pong kernel
        file, names, threads = flash_v3.FILES["pingpong"], fp8.kernel_names(), 384
        assert fp8.smem_bytes() <= device.emulate("sm_90").smem_optin
    elif what == "fp8 pre-pass":
        file, names, threads = fp8.FILE, fp8.prepass_names(), fp8.THREADS
    elif what == "fp32x3":  # the float32 forward: its tiles of TF32 parts fit the H100's shared memory
        file, names, threads = fp32x3.FILE, fp32x3.kernel_names(), fp32x3.CONFIGS[64].threads
        assert all(fp32x3.smem_bytes(D) <= device.emulate("sm_90").smem_optin for D in fp32x3.HEAD_DIMS)
        assert {c.threads for c in fp32x3.CONFIGS.values()} == {threads}
    elif what.startswith("backward"):
        version = what.split()[1]
        file, names = flash_v3_backward.FILES[version], flash_v3_backward.kernel_names(version)
        threads = flash_v3_backward.CONFIGS[version].threads
        assert all(flash_v3_backward.smem_bytes(version, D) <= device.emulate("sm_90").smem_optin
                   for D in flash_v3_backward.VERSION_HEAD_DIMS[version])
    else:
        file, names, threads = flash_v3.FILES[what], flash_v3.kernel_names(what), flash_v3.config(what, 64).threads
        # Q_i and the K/V stages fit the H100's shared memory at every head dim, the wide tiles too
        assert all(flash_v3.smem_bytes(what, D, w) <= device.emulate("sm_90").smem_optin
                   for D, _, w in flash_v3.variants(what))
    usage = kernel_resources.resource_usage(file, arch="sm_90a", name_expressions=[n for n in names if "<" in n])
    for name in names:
        u = usage[name]
        assert u["spill"] == 0, f"{name} spills {u['spill']} bytes"
        assert not u["wgmma_serialized"], f"ptxas serializes the wgmma instructions of {name}"
        assert u["registers"] * threads <= 65536 and u["static_smem"] <= device.STATIC_SMEM_LIMIT, (name, u)


@pytest.mark.parametrize("version", ["wgmma", "ws"])
def test_the_backwards_exponentials_are_straight_line_code(version):
    """P^T's exponentials (hopper_bwd_tiles.cuh: probabilities_t) form one basic block in the PTX of every backward
    instantiation: no label and no branch between the first ex2 and the last. Written as `seen ? exp2(x) : 0`, each
    exponential sits behind a branch of its own, and the warp waits for each one in turn."""
    import re

    from stages.common import kernels
    from stages.hopper import flash_v3_backward as fb

    names = fb.kernel_names(version)
    ptx, _, lowered = kernels._compile(fb.FILES[version], "compute_90a", [], names, False)  # one module, all kernels
    text = ptx.decode() if isinstance(ptx, bytes) else ptx
    bodies = {entry.split("(")[0].split()[-1]: entry for entry in text.split(".entry ")[1:]}
    for name in names:
        lines = bodies[lowered[name]].splitlines()
        at = [i for i, line in enumerate(lines) if "ex2.approx" in line]
        assert len(at) >= 32, f"{name}: {len(at)} exponentials in its PTX"
        jumps = [line for line in lines[at[0]:at[-1]] if re.match(r"\s*\$\w+:", line) or re.search(r"\bbra\b", line)]
        assert not jumps, f"{name}: {len(jumps)} labels or branches among P^T's exponentials: {jumps[:4]}"


def test_stage_06_names_what_to_use_on_other_gpus():
    """Off sm_90 (here the emulated architectures' limits, no GPU needed) stage 06 refuses and names the stage 02/03
    versions that run the same attention: the tensor-core ones for 16 bits, fp32x3 / fp32 for float32."""
    from stages.common import device
    from stages.hopper import blocks

    for arch in ("sm_75", "sm_80", "sm_89"):
        with pytest.raises(device.UnsupportedDevice, match="stage 02 version 'pipelined'"):
            blocks.require_hopper(device.emulate(arch))
        with pytest.raises(device.UnsupportedDevice, match="float32 use stage 02 version 'fp32x3'"):
            blocks.require_hopper(device.emulate(arch), instead=blocks.ELSEWHERE_FP32)
    with pytest.raises(device.UnsupportedDevice, match="sm_90"):  # an H100's plans under ATTN_ARCH=sm_90 emulation
        blocks.require_hopper(device.emulate("sm_90"))


def test_a_cubin_comes_back_whole():
    """CuPy's getCUBIN leaves off the cubin's last byte; kernels._whole_elf restores it from the ELF header."""
    from stages.common import kernels

    cubin = kernels.compile_only("hopper_blocks.cu", arch="sm_90a")
    assert kernels._whole_elf(cubin) == cubin and kernels._whole_elf(cubin[:-1]) == cubin
    assert cubin[-1] == 0


def test_stage_06_is_taken_only_where_it_computes_the_problem():
    """The ring and the GPT ask flash_v3.takes before they pick stage 06: never in float32, at a head dim it has no
    kernel for, or with grouped-query heads (on any machine, GPU or not)."""
    from stages.common import bfloat16
    from stages.hopper import flash_v3

    assert not flash_v3.takes(np.float32, 128)
    assert not flash_v3.takes(bfloat16, 96)
    assert not flash_v3.takes(bfloat16, 128, heads=8, kv_heads=2)


# ---------------------------------------------------------------- the backward's tile order, mirrored in numpy
@pytest.mark.parametrize("bc,br", [(64, 64), (128, 64), (128, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 2, 130, 200), (2, 1, 200, 77), (1, 1, 1, 65), (1, 2, 150, 150)])
def test_backward_mirror_gives_stage_00s_gradients(shape, causal, bc, br):
    """The kernel's tile order (transposed GEMMs per consumer; one dQ reduction per block and Q tile) sums to the
    same gradients as stage 00's backward, in float64; with Nq > Nk under the causal mask some rows see no key."""
    from stages import naive
    from stages.common import make_inputs
    from stages.hopper import backward_mirror

    q, k, v, do = make_inputs(*shape, 64, dtype=np.float64, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)
    want = naive.backward(q, k, v, o, lse, do, causal=causal)
    got = backward_mirror.backward(q, k, v, o, lse, do, causal=causal, bc=bc, br=br)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert np.allclose(a, b, rtol=1e-10, atol=1e-12), name


def test_backward_mirror_reduces_into_dq_once_per_block_and_q_tile():
    """Blocks of 128 keys (version ws) make half the reductions of blocks of 64 (version wgmma) when nothing is
    masked, Q tiles of 128 rows (version ws at D = 64) half again, and a causal block skips the Q tiles above its
    first key's diagonal."""
    from stages.common import make_inputs
    from stages.hopper import backward_mirror as M

    assert M.dq_reductions(4096, 4096, False, 64) == 2 * M.dq_reductions(4096, 4096, False, 128) == 64 * 64
    assert M.dq_reductions(4096, 4096, True, 128) == sum(64 - 2 * j for j in range(32))
    # Q tiles of 128 rows (version ws at D = 64): half the reductions again, and a causal block's first tile may
    # start above its first key's diagonal
    assert M.dq_reductions(4096, 4096, False, 128, 128) == 32 * 32
    assert M.dq_reductions(4096, 4096, True, 128, 128) == sum(32 - j for j in range(32))
    q, k, v, do = make_inputs(1, 1, 256, 256, 64, dtype=np.float64, grad=True)
    trace = []
    M.backward(q, k, v, q, np.zeros((1, 1, 256)), do, causal=True, trace=trace)
    assert trace == [(0, 0), (0, 64), (0, 128), (0, 192), (128, 128), (128, 192)]
    assert len(trace) == M.dq_reductions(256, 256, True, 128)
    trace = []
    M.backward(q, k, v, q, np.zeros((1, 1, 256)), do, causal=True, br=128, trace=trace)
    assert trace == [(0, 0), (0, 128), (128, 128)] and len(trace) == M.dq_reductions(256, 256, True, 128, 128)


def test_every_launcher_compiles_its_kernel_through_one_sm90a_helper(monkeypatch):
    """The forward and backward launchers get their kernels from blocks.sm90a_function (file, instantiation, shared
    memory), and the backward's preprocess from the module stage 03 compiles (the same name expressions: one
    compile for both stages). No GPU: the compile and the lookup are recorded, not run."""
    from stages.hopper import blocks, flash_v3, flash_v3_backward

    loads, functions = [], []
    monkeypatch.setattr(blocks, "load_module", lambda f, **kw: loads.append((f, kw)) or f)
    monkeypatch.setattr(blocks.kernels, "function", lambda m, name, smem: functions.append((m, name, smem)) or name)
    blocks.sm90a_function.cache_clear()
    assert flash_v3._function("pingpong", "__half", 128) == "flash_v3_forward_pingpong<__half,128,128,2,false>"
    assert flash_v3_backward._function("ws", "__half", 64) == "flash_v3_backward_ws<__half,64,2,128>"
    assert functions == [("flash_v3_forward_pingpong.cu", "flash_v3_forward_pingpong<__half,128,128,2,false>",
                          flash_v3.smem_bytes("pingpong", 128)),
                         ("flash_v3_backward_ws.cu", "flash_v3_backward_ws<__half,64,2,128>",
                          flash_v3_backward.smem_bytes("ws", 64))]
    assert all(kw["target"] == "sm_90a" for _, kw in loads)
    blocks.sm90a_function.cache_clear()

    from stages.flash_v2_backward import flash_v2_backward as stage03

    seen = []

    class Module:
        def get_function(self, name):
            return name

    monkeypatch.setattr(flash_v3_backward, "load_module", lambda f, **kw: seen.append((f, kw)) or Module())
    flash_v3_backward._pre_function.cache_clear()
    assert flash_v3_backward._pre_function("bwd_preprocess", "__half") == "bwd_preprocess<__half>"
    assert seen == [("flash_v2_backward_pre.cu", {"name_expressions": stage03.PRE_NAMES})]
    flash_v3_backward._pre_function.cache_clear()


def test_the_backward_converts_dq_in_its_main_kernel_only_on_short_heads_of_version_ws():
    from stages.hopper import flash_v3_backward as fb

    most = fb.FUSE_DQ_MAX
    assert fb.fuse_dq_rule("ws", most // 128, 128) and fb.fuse_dq_rule("ws", most // 64, 64)
    assert not fb.fuse_dq_rule("ws", most // 128 + 1, 128) and not fb.fuse_dq_rule("wgmma", 64, 64)
    with pytest.raises(ValueError, match="version 'wgmma' does not convert dQ itself"):
        fb._plan("wgmma", np.dtype(np.float16), (1, 1, 64, 64), 64, False, 0.125, fuse_dq=True)


def test_the_forward_launches_a_persistent_grid_only_for_version_pingpong_on_short_unmasked_items():
    from stages.hopper import flash_v3

    most = flash_v3.PERSISTENT_MAX_KEYS
    assert flash_v3.persistent_rule("pingpong", False, most) and flash_v3.persistent_rule("pingpong", False, 1)
    assert not flash_v3.persistent_rule("pingpong", False, most + 1)
    assert not flash_v3.persistent_rule("pingpong", True, 128)
    assert not flash_v3.persistent_rule("ws", False, 128) and not flash_v3.persistent_rule("wgmma", False, 128)
    names = flash_v3.kernel_names("pingpong")  # CI compiles both grids' instantiations, and the wide tiles'
    assert sum(n.endswith(",true>") for n in names) == 2 * len(flash_v3.HEAD_DIMS)
    assert sum(n.endswith(",false>") for n in names) == 2 * len(flash_v3.HEAD_DIMS) + 2
    with pytest.raises(ValueError, match="only version pingpong launches a persistent grid, not 'ws'"):
        flash_v3._plan("ws", np.dtype(np.float16), (1, 1, 64, 64), 64, (0, 64), (0, 64), False, 0.125, merge=False,
                       persistent=True)


def test_the_forward_takes_wide_key_tiles_only_for_version_pingpong_at_d128_on_long_unmasked_items():
    """wide_rule: K/V tiles of WIDE_BC keys where persistent_rule gives a block per item, at D = 128 without a mask;
    the tiles fit the H100's shared memory; another version or head dim refuses them."""
    from stages.common import device
    from stages.hopper import flash_v3

    long_keys = flash_v3.PERSISTENT_MAX_KEYS + 1
    persistent = flash_v3.persistent_rule("pingpong", False, long_keys)
    assert not persistent and flash_v3.wide_rule("pingpong", 128, False, persistent)
    assert not flash_v3.wide_rule("pingpong", 128, False, True) and not flash_v3.wide_rule("pingpong", 128, True, False)
    assert [(v, D) for v in flash_v3.VERSIONS for D in flash_v3.HEAD_DIMS
            if flash_v3.wide_rule(v, D, False, False)] == [("pingpong", 128)]
    assert flash_v3.config("pingpong", 128, wide=True).bc == flash_v3.WIDE_BC and flash_v3.WIDE_BC % 16 == 0
    assert flash_v3.smem_bytes("pingpong", 128, wide=True) <= device.emulate("sm_90").smem_optin
    for ctype in ("__half", "__nv_bfloat16"):  # CI compiles the wide instantiations (block per item only)
        assert f"flash_v3_forward_pingpong<{ctype},128,{flash_v3.WIDE_BC},2,false>" in flash_v3.kernel_names("pingpong")
    for version, D in (("ws", 128), ("pingpong", 64), ("pingpong", 256)):
        with pytest.raises(ValueError, match=f"tiles of {flash_v3.WIDE_BC} keys are version pingpong's at D = 128"):
            flash_v3.config(version, D, wide=True)


# ---------------------------------------------------------------- version fp8's layouts and numerics
def test_fp8_key_order_lets_each_lane_pack_its_own_p():
    """The 8-bit A fragment wants lane t's columns 4 t .. 4 t + 3 (and 16 on); the accumulator of S gave it keys 2 t,
    2 t + 1, 8 + 2 t, 9 + 2 t (and 16 on). With V^T's keys in fp8_key_order, the product over the fragment's
    positions is P V: simulated here for a warp's 16 rows and one K step of 32 keys."""
    order = L.fp8_key_order(np.arange(16))
    assert sorted(order.tolist()) == list(range(16))
    for t in range(4):  # what lane t packs is what the order puts at its positions
        keys = L.fp8_p_fragment_keys(t)
        assert keys.tolist() == [16 * (j // 4) + int(order[4 * t + j % 4]) for j in range(8)]
    rng = np.random.default_rng(0)
    p, v = rng.random((16, 32)), rng.standard_normal((32, 8))
    a = L.fp8_pack_a(p)  # the A operand as the lanes fill it: row r, position 4 t + j (+ 16)
    vt = v[np.concatenate([order, 16 + order])].T  # V^T's columns in the key order (the pre-pass)
    assert np.allclose(a @ vt.T, p @ v)
    assert not np.allclose(a @ v, p @ v)  # without the order the sum pairs the wrong keys


def test_fp8_reference_has_e4m3s_error_and_no_more():
    """fp8.reference (the yardstick of version fp8) against the float64 oracle: its error is e4m3's (3 mantissa bits
    in q, k, v and P, about 2^-5 relative each), well above bfloat16's and below 2^-3 of the values' size."""
    from stages.common import make_inputs, tolerance
    from stages.hopper import fp8

    q, k, v = make_inputs(2, 3, 300, 200, 128, dtype=np.float32, seed=3)
    for causal in (False, True):
        o, lse = fp8.reference(q, k, v, causal=causal)
        o_ref, lse_ref = tolerance.oracle(q, k, v, causal=causal)
        err = np.abs(o - o_ref).max() / np.abs(v).max()
        assert 2.0 ** -9 < err < 2.0 ** -3, err
        seen = np.isfinite(lse_ref)  # rows that see no key: -inf in both
        assert (lse[~seen] == -np.inf).all() and np.abs(lse[seen] - lse_ref[seen]).max() < 2.0 ** -3
    x8, amax = fp8.quantize(v)
    assert np.abs(x8).max() <= fp8.E4M3_MAX and (np.abs(x8).max(axis=(2, 3)) == fp8.E4M3_MAX).all()
    assert np.allclose(x8 * amax / fp8.E4M3_MAX, v, rtol=2.0 ** -4, atol=1e-3 * np.abs(v).max())
