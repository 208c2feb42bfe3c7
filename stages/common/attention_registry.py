"""Single-device attention that a later stage offers to an earlier one, by registering it here.

Imports point down: stage 04's ring may not import stage 06, yet on an sm_90 GPU its block calls should run stage
06's FlashAttention-3 kernels. So stage 06 registers them when it is imported (one call in
stages/06_hopper/__init__.py), and the ring asks this registry which registered kernels take its problem. Whoever wants
them imports `stages.hopper` first: stage 04's run.py, stage 05's GPT and the benchmarks in dev/ do; a program that
does not gets stages 02/03, and stage 04 says which ran. Nothing here imports a stage.

    register(AttentionKernels(name=..., takes=..., forward=..., merge_into=..., ...))   # stage 06, once
    for kernels in registered(): ...                                                  # stage 04, per problem
"""
from typing import Callable, NamedTuple


class AttentionKernels(NamedTuple):
    """What a later stage offers: one device's whole attention, and one ring block added into float32 accumulators.

    takes(dtype, head_dim, *, heads, kv_heads, batch) -> bool    this GPU and problem (plain attention)
    forward(q, k, v, *, causal, scale) -> (o, lse)                 the whole problem, outputs in q's dtype
    merge_into(q, k, v, o_run, lse_run, rows, keys, *, causal, scale)
                                                                   rows q_start:q_stop against keys k_start:k_stop,
                                                                   O_i, L_i merged into the running float32 (O, L)
    takes_backward(dtype, head_dim) -> bool                        accumulate_into takes this dtype and head dim
    backward(q, k, v, o, lse, do, *, causal, scale) -> (dq, dk, dv)
    accumulate_into(q, k, v, o, lse, do, dq_run, dk_run, dv_run, rows, keys, *, causal, scale)
                                                                   dQ, dK, dV of the block added into the float32
                                                                   accumulators
    """
    name: str
    takes: Callable
    forward: Callable
    merge_into: Callable
    takes_backward: Callable
    backward: Callable
    accumulate_into: Callable


_REGISTERED = {}  # name -> AttentionKernels, in registration order


def register(kernels):
    """Offer `kernels` (AttentionKernels) to the earlier stages; registering a name again replaces it."""
    if not isinstance(kernels, AttentionKernels):
        raise TypeError(f"register takes an AttentionKernels, got {type(kernels).__name__}")
    _REGISTERED[kernels.name] = kernels


def unregister(name):
    """Withdraw the kernels registered under `name` (tests; a program that wants stages 02/03 only)."""
    _REGISTERED.pop(name, None)


def registered():
    """The registered AttentionKernels, in registration order (empty until a later stage is imported)."""
    return tuple(_REGISTERED.values())
