"""Stage 06's building blocks on an sm_90 GPU (kernels/hopper_blocks.cu), each checked against layouts.py:

    tile_bytes(x)     the copy engine loads x[:, :64] (16-bit, rows x 64) with the 128-byte swizzle; returns the
                      shared-memory bytes as they lie (compare: layouts.store_tile)
    qk_scores(q, k)   S = q k^T for q, k of 64 rows x D (D = 64, 128, 256): copy engine, then wgmma (compare: numpy)
    pv_product(p, v)  O = p v for p of 64 x 64 in registers and v of 64 keys x D (D = 64, 128) read as an MN-major
                      operand (compare: numpy)

Tensor maps come from the driver's cuTensorMapEncodeTiled through cuda-bindings (NVIDIA's Python binding of the
driver API); the kernels take them inside one parameter struct (BlockParams, kernels/hopper_blocks.cu). A map
depends on its array's address, sizes, strides and box alone: a launcher describes each map once per problem
(TensorMap) and encodes it for each call's arrays (MappedLaunch), from a cache keyed by all of them (_encode).
"""
import ctypes
import functools
from typing import NamedTuple

import numpy as np

from stages.common import bfloat16, device, kernels, load_module

FILE = "hopper_blocks.cu"
ARCH = "sm_90a"  # wgmma and setmaxnreg exist only in the arch-specific target of sm_90
CTYPE = {np.dtype(np.float16): "__half", np.dtype(bfloat16): "__nv_bfloat16"}  # the kernels' type names


class BlockParams(ctypes.Structure):
    """struct BlockParams of kernels/hopper_blocks.cu: out, in, rows, D, then two 128-byte tensor maps at offsets 64
    and 192 (CUtensorMap is 64-byte aligned)."""
    _fields_ = [("out", ctypes.c_uint64), ("in_", ctypes.c_uint64), ("rows", ctypes.c_int32), ("D", ctypes.c_int32),
                ("_pad", ctypes.c_uint8 * 40),
                ("map_a", ctypes.c_uint64 * 16), ("map_b", ctypes.c_uint64 * 16)]


ELSEWHERE = "Use stage 02 version 'pipelined' (forward) and stage 03 version 'tc' (backward) instead"
ELSEWHERE_FP32 = "For float32 use stage 02 version 'fp32x3' (sm_80 and newer) or 'fp32' instead"


def require_hopper(dev=None, instead=ELSEWHERE):
    """Raise device.UnsupportedDevice unless the GPU is an sm_90 (H100, H200): these kernels use sm_90a instructions.
    Elsewhere stages 02 (forward) and 03 (backward) run the same attention; instead says which versions."""
    dev = dev or device.device()
    if dev.arch.cc != 90 or dev.emulated:
        raise device.UnsupportedDevice(f"stage 06 needs an sm_90 GPU (H100, H200); {dev.name} is {dev.arch.name}. "
                                       f"{instead}")
    return dev


def tensor_map_2d(x, box_rows, box_cols=64):
    """The 128 bytes of a CUtensorMap for the row-major 16-bit CuPy matrix x (rows x cols): boxes of box_rows x
    box_cols elements, 128-byte swizzle (box_cols x 2 bytes must be 128)."""
    rows, cols = x.shape
    tmap = TensorMap.of(x.dtype, [cols, rows], [cols * 2], [box_cols, box_rows])
    return (ctypes.c_uint64 * 16).from_buffer_copy(tmap.encode(x))


# The element types a map here may hold, by the driver's names (CU_TENSOR_MAP_DATA_TYPE_<name>).
MAP_DTYPES = {np.dtype(bfloat16): "BFLOAT16", np.dtype(np.float16): "FLOAT16", np.dtype(np.float32): "FLOAT32",
              np.dtype(np.uint8): "UINT8"}  # uint8: e4m3 bytes (version fp8)
LAYOUT_REFUSED = "tensor maps here: a C-contiguous array whose rows are a multiple of 16 bytes"


