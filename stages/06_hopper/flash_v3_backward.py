"""Stage 06's backward on Hopper: dq, dk, dv of attention for CuPy q, k, v, o, lse, do (B, H, N, D) in float16 or
bfloat16, D = 64, 128 or 256, on an sm_90 GPU.

    o, lse = flash_v3.forward(q, k, v, causal=True)
    dq, dk, dv = flash_v3_backward.backward(q, k, v, o, lse, do, causal=True)

Three launches, the first and last stage 03's (kernels/flash_v2_backward_pre.cu):
  bwd_preprocess               D_i = rowsum(dO_i o O_i), L_i log2 e (+inf where nothing is visible and past Nq);
                               the fp32 dQ accumulator zeroed
  flash_v3_backward_wgmma      (kernels/flash_v3_backward_wgmma.cu) one warpgroup per K/V tile of 64 keys, dK_j and
                               dV_j in its accumulators, the five GEMMs of each Q tile by wgmma, Q_i and dO_i by TMA
                               into two stages; dQ_i added to the accumulator
  bwd_convert_dq               dQ = scale x the accumulator, in the inputs' dtype
"""
import ctypes
import functools

import numpy as np

from stages.common import LOG2E, kernels, load_module
from stages.common.checks import check_backward_inputs, check_causal, resolve_scale

from . import blocks

FILES = {"wgmma": "flash_v3_backward_wgmma.cu"}
VERSIONS = tuple(FILES)
DEFAULT = "wgmma"
HEAD_DIMS = (64, 128, 256)
PRE_FILE = "flash_v2_backward_pre.cu"  # stage 03's preprocess and dQ conversion
PAD = 128                              # D_i and L_i are padded to a multiple of 128 rows (>= the 64-row Q tiles)
BR = BC = 64                           # Q tiles and K/V tiles of 64 rows
THREADS = 128                          # one warpgroup


class HopperBwdParams(ctypes.Structure):
    """struct HopperBwdParams of kernels/flash_v3_backward_wgmma.cu: dq_acc, dk, dv, lse2, delta, Nq, Nk, Nq_pad,
    scale, scale_log2, causal, then four 128-byte tensor maps (q, k, v, do) at offsets 64, 192, 320, 448."""
    _fields_ = [("dq_acc", ctypes.c_uint64), ("dk", ctypes.c_uint64), ("dv", ctypes.c_uint64),
                ("lse2", ctypes.c_uint64), ("delta", ctypes.c_uint64), ("Nq", ctypes.c_int32),
                ("Nk", ctypes.c_int32), ("Nq_pad", ctypes.c_int32), ("scale", ctypes.c_float),
                ("scale_log2", ctypes.c_float), ("causal", ctypes.c_int32),
                ("map_q", ctypes.c_uint64 * 16), ("map_k", ctypes.c_uint64 * 16), ("map_v", ctypes.c_uint64 * 16),
                ("map_do", ctypes.c_uint64 * 16)]


def parts(D):
    """Blocks per K/V tile: each computes D / parts columns of dK_j, dV_j, dQ_i. Two at D = 256, where one
    warpgroup's registers cannot hold 64 x 256 accumulators of both dK_j and dV_j."""
    return 2 if D == 256 else 1


def smem_bytes(D):
    """K_j and V_j, the 64 x 64 dS^T, two stages of Q_i and dO_i (64 rows x D each, 2 bytes a value), and 1024 bytes
    to align the first tile to the swizzle's period."""
    return 6 * BC * D * 2 + BC * BR * 2 + 1024


def _name(version, ctype, D):
    return f"flash_v3_backward_{version}<{ctype},{D},{D // parts(D)}>"


@functools.lru_cache(maxsize=None)
def _function(version, ctype, D):
    name = _name(version, ctype, D)
    module = load_module(FILES[version], name_expressions=(name,), target=blocks.ARCH)
    return kernels.function(module, name, smem_bytes(D))


@functools.lru_cache(maxsize=None)
def _pre_function(kernel, ctype):
    name = f"{kernel}<{ctype}>"
    return load_module(PRE_FILE, name_expressions=(name,)).get_function(name)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, version=DEFAULT):
    """(dq, dk, dv), shaped like q, k, v and in their dtype: the gradients of sum(O * dO) from the forward's o and lse.
    Raises device.UnsupportedDevice off sm_90 (naming the stage 03 version to use), TypeError / ValueError for what the
    kernel does not take."""
    import cupy

    where = "flash_v3_backward"
    if version not in VERSIONS:
        raise ValueError(f"{where}: version {version!r} is not one of {VERSIONS}")
    if not all(isinstance(x, cupy.ndarray) for x in (q, k, v, o, lse, do)):
        raise TypeError(f"{where}: q, k, v, o, lse, do must be CuPy arrays (stage 06 runs on the GPU only; stage 03's "
                        "mirror takes numpy)")
    blocks.require_hopper()
    _, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where=where, dtypes=tuple(blocks.CTYPE),
                                               head_dims=HEAD_DIMS)
    if B * H > 65535:
        raise ValueError(f"{where}: batch * heads = {B * H} is over the grid limit 65535")
    causal = check_causal(causal, where)
    scale = resolve_scale(scale, D)
    asc = cupy.ascontiguousarray
    q, k, v, o, do, lse = asc(q), asc(k), asc(v), asc(o), asc(do), asc(lse, dtype=cupy.float32)
    BH, Nq_pad = B * H, -(-Nq // PAD) * PAD
    ctype = blocks.CTYPE[np.dtype(q.dtype)]
    delta = cupy.empty(BH * Nq_pad, cupy.float32)
    lse2 = cupy.empty(BH * Nq_pad, cupy.float32)
    dq_acc = cupy.empty(BH * Nq * D, cupy.float32)
    i32, f32 = np.int32, np.float32
    kernels.Launch(_pre_function("bwd_preprocess", ctype), (Nq_pad * D // 2048, BH), (256,), 0,
                   (i32(Nq), i32(Nq), i32(Nq_pad), i32(D), f32(LOG2E), i32(1), i32(0)))(
        o, do, lse, delta, lse2, dq_acc, np.uint64(0))
    dq, dk, dv = cupy.empty_like(q), cupy.empty_like(k), cupy.empty_like(v)
    params = HopperBwdParams(Nq=Nq, Nk=Nk, Nq_pad=Nq_pad, scale=scale, scale_log2=scale * LOG2E,
                             causal=int(causal), map_q=blocks.tensor_map_heads(q), map_k=blocks.tensor_map_heads(k),
                             map_v=blocks.tensor_map_heads(v), map_do=blocks.tensor_map_heads(do))
    grid = (-(-Nk // BC), BH, parts(D))  # one block per (K/V tile j, head, column part)
    kernels.Launch(_function(version, ctype, D), grid, (THREADS,), smem_bytes(D), params)(dq_acc, dk, dv, lse2, delta)
    n = BH * Nq * D  # a multiple of 4: the conversion takes 4 values per step
    kernels.Launch(_pre_function("bwd_convert_dq", ctype), (min(-(-n // 1024), 65535),), (256,), 0,
                   (f32(scale), np.int64(n)))(dq_acc, dq)
    return dq, dk, dv


def kernel_names(version):
    """The instantiations of a version that CI compiles for sm_90a."""
    return [_name(version, c, D) for c in blocks.CTYPE.values() for D in HEAD_DIMS]
