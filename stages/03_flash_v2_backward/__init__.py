"""Stage 03: FlashAttention-2 backward, fp32 and tensor-core versions. See flash_v2_backward.py."""
from .flash_v2_backward import (
    HEAD_DIMS, VERSIONS, accumulate_into, backward, backward_flops, backward_varlen, forward, forward_varlen,
    kernel_plans, kernel_sources, resolve_version, smem_bytes, tc_tiles, tiles_error, TcTiles,
)

__all__ = ["forward", "backward", "forward_varlen", "backward_varlen",
           "VERSIONS", "HEAD_DIMS", "backward_flops", "kernel_sources", "resolve_version",
           "kernel_plans", "smem_bytes", "tc_tiles", "tiles_error", "TcTiles", "accumulate_into"]