class TensorMap(NamedTuple):
    """A CUtensorMap but its address: what cuTensorMapEncodeTiled takes of a row-major array of one shape and dtype.
    dtype: the driver's name of the element type; dims and box: sizes, innermost first; strides: the byte strides of
    every dimension but the innermost; offset: bytes from the array's first element to the map's. A launcher makes
    its maps' TensorMaps once per problem; encode(x) gives the 128 bytes for the array x of that problem."""

    dtype: str
    dims: tuple
    strides: tuple
    box: tuple
    offset: int = 0

    @classmethod
    def of(cls, dtype, dims, strides, box, offset=0):
        """Checked: 16-bit, float32 or byte values, boxes of 128-byte rows (the swizzle's span), strides and offset in
        multiples of 16 bytes (the copy engine's unit)."""
        dtype = np.dtype(dtype)
        if dtype not in MAP_DTYPES or box[0] * dtype.itemsize != 128:
            raise ValueError("tensor maps here: float16, bfloat16, float32 or uint8 (e4m3) values in boxes of 128-byte "
                             "rows (the swizzle's span)")
        if any(s % 16 for s in strides) or offset % 16:
            raise ValueError(LAYOUT_REFUSED)
        return cls(MAP_DTYPES[dtype], tuple(dims), tuple(strides), tuple(box), offset)

    def encode(self, x):
        """The 128 bytes of this map over the CuPy array x (of the shape and dtype it was made for)."""
        if not x.flags.c_contiguous:
            raise ValueError(LAYOUT_REFUSED)
        return _encode(self.dtype, x.data.device_id, x.data.ptr + self.offset, self.dims, self.strides, self.box)


