"""Stage 03: FlashAttention-2 backward, fp32, tensor-core and 3xTF32 versions. See flash_v2_backward.py (the public
functions: checks, then a version's launcher) and each version's launcher with its tiles: fp32.py, tc.py, fp32x3.py."""
from .flash_v2_backward import (
    DTYPES, HEAD_DIMS, VERSIONS, accumulate_into, backward, backward_flops, backward_varlen, forward, forward_varlen,
    kernel_plans, kernel_sources, resolve_version, smem_bytes,
)
from .fp32x3 import Fp32x3Tiles, fp32x3_tiles
from .tc import TcTiles, tc_tiles, tiles_error

__all__ = ["forward", "backward", "forward_varlen", "backward_varlen",
           "VERSIONS", "HEAD_DIMS", "DTYPES", "backward_flops", "kernel_sources", "resolve_version",
           "kernel_plans", "smem_bytes", "tc_tiles", "tiles_error", "TcTiles", "accumulate_into",
           "Fp32x3Tiles", "fp32x3_tiles"]
