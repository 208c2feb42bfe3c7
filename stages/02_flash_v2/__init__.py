"""Stage 02: FlashAttention-2 forward (fp32, fp16/bf16 tensor cores, fp32 on tensor cores by 3xTF32).
See flash_v2.py, mirror.py, tc.py, fp32x3.py."""
from . import mirror
from .flash_v2 import (
    DTYPES, FP32_BC, VERSIONS, backward, forward, fp32_config, fp32_smem_bytes, head_dims, kernel_sources,
    resolve_version, tiles,
)

__all__ = [
    "forward", "backward", "VERSIONS", "DTYPES", "FP32_BC", "tiles", "head_dims", "resolve_version",
    "fp32_config", "fp32_smem_bytes", "kernel_sources", "mirror",
]
