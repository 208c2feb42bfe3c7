"""Stage 02's GPU launchers and the speed layer around them, on a CPU: a stand-in for CuPy and the CUDA driver records
every launch (kernel, grid, block, shared memory, and the bytes of its FwdParams) instead of running it.

What this checks without a GPU: each version's plain launcher (flash_v2.forward.__wrapped__) and the speed layer's
first and repeated calls (flash_v2.forward) launch the same kernel with the same grid and the same parameter bytes,
except the addresses of the outputs, which each call allocates (the repeat from one allocation); a repeat runs no
check and no launcher; plain attention's path computes none of the variants' fields. That the kernels then compute
the same bits is the gpu test test_02_flash_v2.py::test_gpu_fast_path_replays_the_plain_launch_bit_for_bit.
"""
import ctypes
import itertools
import math
import sys
import types

import numpy as np
import pytest

from stages import flash_v2
from stages.common import bfloat16, device, kernels, launch, variants
from stages.common.params import FwdParams

_addresses = itertools.count(1 << 20, 1 << 16)  # fake device addresses, 64 KB apart


class _Memory:
    """cupy.cuda.MemoryPointer: an address, and what + offset gives."""
    def __init__(self, ptr):
        self.ptr = ptr

    def __add__(self, offset):
        return _Memory(self.ptr + offset)

    def memset_async(self, value, nbytes):
        pass


class ndarray:  # noqa: N801 - cupy.ndarray's name, in a module CuPy's checks take for CuPy's
    __module__ = "cupy._core.core"

    def __init__(self, shape, dtype=np.float32, memptr=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim, self.size, self.itemsize = len(self.shape), math.prod(self.shape), self.dtype.itemsize
        self.data = memptr or _Memory(next(_addresses))

    def astype(self, dtype, copy=True):
        return ndarray(self.shape, dtype)

    def fill(self, value):
        pass

    def copy(self):
        return ndarray(self.shape, self.dtype)


def _fake_cupy():
    props = {"major": 9, "minor": 0, "name": b"a stand-in H100", "sharedMemPerBlockOptin": 227 * 1024,
             "multiProcessorCount": 132}
    runtime = types.SimpleNamespace(getDevice=lambda: 0, getDeviceProperties=lambda i: props)
    stream = types.SimpleNamespace(ptr=7)
    cuda = types.SimpleNamespace(runtime=runtime, alloc=lambda n: _Memory(next(_addresses)),
                                 get_current_stream=lambda: stream)

    class RawModule:
        def __init__(self, code, options, name_expressions=None, backend="nvrtc"):
            self.options = options

        def get_function(self, name):
            return types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=hash((name, self.options)) & 0xFFFFFFFF))

    return types.SimpleNamespace(
        ndarray=ndarray, cuda=cuda, RawModule=RawModule, float32=np.float32,
        empty=lambda shape, dtype=np.float32: ndarray(shape, dtype),
        full=lambda shape, value, dtype=np.float32: ndarray(shape, dtype),
        ascontiguousarray=lambda x, dtype=None: x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype),
        asarray=lambda x, dtype=None: x if isinstance(x, ndarray) else ndarray(np.shape(x), dtype or np.float32),
        broadcast_to=lambda x, shape: ndarray(shape, x.dtype))


@pytest.fixture
def gpu(monkeypatch):
    """The stand-in GPU: launches are recorded as (kernel, grid and block, shared memory, FwdParams bytes)."""
    launches = []

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        struct_at = ctypes.c_uint64.from_address(params).value  # kernelParams[0]: the address of the struct
        launches.append((fn, (gx, gy, gz, bx, by, bz), smem, ctypes.string_at(struct_at, ctypes.sizeof(FwdParams))))

    driver = types.SimpleNamespace(launchKernel=launch_kernel, CUDADriverError=RuntimeError)
    cupy = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(launch, "_cuda", lambda: (ndarray, driver, cupy.cuda.get_current_stream))
    monkeypatch.setattr(device, "_CACHE", {})
    for cached in (kernels._load, kernels.function):  # compiled modules: the stand-in's, this test's only
        cached.cache_clear()
    flash_v2.forward.plans.clear()
    yield launches
    flash_v2.forward.plans.clear()
    for cached in (kernels._load, kernels.function):
        cached.cache_clear()


