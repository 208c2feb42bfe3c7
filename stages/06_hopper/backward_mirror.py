"""The tile order of stage 06's backward (kernels/flash_v3_backward_ws.cu) in numpy: what each consumer warpgroup
computes and where each partial sum goes. Runs anywhere; tests/test_06_hopper_cpu.py checks it against stage 00.

    dq, dk, dv = backward_mirror.backward(q, k, v, o, lse, do, causal=True)                  # version ws, D = 128
    dq, dk, dv = backward_mirror.backward(q, k, v, o, lse, do, causal=True, br=128)          # version ws, D = 64
    dq, dk, dv = backward_mirror.backward(q, k, v, o, lse, do, causal=True, bc=64)           # version wgmma

A block owns a K/V tile j of `bc` keys; each consumer warpgroup owns 64 of them (keys K_c, V_c). For each Q tile i of
`br` rows that sees the tile (Algorithm 2 of FlashAttention-2, transposed so that the keys are the rows):

    S^T  = K_c Q_i^T,   P^T = exp(scale S^T - L_i)  (0 where masked),   dP^T = V_c dO_i^T,   dS^T = P^T o (dP^T - D_i)
    dV_c += P^T dO_i,   dK_c += dS^T Q_i                             the consumer's accumulators
    dQ_i += dS_c K_c   (dS_c: dS_i at the consumer's keys)          summed over the block's consumers, then one
                                                                     reduction into dQ per (block, Q tile)

and dK = scale dK, dQ = scale dQ (the kernels scale each sum before it leaves). Version wgmma is the same with
bc = 64 (one warpgroup) and br = 64; version ws takes bc = 128: its two consumers add their shares of dQ_i in the
block before it leaves, which halves the reductions into dQ (dq_reductions). At D = 64 version ws takes Q tiles of
br = 128 rows (flash_v3_backward.q_tile_rows): half as many reductions again, each of twice the rows, so dQ
receives the same sums in half as many pieces.
"""
import numpy as np

from stages.common.checks import check_backward_inputs, check_causal, resolve_scale

WG = 64    # keys of one consumer warpgroup


def _tiles(causal, Nq, Nk, key0, br):
    """The first rows of the Q tiles of br rows that see keys key0.. (bottom-right causal alignment: row r sees key c
    iff c <= r + Nk - Nq)."""
    first_row = max(0, key0 - (Nk - Nq)) if causal else 0
    return range(first_row // br * br, Nq, br)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, bc=128, br=64, trace=None):
    """(dq, dk, dv) in float64 by the kernel's tile order; bc: keys per block (64: version wgmma, 128: ws), whose
    consumers add their shares of dQ_i before it leaves; br: rows of a Q tile (64; 128: version ws at D = 64). trace,
    a list: receives (first key of the block, first row of the Q tile) for every reduction into dQ, in order."""
    where = "backward_mirror.backward"
    check_backward_inputs(q, k, v, o, lse, do, where=where)  # (B, H, N, D) arrays of one dtype; lse (B, H, Nq)
    causal = check_causal(causal, where)
    q, k, v, o, do = (np.asarray(x, np.float64) for x in (q, k, v, o, do))
    lse = np.asarray(lse, np.float64)
    Nq, D = q.shape[-2:]
    Nk = k.shape[-2]
    scale = resolve_scale(scale, D, where)
    shift = Nk - Nq
    L = np.where(np.isneginf(lse), np.inf, lse)  # a row that sees no key: L = +inf, so P = 0 (the preprocess)
    Dvec = (do * o).sum(-1)                       # D_i = rowsum(dO_i o O_i) (the preprocess)
    T = np.swapaxes
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for key0 in range(0, Nk, bc):                 # a block: K/V tile j
        for row0 in _tiles(causal, Nq, Nk, key0, br):
            rows = slice(row0, min(row0 + br, Nq))
            r = np.arange(rows.start, rows.stop)
            dq_tile = 0.0
            for k0 in range(key0, min(key0 + bc, Nk), WG):  # the consumer warpgroups, 64 keys each
                keys = slice(k0, min(k0 + WG, Nk))
                c = np.arange(keys.start, keys.stop)[:, None]
                st = k[..., keys, :] @ T(q[..., rows, :], -1, -2)          # S^T: keys x queries
                pt = np.exp(scale * st - L[..., None, rows])
                if causal:
                    pt = np.where(c <= r[None, :] + shift, pt, 0.0)
                dpt = v[..., keys, :] @ T(do[..., rows, :], -1, -2)        # dP^T
                dst = pt * (dpt - Dvec[..., None, rows])                   # dS^T
                dv[..., keys, :] += pt @ do[..., rows, :]
                dk[..., keys, :] += dst @ q[..., rows, :]
                dq_tile = dq_tile + T(dst, -1, -2) @ k[..., keys, :]       # dS K over this consumer's keys
            _reduce(dq, rows, dq_tile, trace, (key0, row0))                # one reduction per (block, Q tile)
    return scale * dq, scale * dk, dv


def _reduce(dq, rows, part, trace, where):
    """One reduction into dQ: part added to its rows (the kernels: the copy engine's bulk add, or lanes' red.add)."""
    dq[..., rows, :] += part
    if trace is not None:
        trace.append(where)


def dq_reductions(Nq, Nk, causal, bc, br=64):
    """How many reductions into dQ one head takes with blocks of bc keys and Q tiles of br rows, each adding br x D
    values: one per (block, Q tile)."""
    return sum(len(_tiles(causal, Nq, Nk, key0, br)) for key0 in range(0, Nk, bc))
