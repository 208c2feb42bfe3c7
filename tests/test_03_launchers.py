"""Stage 03's GPU launchers and the speed layer around them, on a CPU: test_02_launchers.py's stand-in for CuPy and the
CUDA driver records every launch (kernel, grid, block, shared memory, and the bytes of its BwdParams, or the
arguments of the dQ conversion) instead of running it.

What this checks without a GPU: each version's plain launcher (flash_v2_backward.backward.__wrapped__) and the speed
layer's first and repeated calls (flash_v2_backward.backward) launch the same kernels in the same order, with the
same grids and the same parameter bytes, except the addresses of what each call allocates (the scratch: D_i, L_i,
dQ_accum and the block counters, laid out alike; the outputs, a repeat's from one allocation); a repeat runs no
check and no launcher; plain attention's path computes none of the variants' fields; the ring's block call keeps its
launches per block and takes each call's dropout seed; profile= marks every launch and keeps nothing. That the
kernels then compute the same bits is the gpu test at the end, test_gpu_fast_path_replays_the_plain_launch_bit_for_bit.
"""
import ctypes
import sys
import types

import numpy as np
import pytest

from stages import flash_v2_backward as fb
from stages.common import bfloat16, device, fast_path, kernels, launch, make_inputs, to_numpy, variants
from stages.common.params import BwdParams
from tests.test_02_launchers import _fake_cupy, ndarray

SCRATCH = ("D_i", "L_i", "dQ_accum", "done")  # one allocation per call, laid out by the plan
OUTPUTS = ("dQ", "dK", "dV", "slopes")  # allocated by each call (slopes: a (B, H) float32 copy, per call)


@pytest.fixture
def gpu(monkeypatch):
    """The stand-in GPU: launches are recorded as (kernel, grid and block, shared memory, its BwdParams or the dQ
    conversion's four argument slots); CUDA events as ("event",)."""
    launches, names = [], {}

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if names[fn].startswith("bwd_convert_dq"):  # arguments one by one: kernelParams points at 4 slots
            args = tuple(ctypes.c_uint64.from_address(ctypes.c_uint64.from_address(params + 8 * i).value).value
                         for i in range(4))
        else:  # one BwdParams: kernelParams[0] is its address
            struct_at = ctypes.c_uint64.from_address(params).value
            args = BwdParams.from_buffer_copy(ctypes.string_at(struct_at, ctypes.sizeof(BwdParams)))
        launches.append((names[fn], (gx, gy, gz, bx, by, bz), smem, args))

    def get_function(module, name):
        names[len(names) + 1] = name
        return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=len(names)))

    cupy = _fake_cupy()
    cupy.RawModule.get_function = get_function
    cupy.cuda.Event = lambda: types.SimpleNamespace(record=lambda: launches.append(("event",)))
    driver = types.SimpleNamespace(launchKernel=launch_kernel, CUDADriverError=RuntimeError)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch, "_cuda", lambda: (ndarray, driver, cupy.cuda.get_current_stream))
    monkeypatch.setattr(device, "_CACHE", {})
    cached = (kernels._load, kernels.function, fb.tc._block_launches)  # compiled modules, kept block launches
    for c in cached:
        c.cache_clear()
    fb.backward.plans.clear()
    yield launches
    fb.backward.plans.clear()
    for c in cached:
        c.cache_clear()


def _without_allocations(record):
    """A launch with the addresses of what a call allocates replaced by where they lie in its scratch (D_i at 0) or
    by whether they are null; the conversion's two pointers by whether they are null."""
    name, dims, smem, args = record
    if not isinstance(args, BwdParams):
        return name, dims, smem, (args[0] != 0, args[1] != 0) + args[2:]
    params = BwdParams.from_buffer_copy(args)
    for field in SCRATCH:
        setattr(params, field, getattr(params, field) - args.D_i if getattr(params, field) else 0)
    for field in OUTPUTS:
        setattr(params, field, int(getattr(params, field) != 0))
    return name, dims, smem, bytes(params)