ARRAYS = [n for n, _ in FwdParams._fields_[:len(FwdParams.ARRAYS)]]
OUTPUTS = {"o", "lse", "slopes"}  # allocated by each call (slopes: a copy, a (B, H) float32 array, per call)


def _without_outputs(record):
    """A launch with the addresses of the arrays a call allocates zeroed (kept: whether each is null)."""
    fn, dims, smem, raw = record
    params = FwdParams.from_buffer_copy(raw)
    for name in OUTPUTS:
        setattr(params, name, int(getattr(params, name) != 0))
    return fn, dims, smem, bytes(params)


CALLS = [("fp32", np.float32, {}), ("fp32_overlap", np.float32, {}), ("fp32x3", np.float32, {}),
         ("tc", np.float16, {}), ("pipelined", bfloat16, {}), ("pipelined", np.float16, {"out_dtype": np.float32}),
         ("pipelined", np.float16, {"window": (45, 0)}),
         ("pipelined", bfloat16, {"softcap": 20.0, "alibi_slopes": (0.5, 0.25), "dropout_p": 0.2, "seed": 7}),
         ("pipelined", np.float16, {"kv_heads": 1})]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("version,dtype,kw", CALLS, ids=[f"{v}-{'-'.join(kw) or 'plain'}" for v, _, kw in CALLS])
def test_a_replay_launches_what_the_plain_launcher_launches(gpu, monkeypatch, version, dtype, kw, causal):
    kw = dict(kw)
    heads = kw.pop("kv_heads", 2)
    q, k, v = (ndarray((2, h, n, 64), dtype) for h, n in ((2, 300), (heads, 250), (heads, 250)))
    call = dict(causal=causal, version=version, **kw)
    checks = []
    real_check = flash_v2.flash_v2.check_attention_inputs
    monkeypatch.setattr(flash_v2.flash_v2, "check_attention_inputs", lambda *a, **k: checks.append(1) or
                        real_check(*a, **k))
    plain = flash_v2.forward.__wrapped__(q, k, v, **call)
    assert not flash_v2.forward.plans  # the plain launcher keeps nothing
    first = flash_v2.forward(q, k, v, **call)  # recorded: the whole path, its plan kept
    again = flash_v2.forward(q, k, v, **call)  # replayed: the kept plan alone
    assert len(checks) == 2 and len(gpu) == 3  # the replay ran no check, and each call launched once
    assert _without_outputs(gpu[0]) == _without_outputs(gpu[1]) == _without_outputs(gpu[2])
    B, H, Nq, D = q.shape
    for (o, lse), record in zip((plain, first, again), gpu):
        params = FwdParams.from_buffer_copy(record[3])
        assert (params.q, params.k, params.v) == (q.data.ptr, k.data.ptr, v.data.ptr)
        assert (params.o, params.lse) == (o.data.ptr, lse.data.ptr)
        assert o.shape == (B, H, Nq, D) and lse.shape == (B, H, Nq) and lse.dtype == np.float32
        assert o.dtype == np.dtype(kw.get("out_dtype", dtype))
    o, lse = again  # the kept plan: o and lse from one allocation, lse after o on a 256-byte boundary
    assert lse.data.ptr - o.data.ptr == -(-o.size * o.itemsize // 256) * 256


def test_plain_attention_computes_no_variant_fields(gpu, monkeypatch):
    """Plain (and causal) attention's path fills FwdParams without the variants' fields; a call with a variant
    computes them (the stand-ins below are reached)."""
    reached = []

    def refuse(name):
        def f(*a, **k):
            reached.append(name)
            raise AssertionError(f"plain attention computed variants.{name}")
        return f

    q, k, v = (ndarray((1, 2, 100, 64), np.float16) for _ in range(3))
    for name in ("origin_fields", "dropout_fields", "seed_fields"):
        monkeypatch.setattr(variants, name, refuse(name))
    for version in flash_v2.VERSIONS:
        dtype = np.float32 if version in flash_v2.flash_v2.FP32_VERSIONS else np.float16
        x = [ndarray((1, 2, 100, 64), dtype) for _ in range(3)]
        for causal in (False, True):
            flash_v2.forward.__wrapped__(*x, causal=causal, version=version)
    assert not reached
    with pytest.raises(AssertionError, match="plain attention computed variants"):
        flash_v2.forward.__wrapped__(q, k, v, causal=True, softcap=10.0)
    assert reached
