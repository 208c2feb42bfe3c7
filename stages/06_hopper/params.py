"""Stage 06's kernel parameter structs in Python: the structs of kernels/hopper_tiles.cuh (the forward's),
kernels/hopper_bwd_tiles.cuh (the backward's) and kernels/hopper_variants.cuh (both with the variants), field by
field, as ctypes structures (tests/test_params.py has NVRTC check each offset). Pointer fields first: kernels.Launch
writes each call's arrays there. The tensor maps follow at multiples of 64 bytes (CUtensorMap's alignment);
MappedLaunch (tensor_maps.py) writes them per call, and the variants' pointers past them (its tail)."""
import ctypes

from stages.common.params import FwdParams

_MAP = ctypes.c_uint64 * 16  # a CUtensorMap's 128 bytes


class HopperFwdParams(ctypes.Structure):
    """struct HopperFwdParams: o, lse, amax (version fp8), Nq, Nk, scale_log2, causal, o_rows, merge, heads, then
    three tensor maps (q, k, v) at offsets 64, 192, 320."""
    _fields_ = [("o", ctypes.c_uint64), ("lse", ctypes.c_uint64), ("amax", ctypes.c_uint64),
                ("Nq", ctypes.c_int32), ("Nk", ctypes.c_int32),
                ("scale_log2", ctypes.c_float), ("causal", ctypes.c_int32), ("o_rows", ctypes.c_int32),
                ("merge", ctypes.c_int32), ("heads", ctypes.c_int32), ("_pad", ctypes.c_uint8 * 12),
                ("map_q", _MAP), ("map_k", _MAP), ("map_v", _MAP)]


class HopperVarFwdParams(HopperFwdParams):
    """struct HopperVarFwdParams of kernels/hopper_variants.cuh: HopperFwdParams, then var, stage 02's FwdParams,
    whose variant fields (H, group, left, right, softcap, scale, a_off; slopes, cu_q, cu_k) the hooks read, at offset
    448; the struct's size a multiple of 64 (the tensor maps' alignment)."""
    _fields_ = [("var", FwdParams), ("_pad_end", ctypes.c_uint8 * 48)]
    VAR_POINTERS = ("slopes", "cu_q", "cu_k")  # var's pointer fields a call writes (MappedLaunch's tail)


class HopperBwdParams(ctypes.Structure):
    """struct HopperBwdParams: dq_acc, dk, dv, lse, delta, dq, done, Nq, Nk, Nq_pad, scale, causal, kv_rows,
    accumulate, then five tensor maps (q, k, v, do; dq_acc in float32) at offsets 128, 256, 384, 512, 640."""
    _fields_ = [("dq_acc", ctypes.c_uint64), ("dk", ctypes.c_uint64), ("dv", ctypes.c_uint64),
                ("lse", ctypes.c_uint64), ("delta", ctypes.c_uint64), ("dq", ctypes.c_uint64),
                ("done", ctypes.c_uint64), ("Nq", ctypes.c_int32),
                ("Nk", ctypes.c_int32), ("Nq_pad", ctypes.c_int32), ("scale", ctypes.c_float),
                ("causal", ctypes.c_int32), ("kv_rows", ctypes.c_int32), ("accumulate", ctypes.c_int32),
                ("_pad", ctypes.c_uint8 * 44),
                ("map_q", _MAP), ("map_k", _MAP), ("map_v", _MAP), ("map_do", _MAP), ("map_dq", _MAP)]


class HopperVarBwdParams(HopperBwdParams):
    """struct HopperVarBwdParams of kernels/hopper_variants.cuh: HopperBwdParams, then var (stage 02's FwdParams) at
    offset 768, then two tensor maps, of L_i and of D_i, at 960 and 1088."""
    _fields_ = [("var", FwdParams), ("_pad_var", ctypes.c_uint8 * 48), ("map_lse", _MAP), ("map_delta", _MAP)]
    VAR_POINTERS = HopperVarFwdParams.VAR_POINTERS