def _arrays(dtype, kv_heads=2, Nq=300, Nk=250, D=64):
    q, o, do = (ndarray((2, 2, Nq, D), dtype) for _ in range(3))
    k, v = (ndarray((2, kv_heads, Nk, D), dtype) for _ in range(2))
    return q, k, v, o, ndarray((2, 2, Nq), np.float32), do


# every version (fp32 in both dQ modes, fp32x3, tc in fp16 and bf16, deterministic, float32 gradients), and the
# variants through version tc's hooks (a window; softcap, ALiBi slopes as a tuple, dropout; grouped-query)
CALLS = [("fp32", np.float32, {}), ("fp32", np.float32, {"deterministic": True}), ("fp32x3", np.float32, {}),
         ("tc", np.float16, {}), ("tc", bfloat16, {"deterministic": True}), ("tc", bfloat16, {"out_dtype": np.float32}),
         ("tc", np.float16, {"window": (45, 0)}),
         ("tc", bfloat16, {"softcap": 20.0, "alibi_slopes": (0.5, 0.25), "dropout_p": 0.2, "seed": 7}),
         ("tc", np.float16, {"kv_heads": 1})]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version,dtype,kw", CALLS, ids=[f"{v}-{'-'.join(kw) or 'plain'}" for v, _, kw in CALLS])
