"""Stage 00: naive attention (numpy and CuPy), the fp64 oracle. See naive.py."""
from .naive import backward, causal_mask, forward, score_matrix_bytes, scores

__all__ = ["forward", "backward", "causal_mask", "score_matrix_bytes", "scores"]
