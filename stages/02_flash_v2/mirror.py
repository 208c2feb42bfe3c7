"""The numpy tile mirror of the stage 02 kernels (FlashAttention-2 forward, arXiv 2307.08691, Algorithm 1).

Same algorithm, same Br x Bc tiles, same loop order as the kernels: i over Q tiles OUTSIDE (each Q tile is
one thread block on the GPU), j over K/V tiles inside; O_i, l_i, m_i live only inside the i loop (the
kernel's registers) and are never written back until the end; the division by l_i is deferred to the end;
causal tiles right of the diagonal are never visited and the mask is applied only on the tiles that need
it (the diagonal ones and the ragged last K tile); softmax in base 2 (log2(e) folded into the scale), so m_i is
the README's m_i times log2(e), the rescale is 2^(m_i - m_new) and L_i = m_i ln 2 + log(l_i).
What the kernel gives to blocks and threads, the mirror vectorises: all (batch, head) pairs at once and
the whole tile at once.

Precision follows the kernel the mirror stands for:
  float32 (version "fp32"): everything in float32.
  float32 (version "fp32x3", tf32x3=True): both matmuls as the kernel does them on TF32 tensor cores: each
  operand x = big + small with big = tf32(x), small = tf32(x - big) (round to nearest, ties away, 10 mantissa
  bits); S_ij = Q_small K_big + Q_big K_small + Q_big K_big in float32 (Q_small K_small dropped); V_j is split in
  three exact parts (hi + mid + lo) and P~_ij V_j = P_small V_hi + P_big V_lo + P_big V_mid + P_big V_hi. The
  rest (softmax, l_i, the final division) is float32 as in "fp32". (The tensor core's own truncating
  accumulation is not modelled.)
  float16 / bfloat16 (versions "tc", "pipelined"): what a tensor core does. Inputs stay in their 16-bit
  values (widened exactly to float32), Q_i K_j^T accumulates in float32, P~_ij is rounded to the
  input dtype before P~_ij V_j (the A operand of the second mma), l_i sums the unrounded float32 P~_ij,
  O_i accumulates in float32 and is rounded to the input dtype once, at the end.
Inputs are assumed checked (flash_v2.py checks them and picks the tiles).
"""
import numpy as np

from stages.common import LOG2E, cast, empty, variants

LN2 = 0.6931471805599453


def tf32_split(x):
    """(big, small) of a float32 array, both TF32 values held in float32: big = x rounded to 10 mantissa bits
    (to nearest, ties away from zero: cvt.rna.tf32.f32), small = (x - big) rounded the same way."""

    def rna(y):
        bits = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
        return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)  # finite inputs only

    big = rna(x)
    return big, rna(x - big)  # x - big is exact in float32


def matmul_3xtf32(a, b):
    """a @ b in float32 as the 3xTF32 tensor-core kernel computes S = Q K^T: small products first, small*small
    dropped."""
    ab, as_ = tf32_split(a)
    bb, bs = tf32_split(b)
    return (as_ @ bb + ab @ bs) + ab @ bb


def matmul_pv_tf32(p, v):
    """p @ v as the kernel computes P~ V: P in two TF32 parts, V in three (hi + mid + lo = v exactly, so a one-hot
    row of P gives a row of V exactly), P_small V_hi + P_big V_lo + P_big V_mid + P_big V_hi."""
    pb, ps = tf32_split(p)
    vh = tf32_split(v)[0]
    r = v - vh  # exact, at most 12 significant bits
    vm = tf32_split(r)[0]
    vl = r - vm  # exact: the last bit of r
    return ((ps @ vh + pb @ vl) + pb @ vm) + pb @ vh


def _window(opts, causal):
    """(left, right) of the visible band around the diagonal (-1: unbounded): causal is right = 0."""
    if opts is None:
        return -1, (0 if causal else -1)
    return opts.left, opts.right