def heads_map(shape, dtype, box_rows=64, rows=None):
    """The TensorMap of a row-major (B, H, N, D) array of this shape and dtype seen as D x N x (B H): boxes of box_rows
    rows x 128 bytes of one head. Rows past a head's N come back as zeros (never the next head's), and a reduction
    into them is skipped. rows = (start, stop): only those rows of every head (the map starts at row start and its
    heads stay N rows apart; rows from stop on read as zeros)."""
    B, H, N, D = shape
    size = np.dtype(dtype).itemsize
    start, stop = rows or (0, N)
    if not 0 <= start < stop <= N:
        raise ValueError(f"heads_map: rows {rows} are not a non-empty range of 0..{N}")
    return TensorMap.of(dtype, [D, stop - start, B * H], [D * size, N * D * size], [128 // size, box_rows, 1],
                        offset=start * D * size)


class MappedLaunch(NamedTuple):
    """A kernels.Launch whose parameter struct holds tensor maps: maps, (byte offset of the field, TensorMap) for each.
    launch(*arrays): the first len(maps) arrays are the ones the maps describe, in order; their maps are written into
    the struct with the rest of the arrays (the struct's leading pointer fields), then the kernel is launched. The
    scalar fields were written once, when the launch was planned."""

    launch: kernels.Launch
    maps: tuple

    @classmethod
    def of(cls, launch, **maps):
        """maps: field name of the launch's parameter struct = TensorMap."""
        struct_type = type(launch.params)
        return cls(launch, tuple((getattr(struct_type, name).offset, tmap) for name, tmap in maps.items()))

    def __call__(self, *arrays):
        n = len(self.maps)
        self.launch(*arrays[n:], fields=[(offset, tmap.encode(x)) for (offset, tmap), x in zip(self.maps, arrays)])


@functools.lru_cache(maxsize=256)
def _encode(dtype, device_id, address, dims, strides, box):
    """The 128 bytes of the CUtensorMap (CU_TENSOR_MAP_DATA_TYPE_<dtype>). They depend on nothing but these arguments,
    so a map is encoded once and kept: a training step calls the kernels again and again on the same buffers (CuPy's
    memory pool hands the same addresses back), and each cuda-bindings call costs the host some microseconds.
    device_id: the map is for that GPU's kernels (the address is in its memory)."""
    from cuda.bindings import driver as cu

    err, tmap = cu.cuTensorMapEncodeTiled(
        getattr(cu.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{dtype}"), len(dims), address,
        [cu.cuuint64_t(d) for d in dims], [cu.cuuint64_t(s) for s in strides],
        [cu.cuuint32_t(b) for b in box], [cu.cuuint32_t(1) for _ in dims],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err}")
    words = getattr(tmap, "opaque", None)  # CUtensorMap's 16 64-bit words, as cuda-bindings exposes the struct
    if words is None:
        return ctypes.string_at(tmap.getPtr(), 128)
    return bytes((ctypes.c_uint64 * 16)(*(int(w) for w in words)))


@functools.lru_cache(maxsize=None)
def sm90a_function(file, name, smem):
    """Kernel `name` of kernels/<file> (a template instantiation, or an extern "C" kernel's own name), compiled by
    NVRTC for sm_90a, allowed smem bytes of dynamic shared memory: what every stage 06 launcher launches."""
    module = load_module(file, name_expressions=(name,) if "<" in name else None, target=ARCH)
    return kernels.function(module, name, smem)


def tile_bytes(x):
    """The shared-memory bytes after the copy engine loaded x[:, :64] (CuPy, 16-bit, rows <= 256) with the 128-byte
    swizzle: a numpy uint8 array of rows x 128 bytes."""
    import cupy

    require_hopper()
    rows = x.shape[0]
    if not 1 <= rows <= 256 or x.shape[1] < 64:
        raise ValueError("tile_bytes: 1 to 256 rows (a box dimension's limit) and at least 64 columns")
    out = cupy.zeros(rows * 128, cupy.uint8)
    p = BlockParams(rows=rows, map_a=tensor_map_2d(x, rows))
    kernels.Launch(sm90a_function(FILE, "tile_bytes", rows * 128 + 1024), (1,), (128,), rows * 128 + 1024, p)(out)
    return cupy.asnumpy(out)


def qk_scores(q, k):
    """S = q k^T (64 x 64, float32) for CuPy q, k of 64 rows x D (D = 64, 128 or 256; fp16 or bf16), computed by
    wgmma from tiles the copy engine loaded."""
    import cupy

    require_hopper()
    D = q.shape[1]
    if q.shape != (64, D) or k.shape != (64, D) or D not in (64, 128, 256) or q.dtype != k.dtype:
        raise ValueError("qk_scores: q and k of 64 rows x D, D = 64, 128 or 256, one dtype")
    if np.dtype(q.dtype) not in CTYPE:
        raise TypeError(f"qk_scores: dtype {q.dtype} is not supported; use float16 or bfloat16")
    out = cupy.empty((64, 64), cupy.float32)
    p = BlockParams(D=D, map_a=tensor_map_2d(q, 64), map_b=tensor_map_2d(k, 64))
    smem = 2 * 64 * D * 2 + 1024
    kernels.Launch(sm90a_function(FILE, f"qk_scores<{CTYPE[np.dtype(q.dtype)]}>", smem), (1,), (128,), smem, p)(out)
    return out


def pv_product(p, v):
    """O = p v (64 x D, float32) for CuPy p (64 x 64) and v (64 keys x D, D = 64 or 128), one 16-bit dtype: p in
    registers as wgmma's A fragments, v loaded by the copy engine and read as an MN-major operand."""
    import cupy

    require_hopper()
    D = v.shape[1]
    if p.shape != (64, 64) or v.shape != (64, D) or D not in (64, 128) or p.dtype != v.dtype:
        raise ValueError("pv_product: p of 64 x 64 and v of 64 x D, D = 64 or 128, one dtype")
    if np.dtype(p.dtype) not in CTYPE:
        raise TypeError(f"pv_product: dtype {p.dtype} is not supported; use float16 or bfloat16")
    out = cupy.empty((64, D), cupy.float32)
    params = BlockParams(D=D, map_b=tensor_map_2d(v, 64))
    smem = 64 * D * 2 + 1024
    p = cupy.ascontiguousarray(p)
    fn = sm90a_function(FILE, f"pv_product<{CTYPE[np.dtype(p.dtype)]}>", smem)
    kernels.Launch(fn, (1,), (128,), smem, params)(out, p)
    return out


def kernel_names():
    """The instantiations CI compiles for sm_90a."""
    return ["tile_bytes"] + [f"{k}<{c}>" for k in ("qk_scores", "pv_product") for c in CTYPE.values()]
