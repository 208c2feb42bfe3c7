"""The numpy tile mirror of kernels/flash_v1_forward.cu and kernels/flash_v1_backward.cu.

Same algorithm (arXiv 2205.14135, Algorithm 1 forward, Algorithm 4 backward without dropout), same
Br x Bc tiles, same loop order (j over K/V tiles outside, i over Q tiles inside), same causal tile
skipping, same float32 arithmetic. What the kernel gives to threads, the mirror vectorises: all
(batch, head) pairs at once (the kernel's grid of blocks) and the whole tile at once (the kernel's
threads). O, l, m and dQ live in full-size arrays, the mirror's "HBM", and are read and written back
at every step exactly where the kernel does it. Inputs are assumed checked (flash_v1.py checks them).
"""
import numpy as np

from stages.common import empty

BR = 32  # Br: rows of a Q tile (Q_i, O_i, dO_i, dQ_i)
BC = 32  # Bc: keys of a K/V tile (K_j, V_j, dK_j, dV_j)


def _visible(i, j, Nq, Nk, causal):
    """(br, bc) boolean mask of tile (i, j): query R sees key C iff C <= R + (Nk - Nq) (bottom-right)."""
    R = np.arange(i * BR, min((i + 1) * BR, Nq))[:, None]  # (br, 1) global query rows
    C = np.arange(j * BC, min((j + 1) * BC, Nk))[None, :]  # (1, bc) global key columns
    return (C <= R + (Nk - Nq)) if causal else np.ones((R.size, C.size), bool)


def first_q_tile(j, Nq, Nk, causal):
    """The first Q tile i that sees any key of K_j; tiles before it are fully masked and skipped."""
    return max(0, j * BC - (Nk - Nq)) // BR if causal else 0


def forward(q, k, v, *, causal, scale, trace=None):
    """Algorithm 1 on numpy float32 arrays (B, H, N, D). Returns o, lse. trace: list to append (j, i) to."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    Tr, Tc = -(-Nq // BR), -(-Nk // BC)
    f32 = np.float32
    o = empty(np, (B, H, Nq, D), f32)
    o[...] = 0  # Alg.1 L2: O = 0, l = 0, m = -inf in HBM
    l = np.zeros((B, H, Nq), f32)
    m = np.full((B, H, Nq), -np.inf, f32)
    for j in range(Tc):  # Alg.1 L5: outer loop over K/V tiles
        cols = slice(j * BC, min((j + 1) * BC, Nk))
        Kj, Vj = k[:, :, cols], v[:, :, cols]  # Alg.1 L6: (B, H, bc, D) each
        for i in range(first_q_tile(j, Nq, Nk, causal), Tr):  # Alg.1 L7: inner loop over Q tiles
            if trace is not None:
                trace.append((j, i))
            rows = slice(i * BR, min((i + 1) * BR, Nq))
            Qi, Oi, li, mi = q[:, :, rows], o[:, :, rows], l[:, :, rows], m[:, :, rows]  # Alg.1 L8
            S = f32(scale) * (Qi @ Kj.swapaxes(-1, -2))  # Alg.1 L9: (B, H, br, bc)
            S = np.where(_visible(i, j, Nq, Nk, causal), S, f32(-np.inf))
            m_t = S.max(-1)  # Alg.1 L10: m~_ij (B, H, br), -inf for a row with no visible key
            P = np.exp(S - np.where(np.isneginf(m_t), f32(0), m_t)[..., None])  # P~_ij (B, H, br, bc)
            l_t = P.sum(-1)  # l~_ij (B, H, br)
            m_new = np.maximum(mi, m_t)  # Alg.1 L11
            m_safe = np.where(np.isneginf(m_new), f32(0), m_new)  # rows with nothing visible yet: weights 0
            alpha, beta = np.exp(mi - m_safe), np.exp(m_t - m_safe)  # (B, H, br)
            l_new = alpha * li + beta * l_t
            l_div = np.where(l_new == 0, f32(1), l_new)
            a, b = li * alpha / l_div, beta / l_div  # O_i's weight and P~_ij V_j's weight, (B, H, br)
            o[:, :, rows] = a[..., None] * Oi + b[..., None] * (P @ Vj)  # Alg.1 L12: (B, H, br, D)
            l[:, :, rows], m[:, :, rows] = l_new, m_new  # Alg.1 L13
    lse = empty(np, (B, H, Nq), f32)
    with np.errstate(divide="ignore"):
        lse[...] = np.where(l != 0, m + np.log(l), f32(-np.inf))  # L_i = m_i + log(l_i); NaN stays NaN
    return o, lse


def backward(q, k, v, o, lse, do, *, causal, scale, trace=None):
    """Algorithm 4 (no dropout) on numpy float32 arrays. Returns dq, dk, dv."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    Tr, Tc = -(-Nq // BR), -(-Nk // BC)
    f32 = np.float32
    L = np.where(np.isneginf(lse), f32(np.inf), lse).astype(f32)  # (B, H, Nq); no key seen: P = exp(-inf) = 0
    dq = empty(np, (B, H, Nq, D), f32)
    dq[...] = 0  # Alg.4 L6
    dk = empty(np, (B, H, Nk, D), f32)
    dv = empty(np, (B, H, Nk, D), f32)
    for j in range(Tc):  # Alg.4 L7
        cols = slice(j * BC, min((j + 1) * BC, Nk))
        Kj, Vj = k[:, :, cols], v[:, :, cols]  # Alg.4 L8: (B, H, bc, D)
        dKj = np.zeros_like(Kj)  # Alg.4 L9: dK~_j, dV~_j on chip (B, H, bc, D)
        dVj = np.zeros_like(Vj)
        for i in range(first_q_tile(j, Nq, Nk, causal), Tr):  # Alg.4 L10
            if trace is not None:
                trace.append((j, i))
            rows = slice(i * BR, min((i + 1) * BR, Nq))
            Qi, Oi, dOi, Li = q[:, :, rows], o[:, :, rows], do[:, :, rows], L[:, :, rows]  # Alg.4 L11
            S = f32(scale) * (Qi @ Kj.swapaxes(-1, -2))  # Alg.4 L12: (B, H, br, bc)
            S = np.where(_visible(i, j, Nq, Nk, causal), S, f32(-np.inf))  # L13
            P = np.exp(S - Li[..., None])  # L14: P_ij = exp(S_ij - L_i), (B, H, br, bc)
            dVj += P.swapaxes(-1, -2) @ dOi  # L17: (B, H, bc, D)
            dP = dOi @ Vj.swapaxes(-1, -2)  # L18: (B, H, br, bc)
            Di = (dOi * Oi).sum(-1)  # L20: D_i (B, H, br)
            dS = P * (dP - Di[..., None])  # L21: (B, H, br, bc)
            dq[:, :, rows] += f32(scale) * (dS @ Kj)  # L22: read-modify-write of dQ_i, (B, H, br, D)
            dKj += dS.swapaxes(-1, -2) @ Qi  # L23 (scale applied once at L25)
        dk[:, :, cols] = f32(scale) * dKj  # Alg.4 L25
        dv[:, :, cols] = dVj
    return dq, dk, dv
