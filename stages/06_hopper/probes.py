"""Stage 06's probes of Hopper's data paths on an sm_90 GPU (kernels/hopper_probes.cu), each checked against the CPU
arithmetic of swizzle.py before an attention kernel relies on it:

    tile_bytes(x)     the copy engine loads x[:, :64] (16-bit, rows x 64) with the 128-byte swizzle; returns the
                      shared-memory bytes as they lie (compare: swizzle.store_tile)
    qk_scores(q, k)   S = q k^T for q, k of 64 rows x D (D = 64, 128, 256): copy engine, then wgmma (compare: numpy)
    pv_product(p, v)  O = p v for p of 64 x 64 in registers and v of 64 keys x D (D = 64, 128) read as an MN-major
                      operand (compare: numpy)

The kernels take their tensor maps (tensor_maps.py) inside one parameter struct (ProbeParams).
"""
import ctypes

import numpy as np

from stages.common import kernels

from .sm90a import CTYPE, function, require_hopper
from .tensor_maps import TensorMap

FILE = "hopper_probes.cu"


class ProbeParams(ctypes.Structure):
    """struct ProbeParams of kernels/hopper_probes.cu: out, in, rows, D, then two 128-byte tensor maps at offsets 64
    and 192 (CUtensorMap is 64-byte aligned)."""
    _fields_ = [("out", ctypes.c_uint64), ("in_", ctypes.c_uint64), ("rows", ctypes.c_int32), ("D", ctypes.c_int32),
                ("_pad", ctypes.c_uint8 * 40),
                ("map_a", ctypes.c_uint64 * 16), ("map_b", ctypes.c_uint64 * 16)]


def tensor_map_2d(x, box_rows, box_cols=64):
    """The 128 bytes of a CUtensorMap for the row-major 16-bit CuPy matrix x (rows x cols): boxes of box_rows x
    box_cols elements, 128-byte swizzle (box_cols x 2 bytes must be 128)."""
    rows, cols = x.shape
    tmap = TensorMap.of(x.dtype, [cols, rows], [cols * 2], [box_cols, box_rows])
    return (ctypes.c_uint64 * 16).from_buffer_copy(tmap.encode(x))


def tile_bytes(x):
    """The shared-memory bytes after the copy engine loaded x[:, :64] (CuPy, 16-bit, rows <= 256) with the 128-byte
    swizzle: a numpy uint8 array of rows x 128 bytes."""
    import cupy

    require_hopper(x)
    rows = x.shape[0]
    if not 1 <= rows <= 256 or x.shape[1] < 64:
        raise ValueError("tile_bytes: 1 to 256 rows (a box dimension's limit) and at least 64 columns")
    out = cupy.zeros(rows * 128, cupy.uint8)
    p = ProbeParams(rows=rows, map_a=tensor_map_2d(x, rows))
    kernels.Launch(function(FILE, "tile_bytes", rows * 128 + 1024), (1,), (128,), rows * 128 + 1024, p)(out)
    return cupy.asnumpy(out)


def qk_scores(q, k):
    """S = q k^T (64 x 64, float32) for CuPy q, k of 64 rows x D (D = 64, 128 or 256; fp16 or bf16), computed by
    wgmma from tiles the copy engine loaded."""
    import cupy

    require_hopper(q, k)
    D = q.shape[1]
    if q.shape != (64, D) or k.shape != (64, D) or D not in (64, 128, 256) or q.dtype != k.dtype:
        raise ValueError("qk_scores: q and k of 64 rows x D, D = 64, 128 or 256, one dtype")
    if np.dtype(q.dtype) not in CTYPE:
        raise TypeError(f"qk_scores: dtype {q.dtype} is not supported; use float16 or bfloat16")
    out = cupy.empty((64, 64), cupy.float32)
    p = ProbeParams(D=D, map_a=tensor_map_2d(q, 64), map_b=tensor_map_2d(k, 64))
    smem = 2 * 64 * D * 2 + 1024
    kernels.Launch(function(FILE, f"qk_scores<{CTYPE[np.dtype(q.dtype)]}>", smem), (1,), (128,), smem, p)(out)
    return out


def pv_product(p, v):
    """O = p v (64 x D, float32) for CuPy p (64 x 64) and v (64 keys x D, D = 64 or 128), one 16-bit dtype: p in
    registers as wgmma's A fragments, v loaded by the copy engine and read as an MN-major operand."""
    import cupy

    require_hopper(p, v)
    D = v.shape[1]
    if p.shape != (64, 64) or v.shape != (64, D) or D not in (64, 128) or p.dtype != v.dtype:
        raise ValueError("pv_product: p of 64 x 64 and v of 64 x D, D = 64 or 128, one dtype")
    if np.dtype(p.dtype) not in CTYPE:
        raise TypeError(f"pv_product: dtype {p.dtype} is not supported; use float16 or bfloat16")
    out = cupy.empty((64, D), cupy.float32)
    params = ProbeParams(D=D, map_b=tensor_map_2d(v, 64))
    smem = 64 * D * 2 + 1024
    p = cupy.ascontiguousarray(p)
    kernels.Launch(function(FILE, f"pv_product<{CTYPE[np.dtype(p.dtype)]}>", smem), (1,), (128,), smem, params)(out, p)
    return out


def instantiations():
    """[(file, name)]: the kernels CI compiles for sm_90a."""
    return [(FILE, "tile_bytes")] + [(FILE, f"{k}<{c}>") for k in ("qk_scores", "pv_product") for c in CTYPE.values()]
