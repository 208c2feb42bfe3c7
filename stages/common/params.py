"""The kernels' parameter structs in Python: kernels/params.cuh field by field, as ctypes structures.

A forward kernel takes one argument, `FwdParams p`; a backward kernel (stage 03), `BwdParams p`. A launcher fills one
(device addresses as integers, sizes and options as numbers) and launch.Launch (stages/common/launch.py) hands its
bytes to cuLaunchKernel.
ctypes lays a structure out as the C compiler does (each field at a multiple of its size), which is also how nvcc
lays out the CUDA struct; tests/test_params.py has NVRTC check the size and every field's offset, so a field changed
on one side only fails CI.
"""
import ctypes

_PTR, _INT, _UINT, _FLOAT = ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float


class _Params(ctypes.Structure):
    """What both structs share: the array fields come first (ARRAYS: launch.Launch writes a call's arrays into
    them, in this order), and DEFAULTS fill the fields a launcher leaves out; ldq, ldk default to Nq, Nk (a whole
    problem)."""
    ARRAYS = ()
    DEFAULTS = {}

    def __init__(self, **fields):
        super().__init__(**{**self.DEFAULTS, **fields})
        if "ldq" not in fields:
            self.ldq, self.ldk = self.Nq, self.Nk

    def copy(self):
        """A copy of this struct: each launch of a plan gets its own, as a call writes its arrays into it."""
        return type(self).from_buffer_copy(self)


class FwdParams(_Params):
    """struct FwdParams of kernels/params.cuh (the meaning of each field is written there)."""
    _fields_ = [
        ("q", _PTR), ("k", _PTR), ("v", _PTR), ("o", _PTR), ("lse", _PTR),
        ("slopes", _PTR), ("cu_q", _PTR), ("cu_k", _PTR),
        ("Nq", _INT), ("Nk", _INT), ("ldq", _INT), ("ldk", _INT),
        ("scale", _FLOAT), ("exp2_scale", _FLOAT),
        ("causal", _INT), ("head_group", _INT), ("H", _INT), ("group", _INT),
        ("left", _INT), ("right", _INT), ("softcap", _FLOAT),
        ("a_off", _INT), ("q_off", _INT), ("k_off", _INT),
        ("keep", _UINT), ("rp", _FLOAT), ("seed_lo", _UINT), ("seed_hi", _UINT),
    ]
    ARRAYS = ("q", "k", "v", "o", "lse", "slopes", "cu_q", "cu_k")  # the pointer fields, first, in this order
    DEFAULTS = {"group": 1, "left": -1, "right": -1, "rp": 1.0}  # head_group 0: the 2-D grid


class BwdParams(_Params):
    """struct BwdParams of kernels/params.cuh (the meaning of each field is written there). Every launch of a
    backward gets the same arrays, in ARRAYS order: the preprocess's first, then the main kernels'."""
    _fields_ = [
        ("o", _PTR), ("dO", _PTR), ("lse", _PTR), ("D_i", _PTR), ("L_i", _PTR), ("dQ_accum", _PTR), ("done", _PTR),
        ("q", _PTR), ("k", _PTR), ("v", _PTR), ("dQ", _PTR), ("dK", _PTR), ("dV", _PTR),
        ("slopes", _PTR), ("cu_q", _PTR), ("cu_k", _PTR),
        ("Nq", _INT), ("Nk", _INT), ("ldq", _INT), ("ldk", _INT), ("Nq_pad", _INT), ("head_dim", _INT),
        ("scale", _FLOAT), ("causal", _INT), ("j_fast", _INT), ("H", _INT), ("group", _INT),
        ("left", _INT), ("right", _INT), ("softcap", _FLOAT),
        ("a_off", _INT), ("q_off", _INT), ("k_off", _INT),
        ("keep", _UINT), ("rp", _FLOAT), ("seed_lo", _UINT), ("seed_hi", _UINT),
        ("zero_dq", _INT), ("n_done", _INT),
    ]
    ARRAYS = ("o", "dO", "lse", "D_i", "L_i", "dQ_accum", "done", "q", "k", "v", "dQ", "dK", "dV",
              "slopes", "cu_q", "cu_k")
    DEFAULTS = {"H": 1, "group": 1, "left": -1, "right": -1, "rp": 1.0}
