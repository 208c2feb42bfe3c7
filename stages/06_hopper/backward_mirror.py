"""The tile order of stage 06's backward (kernels/flash_v3_backward_ws.cu) in numpy: what each consumer warpgroup
computes and where each partial sum goes. Runs anywhere; tests/test_06_hopper_cpu.py checks it against stage 00.

    dq, dk, dv = backward_mirror.backward(q, k, v, o, lse, do, causal=True)                  # version ws, D = 128
    dq, dk, dv = backward_mirror.backward(q, k, v, o, lse, do, causal=True, br=128)          # version ws, D = 64
    dq, dk, dv = backward_mirror.backward(q, k, v, o, lse, do, causal=True, bc=64)           # version wgmma
    dq, dk, dv = backward_mirror.backward(q, k[:, :1], v[:, :1], o, lse, do, opts=opts)     # the variants' kernel

A block owns a K/V tile j of `bc` keys; each consumer warpgroup owns 64 of them (keys K_c, V_c). For each Q tile i of
`br` rows that sees the tile (Algorithm 2 of FlashAttention-2, transposed so that the keys are the rows):

    S^T  = K_c Q_i^T,   P^T = exp(scale S^T - L_i)  (0 where masked),   dP^T = V_c dO_i^T,   dS^T = P^T o (dP^T - D_i)
    dV_c += P^T dO_i,   dK_c += dS^T Q_i                             the consumer's accumulators
    dQ_i += dS_c K_c   (dS_c: dS_i at the consumer's keys)          summed over the block's consumers, then one
                                                                     reduction into dQ per (block, Q tile)

and dK = scale dK, dQ = scale dQ (the kernels scale each sum before it leaves). With the variants (opts) a block is
(K/V tile, k / v head) and walks every query head h of its group, so dK_c, dV_c sum over the group; the mask is the
window's, the Q tiles only those with a row that sees one of its keys (q_tiles), and S^T goes through softcap
(dS^T then times its derivative 1 - tanh^2) and ALiBi. Version wgmma is the same with
bc = 64 (one warpgroup) and br = 64; version ws takes bc = 128: its two consumers add their shares of dQ_i in the
block before it leaves, which halves the reductions into dQ (dq_reductions). At D = 64 version ws takes Q tiles of
br = 128 rows (flash_v3_backward.q_tile_rows): half as many reductions again, each of twice the rows, so dQ
receives the same sums in half as many pieces.
"""
import numpy as np

from stages.common import variants
from stages.common.checks import check_backward_inputs, check_causal, resolve_scale

WG = 64    # keys of one consumer warpgroup


def q_tiles(Nq, Nk, key0, bc, br, left=-1, right=-1):
    """The first rows of the Q tiles of br rows with a row that sees one of keys key0 .. key0 + bc - 1 (bottom-right
    alignment, shift = Nk - Nq; a window (left, right), -1 unbounded: causal is (-1, 0)): from the first row whose
    right side reaches key0 to the last whose left side reaches the block's last key (kernels/hopper_variants.cuh:
    KeyBlock; plain attention's PlainBlock is the same for (-1, -1) and (-1, 0))."""
    shift, last_key = Nk - Nq, min(key0 + bc, Nk) - 1
    first = 0 if right < 0 else max(0, key0 - shift - right)
    last = Nq - 1 if left < 0 else min(Nq - 1, last_key - shift + left)
    return range(first // br * br, last + 1 if key0 < Nk and first <= last else 0, br)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, bc=128, br=64, trace=None, opts=None):
    """(dq, dk, dv) in float64 by the kernel's tile order; bc: keys per block (64: version wgmma, 128: ws), whose
    consumers add their shares of dQ_i before it leaves; br: rows of a Q tile (64; 128: version ws at D = 64). trace,
    a list: receives (first key of the block, first row of the Q tile) for every reduction into query head 0's dQ, in
    order (every head's are alike).
    opts: variants.Options (the variants' kernel: k, v with H / group heads, a block per (K/V tile, k / v head)
    walking the Q tiles of every query head of its group; a window's Q tiles only; softcap and ALiBi on S^T)."""
    where = "backward_mirror.backward"
    check_backward_inputs(q, k, v, o, lse, do, where=where, gqa=True)  # (B, H, N, D) arrays of one dtype
    causal = check_causal(causal, where)
    q, k, v, o, do = (np.asarray(x, np.float64) for x in (q, k, v, o, do))
    lse = np.asarray(lse, np.float64)
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    opts = opts or variants.check(q, k, causal=causal)
    group, left, right = H // Hkv, opts.left, opts.right
    scale = resolve_scale(scale, D, where)
    L = np.where(np.isneginf(lse), np.inf, lse)  # a row that sees no key: L = +inf, so P = 0 (the preprocess)
    Dvec = (do * o).sum(-1)                       # D_i = rowsum(dO_i o O_i) (the preprocess)
    slopes = variants.slopes_bh(opts, B, H, dtype=np.float64)
    T = np.swapaxes
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for key0 in range(0, Nk, bc):                 # a block: K/V tile j, of every k / v head
        for h in range(H):                        # the query heads of each group, one after the other
            hk = h // group
            for row0 in q_tiles(Nq, Nk, key0, bc, br, left, right):
                rows = slice(row0, min(row0 + br, Nq))
                dq_tile = 0.0
                for k0 in range(key0, min(key0 + bc, Nk), WG):  # the consumer warpgroups, 64 keys each
                    keys = slice(k0, min(k0 + WG, Nk))
                    st = k[:, hk, keys] @ T(q[:, h, rows], -1, -2)                  # S^T: keys x queries
                    x, dcap = scale * st, 1.0
                    if opts.softcap:
                        x = opts.softcap * np.tanh(x / opts.softcap)
                        dcap = 1.0 - (x / opts.softcap) ** 2
                    if slopes is not None:
                        dist = variants.alibi_bias(slopes[:, h:h + 1], Nq, Nk, rows=range(rows.start, rows.stop),
                                                   cols=range(keys.start, keys.stop))[:, 0]
                        x = x + T(dist, -1, -2)
                    seen = T(variants.visible(Nq, Nk, opts, rows=range(rows.start, rows.stop),
                                              cols=range(keys.start, keys.stop)), -1, -2)
                    pt = np.where(seen, np.exp(x - L[:, h, None, rows]), 0.0)
                    dpt = v[:, hk, keys] @ T(do[:, h, rows], -1, -2)               # dP^T
                    dst = pt * (dpt - Dvec[:, h, None, rows]) * dcap               # dS^T
                    dv[:, hk, keys] += pt @ do[:, h, rows]                         # summed over the group
                    dk[:, hk, keys] += dst @ q[:, h, rows]
                    dq_tile = dq_tile + T(dst, -1, -2) @ k[:, hk, keys]            # dS K over this consumer's keys
                _reduce(dq[:, h], rows, dq_tile, trace if h == 0 else None, (key0, row0))  # per (block, head, Q tile)
    return scale * dq, scale * dk, dv


def _reduce(dq, rows, part, trace, where):
    """One reduction into dQ: part added to its rows (the kernels: the copy engine's bulk add, or lanes' red.add)."""
    dq[..., rows, :] += part
    if trace is not None:
        trace.append(where)


def dq_reductions(Nq, Nk, causal, bc, br=64):
    """How many reductions into dQ one head takes with blocks of bc keys and Q tiles of br rows, each adding br x D
    values: one per (block, Q tile)."""
    return sum(len(q_tiles(Nq, Nk, key0, bc, br, -1, 0 if causal else -1)) for key0 in range(0, Nk, bc))
