"""Launching a compiled kernel: the launch a launcher plans (Launch), and the last step of every forward launcher
(run_forward: o and lse allocated, then the launch) and of stage 03's backward launchers (run_backward: the scratch
and dq, dk, dv allocated, then the launches in order).

A launcher (stage 02's versions, say) picks a configuration, compiles its kernel (stages/common/kernels.py), fills
the kernel's parameter struct and ends in

    return run_forward(Launch(fn, grid, block, smem, params), q, k, v, odtype)

Launch(...)(*arrays) is one kernel launch, as cupy's `fn(grid, block, args, shared_mem=smem)` is, with the arrays
written into the struct's leading pointer fields. run_forward allocates o and lse and launches on (q, k, v, o, lse).
Before it runs, run_forward shows its plan (the launch and the outputs' dtype) to the speed layer
(stages/common/fast_path.py), which keeps it for a repeat of the call when it is recording one; a reader may skip
that line: it changes nothing of what the call computes. A backward launcher ends the same way, in

    return run_backward(BackwardLaunch(pre, main, dq_pass, convert, rows, acc, done, odtype), q, k, v, o, lse, do)
"""
import ctypes
import functools
import struct
import sys
import threading
from typing import NamedTuple

import numpy as np

from . import fast_path
from .inputs import cast
from .verify import empty

NULL = np.uint64(0)  # a null pointer argument (no ALiBi slopes, no packed batch)


def scalar_slot(x):
    """The 8-byte kernel-parameter slot of a numpy scalar argument (int32, uint32, float32, int64, uint64, ...): its
    bytes, little-endian, zero-padded to 8. The driver reads as many bytes from the slot as the kernel's parameter
    has (4 for int and float, 8 for a pointer or long long), so one 8-byte slot holds any of them."""
    if not isinstance(x, np.generic) or x.dtype.itemsize > 8:
        raise TypeError(f"a kernel's scalar argument must be a numpy scalar of at most 8 bytes (np.int32(n), "
                        f"np.float32(x), ...), got {type(x).__name__}")
    return int.from_bytes(x.tobytes().ljust(8, b"\0"), "little")


