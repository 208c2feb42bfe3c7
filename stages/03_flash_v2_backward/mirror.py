"""numpy tile mirror of the FlashAttention-2 backward kernels (arXiv 2307.08691, Algorithm 2).

Same tiles and loop order as the CUDA kernels, so a learner can step through it and CI can test
the algorithm without a GPU. The batch and head axes are vectorised (numpy's batched matmul);
everything else follows one thread block's loops:

    preprocess:  D_i = rowsum(dO_i * O_i)                                   (bwd_preprocess)
    for j in K/V tiles:             one thread block per (j, batch*head) on the GPU
        dK_j = dV_j = 0             (registers)
        for i in Q tiles:           causal: tiles that see none of K_j are skipped
            S_ij = Q_i K_j^T;  P_ij = exp(scale S_ij - L_i)   (recomputed from the saved L_i)
            dV_j += P_ij^T dO_i
            dP_ij = dO_i V_j^T;  dS_ij = P_ij * (dP_ij - D_i)
            dK_j += dS_ij^T Q_i
            dQ_i += dS_ij K_j       fp32 accumulator, atomicAdd on the GPU
        write dK_j = scale dK_j, dV_j
    dQ = scale * dQ_accum           (tc, short heads: the head's last block; else bwd_convert_dq)

deterministic=True drops the dQ line above and runs a separate dQ pass (flash_bwd_dq_fp32,
flash_v2_backward_dq_tc): for i in Q tiles, for j in K/V tiles, recompute dS_ij and sum dQ_i in a fixed order.

The "tc" version computes as the tensor-core kernel does: fp32 accumulation, exp2 with log2(e)
folded into the scale, and P_ij, dS_ij rounded to the input dtype before they enter a matmul.
The "fp32x3" version computes its five matmuls with the 3xTF32 split (stage 02's matmul_3xtf32) and
P_ij = exp(scale S_ij - L_i) from one float32 rounding of the exponent, as its kernel does.

The variants (opts, stages/common/variants.py), tile by tile:
    grouped-query   the block of kv head g loops over the H / Hkv query heads that read it: dK_j, dV_j sum
                    over them (here: computed per query head, summed over each group when written)
    window          the Q tiles that see no key of K_j are skipped (i from the first to the last that does)
    softcap, ALiBi  x = c tanh(scale S_ij / c) - slope |i + shift - j|;  P_ij = exp(x - L_i);
                    dS_ij <- dS_ij (1 - tanh^2): the softcap's derivative, before dQ and dK
    dropout         Z_ij regenerated from the seed: dV_j += (P_ij Z_ij)^T dO_i / (1 - p),
                    dS_ij = P_ij (Z_ij / (1 - p) dP_ij - D_i)
"""
import numpy as np

from stages.common import LOG2E, cast, empty, variants

# (Br, Bc) of the main kernel and of the deterministic dQ pass, per version (as in kernels/*.cu).
# The tc kernel's Br and Bc depend on the head dim: TC_BR[D], TC_BC[D].
TC_BR = {64: 128, 128: 64, 256: 64}  # the kernel computes a 128-row Q tile (d=64) as two 64-row chunks
TC_BC = {64: 128, 128: 128, 256: 64}  # Bc of flash_v2_backward_tc per head dim: Bc / 16 warps, each owning 16 key rows
DQ_TILES = {"fp32": (32, 32), "tc": (64, 64)}
FP32X3_BR = {32: 64, 64: 64, 128: 32}  # Br of flash_bwd_fp32x3 per head dim; Bc = 64 (4 warps of 16 keys)
FP32X3_BC = 64


def tiles(version, D):
    """(Br, Bc) of the main kernel of `version` at head dim D."""
    if version == "fp32x3":
        return FP32X3_BR[D], FP32X3_BC
    return (32, 32) if version == "fp32" else (TC_BR[D], TC_BC[D])