def visited_tiles(i, Nq, Nk, br, bc, causal, opts=None):
    """How many K/V tiles the kernel visits for Q tile i: Tc = ceil(Nk / bc) without a mask, fewer with causal or a
    window (causal: up to the last key Q_i's last row sees)."""
    return len(visited_range(i, Nq, Nk, br, bc, causal, opts))


def visited_range(i, Nq, Nk, br, bc, causal, opts=None):
    """range(j_first, j_end): the K/V tiles holding a key some row of Q_i sees. Causal or a window's right side:
    up to the last key the last row sees; a window's left side: from the first key the first row sees. The tiles
    outside are never loaded: time grows with the window, not with Nk."""
    left, right = _window(opts, causal)
    Tc = -(-Nk // bc)
    shift = Nk - Nq  # bottom-right alignment: query row r's diagonal is key r + shift
    last_key = Nk - 1 if right < 0 else min(Nk - 1, min((i + 1) * br, Nq) - 1 + shift + right)
    first_key = 0 if left < 0 else max(0, i * br + shift - left)
    if last_key < 0 or first_key > last_key:
        return range(0)
    return range(first_key // bc, min(Tc, last_key // bc + 1))


def needs_mask(i, j, Nq, Nk, br, bc, causal, opts=None):
    """True for the tiles the kernel masks: some key right of Q_i's first row's diagonal (+ right), some key left of
    its last row's window, or keys >= Nk."""
    left, right = _window(opts, causal)
    shift = Nk - Nq
    last_row = min((i + 1) * br, Nq) - 1
    return ((right >= 0 and (j + 1) * bc - 1 > i * br + shift + right) or
            (left >= 0 and j * bc < last_row + shift - left) or (j + 1) * bc > Nk)


def forward(q, k, v, *, causal, scale, br, bc, trace=None, tf32x3=False, out_dtype=None, opts=None):
    """Algorithm 1 of FlashAttention-2 on numpy arrays (B, H, N, D). Returns o (q's dtype, or out_dtype) and
    lse (float32).

    br, bc: the kernel's tiles. trace: a list to append (i, j, masked) to, for every tile visited.
    tf32x3: float32 inputs only; both matmuls by the 3xTF32 split (version "fp32x3").
    out_dtype: float32 keeps O_i unrounded (as the kernels' float output does).
    opts: variants.Options (window, softcap, ALiBi, dropout, grouped-query k and v), or None for plain attention.
    With a score option the kernel computes x = S_ij = scale Q_i K_j^T, then cap tanh(x / cap), then
    x - slope |r + shift - c| (query row r, key c; shift: variants.alibi_shift, Nk - Nq unless the call is a block at
    an origin), and takes exp2 of x log2(e) - m_i; without one, exp2 of Q_i K_j^T (scale log2(e)) - m_i (one
    multiply).
    """
    mm, mm_pv = (matmul_3xtf32, matmul_pv_tf32) if tf32x3 else (np.matmul, np.matmul)
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    f32 = np.float32
    low = q.dtype != np.float32  # float16 / bfloat16: emulate the tensor core's rounding
    if opts is not None and opts.group > 1:  # grouped-query: query head h reads kv head h // group
        k, v = (np.repeat(x, opts.group, axis=1) for x in (k, v))
    qf, kf, vf = (x.astype(f32) for x in (q, k, v))  # exact: every 16-bit value is a float32
    exp2_scale = f32(scale * LOG2E)  # FwdParams.exp2_scale: what a score is multiplied by before exp2
    transform = opts is not None and (opts.softcap or opts.alibi_slopes is not None)
    slopes = None if opts is None else variants.slopes_bh(opts, B, H)  # (B, H) float32 or None
    ashift = variants.alibi_shift(opts, Nq, Nk)  # ALiBi's diagonal: Nk - Nq, or that of the block's origin
    keep = None
    if opts is not None and opts.dropout_p:
        keep = variants.dropout_keep(B, H, Nq, Nk, opts.dropout_p, opts.seed,  # Z, drawn per tile
                                     variants.dropout_origin(opts)).astype(f32)
    if transform:
        exp2_scale = f32(LOG2E)  # S is scaled (and capped, biased) in natural units before the base-2 softmax
    out_dtype = np.dtype(out_dtype or q.dtype)
    o = empty(np, (B, H, Nq, D), out_dtype)  # (B, H, Nq, D): every row is written below
    lse = empty(np, (B, H, Nq), f32)  # (B, H, Nq)
    Tr = -(-Nq // br)
    window = opts if opts is not None else variants.Options(causal=causal, right=0 if causal else -1)
    for i in range(Tr):  # one thread block per Q tile (all of them at once on the GPU)
        rows = slice(i * br, min((i + 1) * br, Nq))
        Qi = qf[:, :, rows]  # Alg.1 L4: (B, H, br, D)
        acc = np.zeros(Qi.shape, f32)  # Alg.1 L5: O_i (unnormalised), l_i, m_i "on chip"
        l_i = np.zeros(Qi.shape[:3], f32)  # (B, H, br)
        m_i = np.full(Qi.shape[:3], -np.inf, f32)
        for j in visited_range(i, Nq, Nk, br, bc, causal, opts):  # Alg.1 L6 (causal, window: a band of tiles)
            cols = slice(j * bc, min((j + 1) * bc, Nk))
            Kj_T = np.ascontiguousarray(kf[:, :, cols].swapaxes(-1, -2))  # Alg.1 L7: (B, H, D, bc), as in smem
            Vj = vf[:, :, cols]  # (B, H, bc, D)
            S = mm(Qi, Kj_T)  # Alg.1 L8, unscaled Q_i K_j^T: (B, H, br, bc)
            if transform:
                S = S * f32(scale)
                if opts.softcap:
                    S = f32(opts.softcap) * np.tanh(S * f32(1 / opts.softcap))
                if slopes is not None:
                    S = S + variants.alibi_bias(slopes, Nq, Nk, np, np.arange(rows.start, rows.stop),
                                                np.arange(cols.start, cols.stop), ashift)
            S = S * exp2_scale  # base 2
            masked = needs_mask(i, j, Nq, Nk, br, bc, causal, opts)
            if trace is not None:
                trace.append((i, j, masked))
            if masked:
                visible = variants.visible(Nq, Nk, window, np, np.arange(rows.start, rows.stop),
                                           np.arange(cols.start, cols.stop))
                S = np.where(visible, S, f32(-np.inf))
            m_new = np.maximum(m_i, S.max(-1))  # Alg.1 L9: (B, H, br)
            m_use = np.where(np.isneginf(m_new), f32(0), m_new)  # nothing visible yet: P~ = 0, alpha = 0
            alpha = np.exp2(m_i - m_use)  # 2^(m_i - m_new), m_i in base 2
            P = np.exp2(S - m_use[..., None])  # P~_ij (B, H, br, bc), float32
            l_i = alpha * l_i + P.sum(-1)
            if keep is not None:
                P = P * keep[:, :, rows, cols]  # dropout: the dropped P~_ij are 0 in P~ V, not in l_i
            if low:
                P = cast(cast(P, q.dtype), f32)  # the tensor core's A operand is 16-bit
            acc = alpha[..., None] * acc + mm_pv(P, Vj)  # Alg.1 L10: (B, H, br, D), float32 accumulate
            m_i = m_new
        seen = l_i != 0  # (B, H, br); False for a row with no visible key: O_i = 0, L_i = -inf (NaN stays NaN)
        if keep is not None:
            acc = acc * f32(1 / (1 - opts.dropout_p))  # the 1 / (1 - p) of the kept probabilities, once
        o[:, :, rows] = cast(acc / np.where(seen, l_i, f32(1))[..., None], out_dtype)  # Alg.1 L12
        with np.errstate(divide="ignore"):
            lse[:, :, rows] = np.where(seen, m_i * f32(LN2) + np.log(l_i), f32(-np.inf))  # Alg.1 L13
    return o, lse