class Launch:
    """One kernel launch as a launcher plans it: the compiled function, grid, block, dynamic shared memory, and the
    kernel's arguments. launch(*arrays) runs it on the current stream; an array is a CuPy array or a device address
    (an int, np.uint64(0) for a null pointer).

    The arguments are either a parameter struct (stages/common/params.py: the kernel takes one `FwdParams p`), whose
    leading pointer fields the arrays of each call fill in order, or a tuple of numpy scalars that follow the arrays
    (a kernel that takes its arguments one by one).

    How a launch reaches the GPU: cuLaunchKernel takes kernelParams, an array of one pointer per kernel parameter,
    each pointing at that parameter's value. A plan's scalars are the same on every call, so they are written once:
    into the struct, or into 8-byte slots after the arrays' slots (scalar_slot). A call writes only the arrays' device
    addresses and launches: a few microseconds of host time, where a general launcher (cupy.RawKernel) converts every
    argument again on every call. The lock keeps two threads from writing one plan's values at once; the driver
    copies them when the launch is queued, so they are free again as soon as cuLaunchKernel returns."""

    def __init__(self, fn, grid, block, smem, args):
        self.fn, self.smem = fn, int(smem)
        self.params = args if isinstance(args, ctypes.Structure) else None
        self.scalars = () if self.params is not None else tuple(args)
        self.grid, self.block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        self.dims = (*self.grid, *self.block, self.smem)  # cuLaunchKernel's grid, block and shared-memory arguments
        self._slots = {}  # number of arrays -> _slots_for(number)
        self._lock = threading.Lock()

    def with_scalars(self, scalars):
        """The same launch with other scalar arguments (a call's dropout seed)."""
        return Launch(self.fn, self.grid, self.block, self.smem, scalars)

    def with_fields(self, **fields):
        """The same launch with some fields of its parameter struct changed (a call's dropout seed)."""
        params = type(self.params).from_buffer_copy(self.params)
        for name, value in fields.items():
            setattr(params, name, value)
        return Launch(self.fn, self.grid, self.block, self.smem, params)

    def _slots_for(self, n):
        """(values, pointer array, its address, a packer of the n array addresses into values) for a call with n
        arrays. Struct: values is the struct, the pointer array has its one address, and the packer writes the
        addresses into its first n (pointer) fields. Scalars: values holds n + len(scalars) slots, the pointer array
        one address per slot."""
        hit = self._slots.get(n)
        if hit is None:
            if self.params is not None:
                values = self.params
                pointers = np.array([ctypes.addressof(values)], np.uint64)
            else:
                values = np.zeros(n + len(self.scalars), np.uint64)
                values[n:] = [scalar_slot(x) for x in self.scalars]
                pointers = values.ctypes.data + 8 * np.arange(values.size, dtype=np.uint64)
            hit = self._slots[n] = (values, pointers, int(pointers.ctypes.data), struct.Struct(f"<{n}Q").pack_into)
        return hit

    def __call__(self, *arrays, fields=()):
        """fields: (byte offset, bytes) pairs written into the parameter struct with the arrays' addresses, for what
        changes with the arrays beside their addresses (stage 06's tensor maps)."""
        ndarray, driver, current_stream = _cuda()
        values, _, params, pack = self._slots.get(len(arrays)) or self._slots_for(len(arrays))
        ptrs = [a.data.ptr if isinstance(a, ndarray) else int(a) for a in arrays]
        if fields and self.params is None:
            raise TypeError("Launch: fields go into a parameter struct; this launch takes its arguments one by one")
        for attempt in (0, 1):
            with self._lock:
                pack(values, 0, *ptrs)
                for offset, data in fields:
                    ctypes.memmove(ctypes.addressof(values) + offset, data, len(data))
                try:
                    # fn is a cupy.RawKernel; fn.kernel, its compiled function on the current device
                    driver.launchKernel(self.fn.kernel.ptr, *self.dims, current_stream().ptr, params, 0)
                    return
                except driver.CUDADriverError as e:
                    if e.status != _CUDA_ERROR_INVALID_CONTEXT or attempt:
                        raise
            # a host thread whose CUDA context was never made current: the runtime makes the device's (once per thread)
            import cupy

            cupy.cuda.runtime.setDevice(cupy.cuda.runtime.getDevice())


@functools.cache
def _cuda():
    """(cupy.ndarray, CuPy's CUDA driver module, cupy.cuda.get_current_stream), imported on the first launch."""
    import cupy
    from cupy_backends.cuda.api import driver

    return cupy.ndarray, driver, cupy.cuda.get_current_stream


_CUDA_ERROR_INVALID_CONTEXT = 201



