"""The launchers' speed plumbing, kept apart from what they teach.

A launcher (flash_v2.forward, flash_v2_backward.backward) reads top-down: check the inputs, pick the configuration,
compile, launch. On a GPU that is a few tens of microseconds of Python per call, as long as a small kernel runs. A
training loop calls it with the same shapes and options every step, so everything the checks and the choices
decide can be kept from the first call and replayed:

    @fast_path.remembered          # the public function: a call seen before skips straight to its launches
    def forward(q, k, v, *, causal=False, ...):
        ...checks, configuration, compile...
        return fast_path.launch(plan, q, k, v)   # runs plan(q, k, v), and keeps plan for the next such call

The key of a call (call_key) is everything the checks and the plan look at: each array's type, shape and dtype,
every other argument with its name and type, and the device. A call whose key was seen runs the kept plan on its
arrays: a few microseconds. A plan is kept only where the launcher hands it to `launch`: its plain GPU path; the CPU
mirrors and calls with per-call options (a dropout seed, ALiBi slopes as an array) always take the whole path.
Kept plans allocate their outputs together (joint_outputs): one trip to CuPy's memory pool per call.
"""
import functools
import math
import sys
import threading

import numpy as np

from . import device
from .verify import POISON_OUTPUTS

MAX_PLANS = 512  # plans kept per launcher (a run with many shapes starts over when full)
_pending = threading.local()  # the key of the call now inside a @remembered function's whole path, per thread


def call_key(arrays, kwargs):
    """What the checks and the plan of a call on CuPy arrays depend on: each array's type, shape and dtype, the other
    arguments' names, values and types (1 == True, but a check may take one and refuse the other), and the device.
    None for numpy inputs, and for arguments that cannot be part of a key (an array option): such calls are always
    checked."""
    cupy = sys.modules.get("cupy")
    if cupy is None or not arrays or not isinstance(arrays[0], cupy.ndarray):
        return None
    try:
        key = [tuple(kwargs), *kwargs.values(), *map(type, kwargs.values()), device.device()]
        for a in arrays:
            key += (type(a), a.shape, a.dtype)
        key = tuple(key)
        hash(key)
    except (AttributeError, TypeError):  # not an array, or an argument such as a CuPy scalar array
        return None
    return key


def remembered(fn):
    """fn(*arrays, **options), with the plans of its plain GPU calls kept per call_key (module docstring)."""
    plans = {}

    @functools.wraps(fn)
    def call(*arrays, **options):
        key = call_key(arrays, options)
        plan = plans.get(key) if key is not None else None
        if plan is not None:
            return plan(*arrays)
        outer, _pending.slot = getattr(_pending, "slot", None), (plans, key)
        try:
            return fn(*arrays, **options)
        finally:
            _pending.slot = outer

    call.plans = plans  # for tests: the kept plans of this function
    return call


def launch(plan, *arrays):
    """plan(*arrays); inside a @remembered function's first call with its key, plan (with joint outputs) is kept for
    the calls that follow with the same key."""
    slot = getattr(_pending, "slot", None)
    if slot is not None and slot[1] is not None:
        plans, key = slot
        _pending.slot = None  # one plan per call: a launcher calling another keeps only its own
        plan = plan.with_joint_outputs(*arrays)
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan
    return plan(*arrays)


def out_layout(specs):
    """(layout, nbytes) for empties: specs [(shape, dtype)] laid out one after the other in one allocation, each
    array on a 256-byte boundary; layout [(shape, dtype, byte offset)]."""
    layout, off = [], 0
    for shape, dtype in specs:
        dtype = np.dtype(dtype)
        layout.append((tuple(shape), dtype, off))
        off += -(-math.prod(shape) * dtype.itemsize // 256) * 256
    return tuple(layout), off


def empties(layout, nbytes):
    """CuPy output arrays carved from one allocation of nbytes from CuPy's memory pool (out_layout gives layout and
    nbytes): one trip to the pool for all of them, where each cupy.empty is one trip and one array of its own. The
    arrays share that memory, which returns to the pool when the last of them is freed. Uninitialised, or
    NaN-poisoned when POISON_OUTPUTS is on (every byte 0xFF: a NaN in float32, float16 and bfloat16 alike)."""
    import cupy

    mem = cupy.cuda.alloc(nbytes)
    if POISON_OUTPUTS:
        mem.memset_async(0xFF, nbytes)
    return [cupy.ndarray(shape, dtype, memptr=mem + off) for shape, dtype, off in layout]
