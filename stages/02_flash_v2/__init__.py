"""Stage 02: FlashAttention-2 forward (fp32 on CUDA cores, fp16/bf16 tensor cores, fp32 on tensor cores by 3xTF32).
See flash_v2.py (the API), fp32.py, tc.py, fp32x3.py (the versions' launchers), mirror.py (the tile mirror)."""
from . import mirror
from .flash_v2 import (
    DTYPES, VARIANT_VERSIONS, VERSIONS, backward, forward, forward_varlen, head_dims, kernel_plans, kernel_sources,
    resolve_version, tiles,
)
from . import fp32, fp32x3, tc

__all__ = [
    "forward", "forward_varlen", "backward", "VERSIONS", "VARIANT_VERSIONS", "DTYPES", "tiles", "head_dims",
    "resolve_version", "kernel_plans", "kernel_sources", "mirror", "fp32", "tc", "fp32x3",
]