def test_a_replay_launches_what_the_plain_launcher_launches(gpu, monkeypatch, version, dtype, kw, causal):
    kw = dict(kw)
    q, k, v, o, lse, do = arrays = _arrays(dtype, kw.pop("kv_heads", 2))
    call = dict(causal=causal, version=version, **kw)
    checks = []
    real_check = fb.flash_v2_backward.check_backward_inputs
    monkeypatch.setattr(fb.flash_v2_backward, "check_backward_inputs", lambda *a, **k: checks.append(1) or
                        real_check(*a, **k))
    plain = fb.backward.__wrapped__(*arrays, **call)
    assert not fb.backward.plans  # the plain launcher keeps nothing
    n = len(gpu)
    assert n == (3 if version == "fp32" or call.get("deterministic") else 2 if version == "tc" else 3)
    first = fb.backward(*arrays, **call)  # recorded: the whole path, its plan kept
    again = fb.backward(*arrays, **call)  # replayed: the kept plan alone
    assert len(checks) == 2 and len(gpu) == 3 * n  # the replay ran no check; each call launched the same number
    calls = [gpu[i * n:(i + 1) * n] for i in range(3)]
    assert [list(map(_without_allocations, c)) for c in calls[1:]] == [list(map(_without_allocations, calls[0]))] * 2
    variant = any(x in kw for x in ("window", "softcap")) or k.shape[1] != q.shape[1]
    for grads, launches in zip((plain, first, again), calls):
        params = launches[0][3]  # the preprocess's: every BwdParams launch of a call gets the same arrays
        assert (params.o, params.dO, params.lse) == (o.data.ptr, do.data.ptr, lse.data.ptr)
        assert (params.q, params.k, params.v) == (q.data.ptr, k.data.ptr, v.data.ptr)
        assert params.dQ == grads[0].data.ptr and (variant or (params.dK, params.dV) == tuple(
            g.data.ptr for g in grads[1:]))  # the variants' dK, dV are float32, rounded to the outputs after
        odtype = np.dtype(kw.get("out_dtype", dtype))
        assert [(g.shape, g.dtype) for g in grads] == [(x.shape, odtype) for x in (q, k, v)]
    dq, dk, dv = again  # the kept plan: dq, dk, dv from one allocation, each on a 256-byte boundary
    if not variant:
        assert dk.data.ptr - dq.data.ptr == -(-dq.size * dq.itemsize // 256) * 256
        assert dv.data.ptr - dk.data.ptr == -(-dk.size * dk.itemsize // 256) * 256


def test_plain_attention_computes_no_variant_fields(gpu, monkeypatch):
    """Plain (and causal) attention's path fills BwdParams without the variants' fields, in every version and dQ
    mode; a call with a variant computes them (the stand-ins below are reached)."""
    reached = []

    def refuse(name):
        def f(*a, **k):
            reached.append(name)
            raise AssertionError(f"plain attention computed variants.{name}")
        return f

    for name in ("origin_fields", "dropout_fields", "seed_fields"):
        monkeypatch.setattr(variants, name, refuse(name))
    for version, dtype, kw in CALLS[:6]:
        for causal in (False, True):
            fb.backward.__wrapped__(*_arrays(dtype), causal=causal, version=version, **kw)
    assert not reached
    with pytest.raises(AssertionError, match="plain attention computed variants"):
        fb.backward.__wrapped__(*_arrays(np.float16), causal=True, softcap=10.0)
    assert reached


def test_profile_marks_every_launch_and_keeps_nothing(gpu):
    """profile= (dev/sweep_backward.py) gets an event before the first launch and after each, named by what the
    launch did; such a call is never kept."""
    for det, names in ((False, ["start", "preprocess+zero", "main+dq"]),
                       (True, ["start", "preprocess+zero", "main", "dq pass"])):
        marks = []
        fb.backward(*_arrays(np.float16), causal=True, deterministic=det, profile=marks)
        assert [name for name, _ in marks] == names
        assert [r[0] == "event" for r in gpu] == [True] + [False, True] * (len(names) - 1)
        gpu.clear()
    assert not fb.backward.plans


def test_the_rings_block_call_keeps_its_launches_and_takes_each_calls_seed(gpu):
    """accumulate_into (the ring's block call) plans a block's launches once (an lru_cache, the speed plumbing of
    the block hook) and launches them on the ring's buffers at the block's rows and keys, with this call's dropout
    seed: two steps with two seeds differ in the seed fields of the main launch only."""
    q, k, v, o, lse, do = _arrays(np.float16, Nq=512, Nk=384)
    dq_run, dk_run, dv_run = ndarray(q.shape, np.float32), ndarray(k.shape, np.float32), ndarray(k.shape, np.float32)
    blocks = ndarray((2, 2, 128, 64), np.float16), ndarray((2, 2, 128, 64), np.float16)
    steps = []
    for seed in (7, (1 << 32) + 3):
        opts = variants.check(*blocks, causal=True, dropout_p=0.1, seed=seed, origin=(128, 256, 0), where="test")
        fb.accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, (128, 256), (256, 384), causal=True,
                           scale=0.125, opts=opts)
        steps.append(list(gpu))
        gpu.clear()
    assert fb.tc._block_launches.cache_info().hits == 1  # the second step's launches: the first's
    (pre1, main1), (pre2, main2) = steps

    def fields(record):  # the launch and its BwdParams but the scratch (D_i, L_i: each call's own)
        return record[:3], {f: getattr(record[3], f) for f, _ in BwdParams._fields_ if f not in ("D_i", "L_i")}

    assert fields(pre1) == fields(pre2)
    (m1, p1), (m2, p2) = fields(main1), fields(main2)
    assert (p1["seed_lo"], p1["seed_hi"], p2["seed_lo"], p2["seed_hi"]) == (7, 0, 3, 1)
    row, key = 128 * 64, 256 * 64  # where row 128 and key 256 start in a head, in elements
    assert (p1["q"], p1["k"], p1["dQ_accum"], p1["dK"]) == (q.data.ptr + 2 * row, k.data.ptr + 2 * key,
                                                            dq_run.data.ptr + 4 * row, dk_run.data.ptr + 4 * key)
    assert m1 == m2 and {**p2, "seed_lo": 7, "seed_hi": 0} == p1


# every version in each dQ mode it has, float32 gradients from 16 bits (the ring's partial gradients), and the variants
# through version tc's hooks (a window; softcap, ALiBi slopes as a tuple, dropout; grouped-query k, v)
REPLAYS = ([("fp32", "fp32", {}), ("fp32", "fp32", {"deterministic": True}), ("fp32x3", "fp32", {})]
           + [("tc", d, det) for d in ("fp16", "bf16") for det in ({}, {"deterministic": True})]
           + [("tc", "bf16", {"out_dtype": np.float32}),
              ("tc", "fp16", {"out_dtype": np.float32, "deterministic": True}), ("tc", "fp16", {"window": (45, 0)}),
              ("tc", "bf16", {"softcap": 20.0, "alibi_slopes": (0.5, 0.25, 0.125, 0.0625), "dropout_p": 0.2,
                              "seed": 7}),
              ("tc", "fp16", {"kv_heads": 2})])
VARIANT_KEYS = ("window", "softcap", "alibi_slopes", "dropout_p", "seed")  # what the forward takes of a call too


@pytest.mark.gpu
@pytest.mark.parametrize("version,dt,kw", REPLAYS, ids=[f"{v}-{d}-{'-'.join(kw) or 'plain'}" for v, d, kw in REPLAYS])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_fast_path_replays_the_plain_launch_bit_for_bit(version, dt, kw, causal):
    """The speed layer (stages/common/fast_path.py) is speed only: the first call of a key (which it records), and
    the calls after it (which replay the kept plan: joint outputs, no checks), give dq, dk, dv bit for bit equal to
    the plain launcher's (backward.__wrapped__, which keeps nothing), on new arrays of the same key too.

    Nk = 29 keys, one K/V tile in every version (version fp32's Bc is 32): each element of the dQ accumulator gets one
    atomic add from zero, and a kv group's two query heads add their dK, dV in either order (a + b = b + a), so
    the atomic mode's sums are as fixed as the deterministic one's and any difference is the speed layer's."""
    import cupy

    from stages import flash_v2

    dev = device.device()
    if (version == "fp32x3" and not device.tf32_tensor_cores(dev)) or (dt == "bf16" and not dev.arch.bf16):
        pytest.skip(f"version {version} in {dt} does not run on {dev.name}")
    kw = dict(kw)
    groups = kw.pop("kv_heads", 4)
    dtype = {"fp32": np.float32, "fp16": np.float16, "bf16": bfloat16}[dt]

    def inputs():  # fresh draws: q, o, do (2, 4, 45, 64), k and v (2, groups, 29, 64); o, lse from stage 02
        q, k, v, do = make_inputs(2, 4, 45, 29, 64, dtype=dtype, xp=cupy, grad=True)
        k, v = k[:, :groups].copy(), v[:, :groups].copy()
        o, lse = flash_v2.forward(q, k, v, causal=causal, **{x: kw[x] for x in VARIANT_KEYS if x in kw})
        return q, k, v, o, lse, do

    arrays = inputs()
    call = dict(causal=causal, version=version, **kw)
    fb.backward.plans.clear()
    plain = fb.backward.__wrapped__(*arrays, **call)
    assert not fb.backward.plans  # the plain launcher keeps nothing
    assert all(float(cupy.abs(g.astype(cupy.float32)).max()) > 0 for g in plain)  # gradients to compare
    recorded = fb.backward(*arrays, **call)
    assert fb.backward.plans.get(fast_path.call_key(arrays, call)) is not None
    replayed = fb.backward(*arrays, **call)
    for got in (recorded, replayed):
        for a, b in zip(got, plain):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))
    arrays = inputs()  # new arrays, the same key: the kept plan on new values
    for a, b in zip(fb.backward(*arrays, **call), fb.backward.__wrapped__(*arrays, **call)):
        np.testing.assert_array_equal(to_numpy(a).view(np.uint8), to_numpy(b).view(np.uint8))