def _matmul(version):
    """The matmul of `version`'s kernel: the 3xTF32 split for fp32x3 (stage 02's, as its forward), float32 else."""
    if version == "fp32x3":
        from stages.flash_v2.mirror import matmul_3xtf32

        return matmul_3xtf32
    return np.matmul


def _probabilities(S, L_i, scale, version, visible):
    """P_ij from the saved logsumexp; 0 where the key is masked or the row is fully masked (L = +inf)."""
    with np.errstate(over="ignore"):  # masked entries may overflow before np.where zeroes them
        if version == "tc":  # exp2((scale S - L_i) log2 e), scale S - L_i one FMA (float64, rounded once)
            x = (S.astype(np.float64) * np.float32(scale) - L_i[..., None]).astype(np.float32)
            P = np.exp2(x * np.float32(LOG2E))
        elif version == "fp32x3":  # exp(scale S - L_i), the exponent one FMA (float64, rounded once)
            P = np.exp((S.astype(np.float64) * np.float32(scale) - L_i[..., None]).astype(np.float32))
        else:  # the fp32 kernel forms the exponent in float64 (with inputs x100 it reaches 1e5: see the kernel)
            P = np.exp((S * scale - L_i[..., None].astype(np.float64)).astype(np.float32))
    return np.where(visible, P, np.float32(0.0)) if visible is not None else P


def _scores(Q_i, K_j, version):
    """S_ij = Q_i K_j^T: fp32 accumulation in the tc kernel, 3xTF32 in fp32x3, float64 in the fp32 kernel."""
    if version == "tc":
        return Q_i @ K_j.swapaxes(-1, -2)
    if version == "fp32x3":
        return _matmul(version)(Q_i, K_j.swapaxes(-1, -2))
    return Q_i.astype(np.float64) @ K_j.astype(np.float64).swapaxes(-1, -2)


def _visible(q0, q1, k0, k1, off, causal):
    """(br, bc) causal mask of tile rows q0:q1 against keys k0:k1 (bottom-right aligned), or None."""
    if not causal:
        return None
    q = np.arange(q0, q1)[:, None]  # (br, 1)
    kv = np.arange(k0, k1)[None, :]  # (1, bc)
    return kv <= q + off


