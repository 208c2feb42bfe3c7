"""Stage 03: FlashAttention-2 backward, fp32, tensor-core and 3xTF32 versions. See flash_v2_backward.py (the
launcher) and tiles.py (its configurations)."""
from .flash_v2_backward import (
    accumulate_into, backward, backward_flops, backward_varlen, forward, forward_varlen,
)
from .tiles import (
    DTYPES, HEAD_DIMS, VERSIONS, Fp32x3Tiles, TcTiles, fp32x3_tiles, kernel_plans, kernel_sources, resolve_version,
    smem_bytes, tc_tiles, tiles_error,
)

__all__ = ["forward", "backward", "forward_varlen", "backward_varlen",
           "VERSIONS", "HEAD_DIMS", "DTYPES", "backward_flops", "kernel_sources", "resolve_version",
           "kernel_plans", "smem_bytes", "tc_tiles", "tiles_error", "TcTiles", "accumulate_into",
           "Fp32x3Tiles", "fp32x3_tiles"]
