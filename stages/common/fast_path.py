"""The speed layer: what makes a repeated launcher call cost a few microseconds of host time, kept apart from the
launchers. A reader may skip this module: nothing of the algorithms is here, and every call computes the same
without it.

A launcher reads top-down: check the inputs, pick the named configuration, compile, fill the kernel's parameter
struct, allocate the outputs and launch (stage 02's `flash_v2.forward` and the version launchers it calls). That is
some tens of microseconds of Python per call, as long as a small kernel runs. A training loop calls it with the same
shapes and options every step, so what the checks and the choices decide can be kept from the first such call and
replayed. This module does that from outside the launchers:

    @fast_path.remembered             # on the public function
    def forward(q, k, v, *, causal=False, ...):
        ...checks; the version's launcher: configuration, compile, params; it ends in the run step
        return launch.run_forward(Launch(fn, grid, block, smem, params), q, k, v, odtype)

1. Call keys (call_key). The key of a call is everything its checks and its plan look at: each array's type, shape
   and dtype, every other argument with its name, value and type, and the device.
2. Recording. A call whose key is new runs the whole plain path with its key's slot open. The run step a launcher
   ends in (launch.run_forward for a forward) hands its plan to keep(plan, *arrays) before it runs it: the plan is
   everything of the call but its arrays (compiled kernels, grids, parameter structs, the outputs' shapes and
   dtypes). keep stores it under the key, if the arrays are the call's own (a launcher that reshaped or copied its
   inputs first, as a packed batch's does, is not replayable and keeps nothing).
3. Replay. A call whose key was seen runs the kept plan on its arrays: no checks, no configuration, no compile
   lookup; a few microseconds.
4. Joint outputs. A kept plan allocates its outputs together (out_layout, empties): one trip to CuPy's memory pool
   a call, where each cupy.empty is one.
5. Prepacked launches (stages/common/launch.py's Launch, which the plain path uses too): a plan's parameter struct
   is written once; a call writes only the arrays' device addresses before cuLaunchKernel.
6. Block calls. The ring's block hook (stage 02's tc.merge_into) is no public call to key; the ring repeats the same
   blocks every step, so their launches are kept per block problem (functools.lru_cache of MAX_PLANS), marked so
   where it is applied.

Never kept: numpy calls (the mirrors), and calls with an argument that cannot be part of a key (an array option,
such as ALiBi slopes given as an array). tests/test_02_flash_v2.py holds every replayed result bit-identical to the
plain path's.

A launcher of several kernels per call follows the same pattern. Stage 03's backward (fp32.py there), say:

    def backward_fp32(q, k, v, o, lse, do, *, causal, scale, ...):   # the plain launcher, top-down
        ...the named tiles, compile, params = BwdParams(...)
        pre = Launch(function(...), grid, block, 0, params.copy())      # D_i = rowsum(dO_i * O_i), L_i
        main = Launch(function(...), grid, block, smem, params.copy())  # dK_j, dV_j (and dQ_i)
        last = Launch(...)                                              # the dQ conversion or the dQ pass
        return run_backward(BackwardLaunch(pre, main, ..., odtype), q, k, v, o, lse, do)

Its run step (launch.run_backward) does what launch.run_forward does: plan = fast_path.keep(plan, q, k, v, o, lse,
do), then plan(q, k, v, o, lse, do). The plan object (launch.BackwardLaunch) has two methods: plan(*arrays) ->
outputs (allocating the scratch and the outputs, zeroing what must start at zero, launching in order), and
plan.with_joint_outputs(*arrays) -> the same plan with its outputs from one allocation (its scratch stays an
allocation of its own, returned to the pool when the call ends). Nothing else of the speed layer goes into the
launcher.
"""
import functools
import math
import sys
import threading

import numpy as np

from . import device, verify

MAX_PLANS = 512  # plans kept per launcher (a run with many shapes starts over when full)
_pending = threading.local()  # the slot of the call now inside a @remembered function's plain path, per thread


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
    """fn(*arrays, **options), a public launcher, with the plans of its GPU calls kept per call_key: a call whose key
    was seen runs its kept plan; any other runs fn with its key's slot open (keep fills it). fn.__wrapped__ is the
    plain launcher (functools.wraps), which keeps nothing."""
    plans = {}

    @functools.wraps(fn)
    def call(*arrays, **options):
        key = call_key(arrays, options)
        plan = plans.get(key) if key is not None else None
        if plan is not None:
            return plan(*arrays)
        outer, _pending.slot = getattr(_pending, "slot", None), (plans, key, arrays)
        try:
            return fn(*arrays, **options)
        finally:
            _pending.slot = outer

    call.plans = plans  # for tests: the kept plans of this function
    return call


def keep(plan, *arrays):
    """Called by a run step (launch.run_forward) with its plan and arrays, just before it runs them; returns the plan
    to run. Inside a @remembered call being recorded, whose arrays these are (the same objects, in order), plan with
    joint outputs is kept for the calls that follow with the call's key, and returned (the first call allocates as
    its repeats do); otherwise plan itself. The first run step of a call decides: a launcher that calls another
    keeps only its own plan, and a run step on other arrays (an input reshaped or copied) keeps nothing."""
    slot = getattr(_pending, "slot", None)
    if slot is None or slot[1] is None:
        return plan
    plans, key, called = slot
    _pending.slot = None
    if len(arrays) != len(called) or any(a is not b for a, b in zip(arrays, called)):
        return plan
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan = plan.with_joint_outputs(*arrays)
    return plan


def launch(plan, *arrays):
    """keep(plan, *arrays)(*arrays): for a launcher that hands its plan over itself instead of ending in a run step
    (stage 06)."""
    return keep(plan, *arrays)(*arrays)


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
    if verify.POISON_OUTPUTS:  # read at the call: the tests switch it on after import
        mem.memset_async(0xFF, nbytes)
    return [cupy.ndarray(shape, dtype, memptr=mem + off) for shape, dtype, off in layout]