def _tile_range(j, Bc, Br, Nq, Nk, causal, opts):
    """range of the Q tiles i whose rows see some key of K_j (keys j Bc .. (j + 1) Bc - 1)."""
    left, right = (opts.left, opts.right) if opts is not None else (-1, 0 if causal else -1)
    off = Nk - Nq
    k0, k1 = j * Bc, min(Nk, (j + 1) * Bc) - 1
    first = 0 if right < 0 else max(0, k0 - off - right)  # first row with k0 <= .. within its right side
    last = Nq - 1 if left < 0 else min(Nq - 1, k1 - off + left)  # last row whose window reaches k1
    return range(first // Br, last // Br + 1) if first <= last else range(0)


def backward(q, k, v, o, lse, do, *, causal, scale, version, deterministic, out_dtype=None, opts=None):
    """(dq, dk, dv) for numpy inputs (B, H, N, D); computed in float32, returned in q's dtype (or out_dtype).
    opts: variants.Options (grouped-query k/v, window, softcap, ALiBi, dropout), or None for plain attention."""
    if opts is not None:
        return _backward_variants(q, k, v, o, lse, do, causal=causal, scale=scale, version=version,
                                  deterministic=deterministic, out_dtype=out_dtype, opts=opts)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    dtype = q.dtype
    odtype = np.dtype(out_dtype or dtype)  # the gradients' dtype: q's, or float32 (unrounded partials)
    Q, K, V, O, dO = (cast(x, np.float32) for x in (q, k, v, o, do))  # (B, H, N, D) each

    def rnd(x):  # the tc kernel packs P and dS to 16-bit before the next mma
        return cast(cast(x, dtype), np.float32) if version == "tc" else x

    # preprocess (Alg.2 L4): D_i = rowsum(dO_i * O_i); a fully masked row has L = -inf: use +inf so P = 0
    Dvec = (dO * O).sum(axis=-1)  # (B, H, Nq)
    L = lse.astype(np.float32)
    L = np.where(np.isneginf(L), np.float32(np.inf), L)  # (B, H, Nq)

    Br, Bc = tiles(version, D)
    Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
    off = Nk - Nq  # query q sees key kv iff kv <= q + off
    dq_acc = np.zeros((B, H, Nq, D), np.float32)  # the fp32 atomicAdd target
    dk, dv = empty(np, k.shape, odtype), empty(np, v.shape, odtype)
    mm = _matmul(version)
    for j in range(Tc):  # Alg.2 L5: one thread block per j
        k0, k1 = j * Bc, min(Nk, (j + 1) * Bc)
        K_j, V_j = K[:, :, k0:k1], V[:, :, k0:k1]  # (B, H, bc, D)
        dK_j = np.zeros_like(K_j)
        dV_j = np.zeros_like(V_j)
        i_begin = max(0, j * Bc - off) // Br if causal else 0
        for i in range(i_begin, Tr):  # Alg.2 L8
            q0, q1 = i * Br, min(Nq, (i + 1) * Br)
            Q_i, dO_i = Q[:, :, q0:q1], dO[:, :, q0:q1]  # (B, H, br, D)
            S = _scores(Q_i, K_j, version)  # (B, H, br, bc) S_ij, unscaled
            P = _probabilities(S, L[:, :, q0:q1], scale, version, _visible(q0, q1, k0, k1, off, causal))
            dP = mm(dO_i, V_j.swapaxes(-1, -2))  # (B, H, br, bc)
            dS = P * (dP - Dvec[:, :, q0:q1, None])  # (B, H, br, bc)
            P, dS = rnd(P), rnd(dS)
            dV_j += mm(P.swapaxes(-1, -2), dO_i)  # (B, H, bc, D)
            dK_j += mm(dS.swapaxes(-1, -2), Q_i)  # (B, H, bc, D)
            if not deterministic:
                dq_acc[:, :, q0:q1] += mm(dS, K_j)  # (B, H, br, D): atomicAdd on the GPU
        dk[:, :, k0:k1] = cast(np.float32(scale) * dK_j, odtype)
        dv[:, :, k0:k1] = cast(dV_j, odtype)

    if deterministic:  # the separate dQ pass: parallel over Q tiles, fixed summation order
        Br, Bc = DQ_TILES[version]
        Tr, Tc = -(-Nq // Br), -(-Nk // Bc)
        for i in range(Tr):
            q0, q1 = i * Br, min(Nq, (i + 1) * Br)
            Q_i, dO_i = Q[:, :, q0:q1], dO[:, :, q0:q1]
            dQ_i = np.zeros_like(Q_i)  # (B, H, br, D)
            last_kv = q1 - 1 + off
            j_end = Tc if not causal else (0 if last_kv < 0 else min(Tc, last_kv // Bc + 1))
            for j in range(j_end):
                k0, k1 = j * Bc, min(Nk, (j + 1) * Bc)
                K_j, V_j = K[:, :, k0:k1], V[:, :, k0:k1]
                S = _scores(Q_i, K_j, version)
                P = _probabilities(S, L[:, :, q0:q1], scale, version, _visible(q0, q1, k0, k1, off, causal))
                dS = rnd(P * (dO_i @ V_j.swapaxes(-1, -2) - Dvec[:, :, q0:q1, None]))
                dQ_i += dS @ K_j
            dq_acc[:, :, q0:q1] = dQ_i
    dq = empty(np, q.shape, odtype)
    dq[...] = cast(np.float32(scale) * dq_acc, odtype)
    return dq, dk, dv


def _backward_variants(q, k, v, o, lse, do, *, causal, scale, version, deterministic, out_dtype, opts):
    """Algorithm 2 with the variants (see the module docstring); dQ accumulated as in the main kernel (the
    deterministic pass visits the same tiles in a fixed order, so it gives the same sums here)."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = opts.group
    dtype = q.dtype
    odtype = np.dtype(out_dtype or dtype)
    f32 = np.float32
    Q, O, dO = (cast(x, f32) for x in (q, o, do))
    K, V = (np.repeat(cast(x, f32), g, axis=1) if g > 1 else cast(x, f32) for x in (k, v))  # (B, H, Nk, D)

    def rnd(x):
        return cast(cast(x, dtype), f32) if version == "tc" else x

    Dvec = (dO * O).sum(axis=-1)  # (B, H, Nq)
    L = lse.astype(f32)
    L = np.where(np.isneginf(L), f32(np.inf), L)
    slopes = variants.slopes_bh(opts, B, H)
    ashift = variants.alibi_shift(opts, Nq, Nk)  # ALiBi's diagonal: Nk - Nq, or that of the block's origin
    keep = None
    if opts.dropout_p:
        keep = variants.dropout_keep(B, H, Nq, Nk, opts.dropout_p, opts.seed, variants.dropout_origin(opts)).astype(f32)
    rp = f32(1 / (1 - opts.dropout_p))
    Br, Bc = tiles(version, D)
    Tc = -(-Nk // Bc)
    dq_acc = np.zeros((B, H, Nq, D), f32)
    dk_h, dv_h = np.zeros((B, H, Nk, D), f32), np.zeros((B, H, Nk, D), f32)  # per query head, then per group
    for j in range(Tc):  # one thread block per (j, kv head): its group's query heads are the H axis here
        k0, k1 = j * Bc, min(Nk, (j + 1) * Bc)
        K_j, V_j = K[:, :, k0:k1], V[:, :, k0:k1]
        cols = np.arange(k0, k1)
        for i in _tile_range(j, Bc, Br, Nq, Nk, causal, opts):
            q0, q1 = i * Br, min(Nq, (i + 1) * Br)
            rows = np.arange(q0, q1)
            Q_i, dO_i = Q[:, :, q0:q1], dO[:, :, q0:q1]
            x = Q_i @ K_j.swapaxes(-1, -2) * f32(scale)  # (B, H, br, bc): scale S_ij
            t = None
            if opts.softcap:
                t = np.tanh(x * f32(1 / opts.softcap))
                x = f32(opts.softcap) * t
            if slopes is not None:
                x = x + variants.alibi_bias(slopes, Nq, Nk, np, rows, cols, ashift)
            with np.errstate(over="ignore"):
                P = np.exp2((x - L[:, :, q0:q1, None]) * f32(LOG2E))
            P = np.where(variants.visible(Nq, Nk, opts, np, rows, cols), P, f32(0))
            dP = dO_i @ V_j.swapaxes(-1, -2)
            Pz = P
            if keep is not None:
                Z = keep[:, :, q0:q1, k0:k1]
                Pz, dP = P * Z, dP * Z * rp
            dS = P * (dP - Dvec[:, :, q0:q1, None])
            if t is not None:
                dS = dS * (f32(1) - t * t)
            Pz, dS = rnd(Pz), rnd(dS)
            dv_h[:, :, k0:k1] += Pz.swapaxes(-1, -2) @ dO_i
            dk_h[:, :, k0:k1] += dS.swapaxes(-1, -2) @ Q_i
            dq_acc[:, :, q0:q1] += dS @ K_j
    dk_h *= f32(scale)
    if keep is not None:
        dv_h *= rp
    if g > 1:
        dk_h, dv_h = (x.reshape(B, Hkv, g, Nk, D).sum(axis=2) for x in (dk_h, dv_h))
    dq = cast(f32(scale) * dq_acc, odtype)
    return dq, cast(dk_h, odtype), cast(dv_h, odtype)
