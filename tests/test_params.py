"""The kernels' parameter structs and their Python mirrors agree byte for byte (no GPU needed).

kernels/params.cuh defines the structs the stage 02 and 03 kernels take (FwdParams, BwdParams) and
stages/common/params.py the same structs with ctypes, which a launcher fills; stage 06's structs are in its headers
(hopper_tiles.cuh, hopper_bwd_tiles.cuh, hopper_variants.cuh) and mirrored in its launchers. NVRTC compiles a
static_assert of the size and of every field's offset, so a field added, removed, reordered or retyped on one side
only fails here.
"""
import ctypes

import pytest

from stages.common import kernels, params
from stages.hopper import flash_v3, flash_v3_backward
from stages.hopper import params as hopper_params

STRUCTS = [(params.FwdParams, "FwdParams", "params.cuh"),
           (params.BwdParams, "BwdParams", "params.cuh"),
           (flash_v3.HopperFwdParams, "HopperFwdParams", "hopper_tiles.cuh"),
           (flash_v3_backward.HopperBwdParams, "HopperBwdParams", "hopper_bwd_tiles.cuh"),
           (hopper_params.HopperVarFwdParams, "HopperVarFwdParams", "hopper_variants.cuh"),
           (hopper_params.HopperVarBwdParams, "HopperVarBwdParams", "hopper_variants.cuh")]


def _all_fields(struct_type):
    """(name, type) of every field, a derived structure's base's first (ctypes keeps each class's own in _fields_)."""
    bases = [t for t in reversed(struct_type.__mro__) if issubclass(t, ctypes.Structure) and "_fields_" in vars(t)]
    return [f for t in bases for f in t._fields_]


def _layout_errors(struct_type, c_name, header):
    """The fields whose offset differs between struct_type and the CUDA struct c_name (and "size" when the sizes
    differ). NVRTC cannot evaluate offsetof at compile time, so a kernel compares each field's address inside a local
    struct with its ctypes offset and stores to bad[n] when the n-th differs: the compiler folds every comparison,
    and the PTX keeps exactly the stores of the fields that differ."""
    import re

    from cupy_backends.cuda.libs import nvrtc

    names = [name for name, _ in _all_fields(struct_type)]
    checks = [f"if (at(&s.{n}) != {getattr(struct_type, n).offset}) bad[{i}] = 1;" for i, n in enumerate(names)
              if not n.startswith("_")]  # _pad: the mirror's bytes for the C compiler's alignment, no field there
    checks.append(f"if (sizeof(s) != {ctypes.sizeof(struct_type)}) bad[{len(names)}] = 1;")
    source = (f'#include "{header}"\nextern "C" __global__ void layout_check(int* bad) {{\n  {c_name} s;\n'
              "  auto at = [&](const void* f) { return (long)((const char*)f - (const char*)&s); };\n  "
              + "\n  ".join(checks) + "\n}\n")
    prog = nvrtc.createProgram(source, "layout_check.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", "--gpu-architecture=compute_90", f"-I{kernels.KERNELS_DIR}"]
                             + [f"-I{d}" for d in kernels._cuda_include_dirs()[:1]])  # cuda_fp16.h and friends
        ptx = nvrtc.getPTX(prog).decode()
    except nvrtc.NVRTCError as e:
        raise RuntimeError(nvrtc.getProgramLog(prog)) from e
    finally:
        nvrtc.destroyProgram(prog)
    body = ptx[ptx.index(".entry layout_check"):]
    stored = [int(m.group(1) or 0) // 4 for m in re.finditer(r"st\.global\.u32\s+\[%rd\d+(?:\+(\d+))?\]", body)]
    assert stored or "st.global" not in body, body  # a store the pattern missed would hide a mismatch
    return [(names + ["size"])[n] for n in stored]


@pytest.mark.parametrize("struct_type,c_name,header", STRUCTS)
def test_python_struct_matches_the_kernels_struct(struct_type, c_name, header):
    assert _layout_errors(struct_type, c_name, header) == []


@pytest.mark.parametrize("struct_type,c_name,header", STRUCTS)
def test_the_layout_check_finds_fields_out_of_place(struct_type, c_name, header):
    """Positive control: a mirror with two neighbouring fields of different sizes swapped is caught, at those
    fields."""
    fields = _all_fields(struct_type)
    i = next(n for n in range(len(fields) - 1) if ctypes.sizeof(fields[n][1]) != ctypes.sizeof(fields[n + 1][1])
             and not fields[n][0].startswith("_") and not fields[n + 1][0].startswith("_"))
    fields[i], fields[i + 1] = fields[i + 1], fields[i]
    swapped = type("Swapped", (ctypes.Structure,), {"_fields_": fields})
    wrong = _layout_errors(swapped, c_name, header)
    assert fields[i][0] in wrong and fields[i + 1][0] in wrong


@pytest.mark.parametrize("struct_type", [params.FwdParams, params.BwdParams])
def test_array_fields_come_first_in_the_order_launches_fill_them(struct_type):
    """kernels.Launch writes a call's arrays into the struct's leading 8-byte fields, in ARRAYS order; all its
    pointer fields are arrays."""
    names = [n for n, _ in struct_type._fields_]
    assert tuple(names[:len(struct_type.ARRAYS)]) == struct_type.ARRAYS
    offsets = [getattr(struct_type, n).offset for n in struct_type.ARRAYS]
    assert offsets == [8 * i for i in range(len(struct_type.ARRAYS))]
    assert [n for n, t in struct_type._fields_ if t is ctypes.c_uint64] == list(struct_type.ARRAYS)


@pytest.mark.parametrize("struct_type", [params.FwdParams, params.BwdParams])
def test_defaults_and_leading_dimensions(struct_type):
    p = struct_type(Nq=5, Nk=7)
    assert (p.ldq, p.ldk, p.group, p.left, p.right, p.rp) == (5, 7, 1, -1, -1, 1.0)
    assert struct_type(Nq=5, Nk=7, ldq=9, ldk=11).ldk == 11


def test_the_backward_preprocess_takes_the_arrays_stage_06_hands_it():
    """Stage 06 launches stage 03's preprocess with (o, dO, lse, D_i, L_i, dQ_accum, done): BwdParams' first fields."""
    assert params.BwdParams.ARRAYS[:7] == ("o", "dO", "lse", "D_i", "L_i", "dQ_accum", "done")


def test_a_launch_writes_the_arrays_into_its_struct_and_hands_over_its_address():
    """kernels.Launch with a parameter struct: a call's array addresses go into the leading fields, the scalars stay
    as planned, and cuLaunchKernel's parameter array holds the struct's one address."""
    import struct

    plan = params.FwdParams(Nq=9, Nk=4, scale=0.5)
    launch = kernels.Launch(None, (4, 2), (128,), 0, plan)
    values, pointers, address, pack = launch._slots_for(5)
    assert values is plan and list(pointers) == [ctypes.addressof(plan)] and address == pointers.ctypes.data
    pack(values, 0, *range(101, 106))
    assert (plan.q, plan.k, plan.v, plan.o, plan.lse, plan.slopes) == (101, 102, 103, 104, 105, 0)
    assert (plan.Nq, plan.Nk, plan.scale) == (9, 4, 0.5)
    assert struct.unpack_from("<5Q", bytes(plan)) == tuple(range(101, 106))
    seeded = launch.with_fields(seed_lo=7)
    assert seeded.params.seed_lo == 7 and plan.seed_lo == 0 and seeded.params.Nq == 9  # a copy, not the plan
