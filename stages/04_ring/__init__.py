"""Stage 04: ring attention over MPI / NCCL. See ring.py (schedule and merge), layout.py (shards and the
kernel calls of each block), comm.py (backends) and gather.py (the all-gather and all-to-all schemes).

Per rank (under mpirun):  ring_forward(q_r, k_r, v_r, ring=..., ...), ring_backward(...)
In one process (P simulated ranks as threads, the stage's one-API entry points):
    o, lse = forward(q, k, v, causal=True, ranks=4, layout="zigzag")
    dq, dk, dv = backward(q, k, v, o, lse, do, causal=True, ranks=4, layout="zigzag")
"""
from .comm import BACKENDS, simulate
from .gather import SCHEMES, traffic
from .layout import LAYOUTS, BlockCall, block_calls, halves, positions, shard, shard_len, steps, unshard
from .ring import (
    BLOCKS, RingMismatch, backward, check_same_everywhere, flash_version, forward, hopper_backward_blocks,
    hopper_backward_takes, hopper_blocks, hopper_takes, memory_per_token, merge, one_device_backward,
    one_device_forward, ring_backward, ring_forward, schedule,
)


__all__ = [
    "forward", "backward", "ring_forward", "ring_backward", "merge", "block_calls", "positions",
    "shard", "shard_len", "unshard", "flash_version", "hopper_takes", "hopper_blocks", "one_device_forward",
    "hopper_backward_takes", "hopper_backward_blocks", "one_device_backward",
    "simulate", "check_same_everywhere", "BLOCKS", "LAYOUTS", "RingMismatch", "BACKENDS", "BlockCall", "steps",
    "schedule", "halves", "memory_per_token", "SCHEMES", "traffic",
]