def row_major(x, dtype=None):
    """x as the kernels read it: C-contiguous, and (CuPy) starting on a 16-byte boundary, since their vector loads,
    cp.async copies and tensor maps move 16 bytes at a time from the start of a row; a view that starts inside an
    allocation (flat[1:].reshape(...)) may not. x itself when it already is so, otherwise a copy. numpy arrays (the CPU
    mirrors): C-contiguous only."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x, dtype=dtype)
    y = sys.modules["cupy"].ascontiguousarray(x, dtype=dtype)  # x is a CuPy array: cupy is imported
    return y if y.data.ptr % 16 == 0 else y.copy()  # a fresh allocation starts on a 256-byte boundary



class ForwardLaunch(NamedTuple):
    """A forward as its launcher planned it: plan(q, k, v) returns o (in odtype) and lse (float32) of a launch on
    (q, k, v, o, lse, *extra): extra holds the arrays after lse (ALiBi slopes, a packed batch's bounds: CuPy arrays,
    device addresses, or NULL). merges: the kernel merges its result into the (o, lse) it is given (version pipelined
    with float32 o), so lse starts at -inf ("nothing merged yet"). outs: o and lse carved from one allocation
    (fast_path.out_layout), or None: two allocations."""
    launch: Launch
    odtype: np.dtype
    extra: tuple = ()
    merges: bool = False
    outs: tuple | None = None

    def __call__(self, q, k, v):
        """o, lse: q, k, v made row-major (B, H, N, D) (row_major: a copy only for other layouts), o (B, H, Nq, D)
        in odtype and lse (B, H, Nq) float32 allocated (NaN-poisoned under the tests, so an element the kernel does
        not write fails the check), then the launch on the current stream."""
        q, k, v = row_major(q), row_major(k), row_major(v)  # each x itself when it is already row-major
        if self.outs is not None:
            o, lse = fast_path.empties(*self.outs)
        else:
            cupy = sys.modules["cupy"]  # q is a CuPy array: cupy is imported
            B, H, Nq, D = q.shape
            o = empty(cupy, (B, H, Nq, D), self.odtype)
            lse = empty(cupy, (B, H, Nq), np.float32)
        if self.merges:
            lse.fill(-np.inf)
        self.launch(q, k, v, o, lse, *self.extra)
        return o, lse

    def with_joint_outputs(self, q, k, v):
        """This plan with o and lse from one allocation for inputs shaped like q (the speed layer keeps it so): the
        pair is what a forward saves for its backward, so the two live as long as each other anyway."""
        B, H, Nq, D = q.shape
        return self._replace(outs=fast_path.out_layout([((B, H, Nq, D), self.odtype), ((B, H, Nq), np.float32)]))


def run_forward(launch, q, k, v, odtype, *extra, merges=False):
    """The last step of a forward launcher: o (B, H, Nq, D) in odtype and lse (B, H, Nq) float32 allocated, then
    launch on (q, k, v, o, lse, *extra) (ForwardLaunch). q, k, v are the arrays the public function was called with.
    merges: the kernel merges into o, lse (lse starts at -inf)."""
    plan = ForwardLaunch(launch, np.dtype(odtype), extra, merges)
    plan = fast_path.keep(plan, q, k, v)  # the speed layer's copy when it records this call (fast_path.py)
    return plan(q, k, v)


class BackwardLaunch(NamedTuple):
    """A backward as its launcher planned it (stage 03): plan(q, k, v, o, lse, do) returns dq, dk, dv of its launches,
    run in this order, every BwdParams launch on the same arrays (BwdParams.ARRAYS: o, dO, lse, D_i, L_i, dQ_accum,
    done, q, k, v, dQ, dK, dV, then extra):
        pre      the preprocess: D_i = rowsum(dO_i * O_i), L_i; it zeroes dQ_accum and the block counters
        main     the main kernel: dK_j, dV_j, and (atomic dQ) dQ_i added into dQ_accum
        dq_pass  deterministic mode's dQ pass (dQ_i summed in a fixed order), or None
        convert  dQ = dQ_accum in the gradients' dtype, a launch of its own (arguments dQ_accum, dQ), or None
    The scratch, one float32 allocation: D_i and L_i (rows each: B H Nq_pad), dQ_accum (acc elements) and done
    (the tc kernel's block counters; 0: none, a null pointer). odtype: the gradients' dtype. zero_dkv: dK, dV start
    at zero (the kernel adds into them); float_dkv: dK, dV in float32 (zeroed too), rounded to odtype at the end
    (the variants: each kv group's query heads add theirs). extra: the arrays after dV (ALiBi slopes, a packed
    batch's cu_q, cu_k). outs: dq, dk, dv carved from one allocation (fast_path.out_layout), or None: three
    allocations."""
    pre: Launch
    main: Launch
    dq_pass: Launch | None
    convert: Launch | None
    rows: int
    acc: int
    done: int
    odtype: np.dtype
    zero_dkv: bool = False
    float_dkv: bool = False
    extra: tuple = ()
    outs: tuple | None = None

    def __call__(self, q, k, v, o, lse, do):
        """dq, dk, dv: the inputs made row-major (row_major: a copy only for other layouts), the scratch and the
        outputs allocated (NaN-poisoned under the tests), then the launches on the current stream. The pool is
        stream-ordered: the scratch, freed when the call returns, goes only to later work on this stream."""
        cupy = sys.modules["cupy"]  # q is a CuPy array: cupy is imported
        q, k, v, o, do, lse = row_major(q), row_major(k), row_major(v), row_major(o), row_major(do), \
            row_major(lse, np.float32)
        scratch = cupy.cuda.alloc(4 * (2 * self.rows + self.acc + self.done))
        D_i = scratch.ptr  # (B H, Nq_pad) float32, then L_i, then dQ_accum, then the counters
        L_i = D_i + 4 * self.rows
        dq_acc = L_i + 4 * self.rows
        done = dq_acc + 4 * self.acc if self.done else NULL
        if self.float_dkv:
            dq = empty(cupy, q.shape, self.odtype)
            dk, dv = cupy.empty(k.shape, np.float32), cupy.empty(v.shape, np.float32)
        elif self.outs is not None:
            dq, dk, dv = fast_path.empties(*self.outs)
        else:
            dq, dk, dv = (empty(cupy, x.shape, self.odtype) for x in (q, k, v))
        if self.zero_dkv or self.float_dkv:
            dk.fill(0)
            dv.fill(0)
        arrays = (o, do, lse, D_i, L_i, dq_acc, done, q, k, v, dq, dk, dv)  # BwdParams.ARRAYS
        self.pre(*arrays)
        self.main(*arrays, *self.extra)
        if self.dq_pass is not None:
            self.dq_pass(*arrays)
        if self.convert is not None:
            self.convert(dq_acc, dq)
        if self.float_dkv:
            dk, dv = cast(dk, self.odtype), cast(dv, self.odtype)
        return dq, dk, dv

    def with_joint_outputs(self, q, k, *arrays):
        """This plan with dq, dk, dv from one allocation (the speed layer keeps it so: a training step uses all three
        together), for inputs shaped like q, k. The variants' float32 dK, dV live only inside a call: theirs stay
        three allocations."""
        if self.float_dkv:
            return self
        B, H, Nq, D = q.shape
        Nk = k.shape[2]
        return self._replace(outs=fast_path.out_layout([((B, H, Nq, D), self.odtype), ((B, H, Nk, D), self.odtype),
                                                         ((B, H, Nk, D), self.odtype)]))

    def marked(self, marks):
        """This plan with a CUDA event recorded into the list marks, as (name, event), before its first launch and
        after each (per-launch times for dev/sweep_backward.py)."""
        last = "dq pass" if self.dq_pass is not None else "convert" if self.convert is not None else None
        return self._replace(pre=_Marked(self.pre, "preprocess+zero", marks, first=True),
                             main=_Marked(self.main, "main" if last else "main+dq", marks),
                             dq_pass=self.dq_pass and _Marked(self.dq_pass, "dq pass", marks),
                             convert=self.convert and _Marked(self.convert, "convert", marks))


class _Marked(NamedTuple):
    """A launch that records a CUDA event into marks after it, as (name, event), and with first, one named "start"
    before it."""
    launch: Launch
    name: str
    marks: list
    first: bool = False

    def __call__(self, *arrays):
        cupy = sys.modules["cupy"]
        if self.first:
            self.marks.append(("start", cupy.cuda.Event()))
            self.marks[-1][1].record()
        self.launch(*arrays)
        self.marks.append((self.name, cupy.cuda.Event()))
        self.marks[-1][1].record()


def run_backward(plan, q, k, v, o, lse, do, *extra, marks=None):
    """The last step of a backward launcher: plan (a BackwardLaunch) run on the arrays the public function was called
    with, extra (its arrays after dV) added to it. marks: a list that receives (name, cupy.cuda.Event) before the
    first launch and after each (BackwardLaunch.marked), or None."""
    if extra:
        plan = plan._replace(extra=extra)
    if marks is not None:
        return plan.marked(marks)(q, k, v, o, lse, do)  # a tool's call: never kept
    plan = fast_path.keep(plan, q, k, v, o, lse, do)  # the speed layer's copy when it records this call (fast_path.py)
    return plan(q, k, v, o, lse, do)
