"""Stage 04: ring attention over MPI / NCCL. Read ring.py first (the algorithm: a plain ring, the merge, the fast ring,
the API); the machinery has a file each (ring.py's docstring lists them).

Per rank (under mpirun):  ring_forward(q_r, k_r, v_r, ring=..., ...), ring_backward(...)
In one process (P simulated ranks as threads, the stage's one-API entry points):
    o, lse = forward(q, k, v, causal=True, ranks=4)
    dq, dk, dv = backward(q, k, v, o, lse, do, causal=True, ranks=4)
"""
from . import candidates
from .comm import BACKENDS, LoopbackRing
from .compute import (
    BLOCKS, flash_version, hopper_backward_takes, hopper_takes, one_device_backward, one_device_forward,
)
from .gather import SCHEMES, traffic
from .shards import LAYOUTS, BlockCall, block_calls, halves, positions, shard, shard_len, steps, unshard
from .problem import RingMismatch, check_same_everywhere
from .ring import backward, forward, merge, plain_ring_backward, plain_ring_forward, ring_backward, ring_forward
from .threads import recorded, simulate
from .travel import memory_per_token, schedule

__all__ = [
    "forward", "backward", "ring_forward", "ring_backward", "plain_ring_forward", "plain_ring_backward", "merge",
    "block_calls", "positions", "shard", "shard_len", "unshard", "flash_version", "hopper_takes",
    "hopper_backward_takes", "one_device_forward", "one_device_backward", "simulate", "recorded", "LoopbackRing",
    "check_same_everywhere", "BLOCKS", "LAYOUTS", "RingMismatch", "BACKENDS", "BlockCall", "steps", "schedule",
    "halves", "memory_per_token", "SCHEMES", "traffic", "candidates",
]
