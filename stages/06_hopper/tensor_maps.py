"""Tensor maps: how stage 06's kernels describe a tile of an array to the copy engine (TMA).

A CUtensorMap is 128 bytes that the driver's cuTensorMapEncodeTiled makes on the host (here through cuda-bindings,
NVIDIA's Python binding of the driver API) and the kernel takes inside its parameter struct: the array's address,
sizes and strides, the box (the tile one copy moves) and the swizzle. The kernels here see a (B, H, N, D) array as D
x N x (B H) with boxes of 128-byte rows in the 128-byte swizzle (swizzle.py), so rows past a head's N come back as
zeros, never as the next head's.

A map depends on its array's address, sizes, strides and box alone: a launcher describes each map once per problem
(TensorMap, heads_map) and encodes it for each call's arrays (MappedLaunch), from a cache keyed by all of them
(_encode: the speed layer's part here).
"""
import ctypes
import functools
import struct
from typing import NamedTuple

import numpy as np

from stages.common import bfloat16, kernels

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
    swizzle: str = "128B"  # the driver's CU_TENSOR_MAP_SWIZZLE_<swizzle>: 128B, or NONE (a plain row of the box)

    @classmethod
    def of(cls, dtype, dims, strides, box, offset=0, swizzle="128B"):
        """Checked: 16-bit, float32 or byte values, boxes of 128-byte rows (the swizzle's span; unswizzled: a
        multiple of 16 bytes), strides and offset in multiples of 16 bytes (the copy engine's unit)."""
        dtype = np.dtype(dtype)
        row = box[0] * dtype.itemsize
        if dtype not in MAP_DTYPES or (row != 128 if swizzle == "128B" else swizzle != "NONE" or row % 16):
            raise ValueError("tensor maps here: float16, bfloat16, float32 or uint8 (e4m3) values in boxes of 128-byte "
                             "rows (the swizzle's span), or unswizzled boxes of a multiple of 16 bytes")
        if any(s % 16 for s in strides) or offset % 16:
            raise ValueError(LAYOUT_REFUSED)
        return cls(MAP_DTYPES[dtype], tuple(dims), tuple(strides), tuple(box), offset, swizzle)

    def encode(self, x):
        """The 128 bytes of this map over the CuPy array x (of the shape and dtype it was made for)."""
        if not x.flags.c_contiguous:
            raise ValueError(LAYOUT_REFUSED)
        return _encode(self.dtype, x.data.device_id, x.data.ptr + self.offset, self.dims, self.strides, self.box,
                       self.swizzle)


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


def rows_map(heads, rows, box_rows):
    """The TensorMap of a float32 array of heads x rows (each head's rows one after the other; rows a multiple of 4)
    in unswizzled boxes of box_rows values of one head: L_i or D_i of a Q tile that may start at any row (a packed
    sequence's), which the copy engine's tensor copies take at any coordinate where a bulk copy needs 16-byte
    aligned addresses. Rows past the end come back as zeros."""
    return TensorMap.of(np.float32, [rows, heads], [rows * 4], [box_rows, 1], swizzle="NONE")


class MappedLaunch(NamedTuple):
    """A kernels.Launch whose parameter struct holds tensor maps: maps, (byte offset of the field, TensorMap) for each.
    launch(*arrays): the first len(maps) arrays are the ones the maps describe, in order; their maps are written into
    the struct with the rest of the arrays (the struct's leading pointer fields), then the kernel is launched. The
    scalar fields were written once, when the launch was planned. tail: the byte offsets of pointer fields after the
    maps (the variants' ALiBi slopes and sequence bounds), which the call's last len(tail) arrays fill (a CuPy array,
    or an address: 0 for null)."""

    launch: kernels.Launch
    maps: tuple
    tail: tuple = ()

    @classmethod
    def of(cls, launch, tail=(), **maps):
        """maps: field name of the launch's parameter struct = TensorMap; tail: byte offsets of trailing pointers."""
        struct_type = type(launch.params)
        return cls(launch, tuple((getattr(struct_type, name).offset, tmap) for name, tmap in maps.items()),
                   tuple(tail))

    def __call__(self, *arrays):
        n, m = len(self.maps), len(self.tail)
        fields = [(offset, tmap.encode(x)) for (offset, tmap), x in zip(self.maps, arrays)]
        if m:
            fields += [(offset, struct.pack("<Q", _address(x))) for offset, x in zip(self.tail, arrays[-m:])]
            arrays = arrays[:-m]
        self.launch(*arrays[n:], fields=fields)


def _address(x):
    """A device address: a CuPy array's, or x itself (an int; 0 for a null pointer)."""
    data = getattr(x, "data", None)
    return int(data.ptr) if data is not None and hasattr(data, "ptr") else int(x)


@functools.lru_cache(maxsize=256)
def _encode(dtype, device_id, address, dims, strides, box, swizzle="128B"):
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
        getattr(cu.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{swizzle}"),
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: {err}")
    words = getattr(tmap, "opaque", None)  # CUtensorMap's 16 64-bit words, as cuda-bindings exposes the struct
    if words is None:
        return ctypes.string_at(tmap.getPtr(), 128)
    return bytes((ctypes.c_uint64 * 16)(*(int(w) for w in words)))
