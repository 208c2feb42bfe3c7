"""Stage 00: naive scaled dot-product attention, forward and backward.

    S = scale * Q K^T          (B, H, Nq, Nk)   the full score matrix: memory grows as N^2
    P = softmax(S)              row-wise, stable: subtract the row max m before exp
    O = P V                     (B, H, Nq, D)
    L = m + log(rowsum(exp(S - m)))   the log-sum-exp, saved for the backward

One code path for numpy (CPU) and CuPy (GPU) arrays: `xp` is whichever module the inputs
belong to. Called with float64 inputs this is the oracle every later stage is checked against.

Precision: float64 and float32 inputs are computed in their own dtype. float16 and bfloat16 inputs are
computed as a tensor-core FlashAttention kernel computes: matmuls accumulate in float32, S and dP stay in
float32, and only what a kernel feeds to a 16-bit matmul or returns is rounded to the input dtype: P before
P V and P^T dO, dS before dS K and dS^T Q, and the outputs (unless out_dtype=float32 keeps them unrounded).
That makes stage 00 in the inputs' dtype the tolerance rule's yardstick (stages/common/tolerance.py).

Causal masking with Nq != Nk is aligned bottom-right, as in FlashAttention 2.1+: query i sees
key j when j <= i + (Nk - Nq), so the last query sees every key. With Nq > Nk the first
Nq - Nk rows see no key at all: they are fully masked and give o = 0, lse = -inf (never NaN).
"""
import numpy as np

from stages.common import (
    cast, check_attention_inputs, check_backward_inputs, check_causal, check_out_dtype, resolve_scale,
)


def causal_mask(Nq, Nk, xp=np):
    """(Nq, Nk) boolean, True where query i may attend key j: j <= i + (Nk - Nq)."""
    i = xp.arange(Nq)[:, None]  # (Nq, 1)
    j = xp.arange(Nk)[None, :]  # (1, Nk)
    return j <= i + (Nk - Nq)


def _compute_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _round(x, dtype):
    """Round a float32 intermediate to the input dtype (a no-op for float32/float64)."""
    return cast(cast(x, dtype), x.dtype)


def scores(q, k, scale, causal, xp):
    """S = scale * Q K^T (float32 for 16-bit inputs, never rounded), masked to -inf above the causal diagonal."""
    cd = _compute_dtype(q.dtype)
    s = xp.matmul(cast(q, cd), cast(k, cd).swapaxes(-1, -2)) * scale  # (B, H, Nq, Nk)
    if causal:
        s = xp.where(causal_mask(q.shape[2], k.shape[2], xp), s, -xp.inf)
    return s


def forward(q, k, v, *, causal=False, scale=None, out_dtype=None):
    """Naive attention. Returns o (q's dtype, or out_dtype) and lse (B, H, Nq): float32, float64 for float64.

    out_dtype=float32 returns O unrounded for 16-bit inputs (as the kernels' float32 output does)."""
    xp, B, H, Nq, Nk, D = check_attention_inputs(q, k, v, where="naive.forward")
    causal = check_causal(causal, "naive.forward")
    out_dtype = check_out_dtype(out_dtype, q.dtype, "naive.forward")
    scale = resolve_scale(scale, D)
    cd = _compute_dtype(q.dtype)
    s = scores(q, k, scale, causal, xp)  # (B, H, Nq, Nk)
    m = s.max(axis=-1, keepdims=True)  # (B, H, Nq, 1) row max
    m = xp.where(xp.isinf(m), 0.0, m)  # a fully masked row has m = -inf: use 0, its p is 0 anyway
    p = xp.exp(s - m)  # (B, H, Nq, Nk) in (0, 1]: exp never overflows
    l = p.sum(axis=-1, keepdims=True)  # (B, H, Nq, 1) row sum
    o = xp.matmul(_round(p, q.dtype), cast(v, cd))  # (B, H, Nq, D) unnormalised
    o = o / xp.where(l == 0, 1.0, l)  # fully masked row: o = 0
    with np.errstate(divide="ignore"):
        lse = (m + xp.log(l))[..., 0]  # (B, H, Nq); log(0) = -inf for fully masked rows
    return cast(o, out_dtype), lse.astype(np.float64 if cd == np.float64 else np.float32)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, out_dtype=None):
    """Gradients of sum(O * dO) with respect to q, k, v, from the saved lse (P is recomputed).

        P  = exp(S - L)               recomputed from the saved lse
        dV = P^T dO                   (B, H, Nk, D)
        dP = dO V^T                   (B, H, Nq, Nk)
        D  = rowsum(dO * O)           (B, H, Nq, 1)   = rowsum(P * dP)
        dS = P * (dP - D)             the softmax Jacobian applied to dP
        dQ = scale * dS K,  dK = scale * dS^T Q

    16-bit inputs: P and dS rounded before their matmuls, S and dP kept in float32 (see the module docstring);
    out_dtype=float32 returns the gradients unrounded.
    """
    xp, B, H, Nq, Nk, D = check_backward_inputs(q, k, v, o, lse, do, where="naive.backward")
    causal = check_causal(causal, "naive.backward")
    out_dtype = check_out_dtype(out_dtype, q.dtype, "naive.backward")
    scale = resolve_scale(scale, D)
    cd = _compute_dtype(q.dtype)
    s = scores(q, k, scale, causal, xp)  # (B, H, Nq, Nk)
    lse = cast(lse, cd)[..., None]  # (B, H, Nq, 1)
    lse = xp.where(xp.isneginf(lse), xp.inf, lse)  # fully masked row: exp(-inf - inf) = 0, not NaN
    p = xp.exp(s - lse)  # (B, H, Nq, Nk)
    do_c, o_c = cast(do, cd), cast(o, cd)
    dv = xp.matmul(_round(p, q.dtype).swapaxes(-1, -2), do_c)  # (B, H, Nk, D)
    dp = xp.matmul(do_c, cast(v, cd).swapaxes(-1, -2))  # (B, H, Nq, Nk), float32: not rounded
    d_i = (do_c * o_c).sum(axis=-1, keepdims=True)  # (B, H, Nq, 1)
    ds = _round(p * (dp - d_i), q.dtype)  # (B, H, Nq, Nk)
    dq = scale * xp.matmul(ds, cast(k, cd))  # (B, H, Nq, D)
    dk = scale * xp.matmul(ds.swapaxes(-1, -2), cast(q, cd))  # (B, H, Nk, D)
    return cast(dq, out_dtype), cast(dk, out_dtype), cast(dv, out_dtype)


def score_matrix_bytes(B, H, Nq, Nk, dtype=np.float32):
    """Bytes of one materialised (B, H, Nq, Nk) score matrix: the N^2 term naive attention pays."""
    return B * H * Nq * Nk * np.dtype(dtype).itemsize
