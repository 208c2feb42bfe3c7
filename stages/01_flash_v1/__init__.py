"""Stage 01: FlashAttention v1 (2022 paper), fp32 forward + backward. See flash_v1.py and mirror.py."""
from . import mirror
from .flash_v1 import (
    BC, BR, MAX_HEAD_DIM, NTHREADS, VERSIONS, backward, backward_smem_bytes, forward, forward_smem_bytes,
    kernel_plans, kv_tile,
)

__all__ = [
    "forward", "backward", "VERSIONS", "BR", "BC", "NTHREADS", "MAX_HEAD_DIM", "mirror",
    "forward_smem_bytes", "backward_smem_bytes", "kernel_plans", "kv_tile",
]
