"""Stage 02: FlashAttention-2 forward (fp32, fp16/bf16 tensor cores, fp32 on tensor cores by 3xTF32).
See flash_v2.py, mirror.py, tc.py, fp32x3.py."""
from . import mirror
from .flash_v2 import (
    DTYPES, FP32_BC, VARIANT_VERSIONS, VERSIONS, Fp32Config, backward, forward, forward_varlen, fp32_candidates,
    fp32_config, fp32_reachable, fp32_smem_bytes, head_dims, kernel_plans, kernel_sources, resolve_version, tiles,
)
from . import fp32x3, tc

__all__ = [
    "forward", "forward_varlen", "backward", "VERSIONS", "VARIANT_VERSIONS", "DTYPES", "FP32_BC", "tiles",
    "head_dims", "resolve_version", "Fp32Config", "fp32_candidates", "fp32_config", "fp32_reachable",
    "fp32_smem_bytes", "kernel_plans", "kernel_sources", "mirror", "tc", "fp32x3",
]
