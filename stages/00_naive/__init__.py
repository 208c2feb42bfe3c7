"""Stage 00: naive attention (numpy and CuPy), the fp64 oracle, and the variants' definitions. See naive.py."""
from .naive import (
    backward, backward_varlen, causal_mask, check_cu_seqlens, forward, forward_varlen, score_matrix_bytes, scores,
)

__all__ = ["forward", "backward", "forward_varlen", "backward_varlen", "check_cu_seqlens", "causal_mask",
           "score_matrix_bytes", "scores"]

from stages.common import tolerance  # noqa: E402

tolerance.register_reference(forward, backward, scores)  # the tolerance rule's oracle (float64) and yardstick
