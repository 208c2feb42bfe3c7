"""The tolerance rule: one rule, in one place, for the tests, every run.py, the benchmarks and the ring.

    error(x) = max |x - x_oracle|          x_oracle: stage 00 in float64
    x passes  iff  error(x) <= FACTOR * error(yardstick) + SLACK          (FACTOR = 2, SLACK = 1e-5)

for each of o, lse, dq, dk, dv (the rule of FlashAttention's own tests). NaN never passes, and an entry that
is -inf in the oracle (the lse of a fully masked row) must be -inf.

The yardstick is naive attention (stage 00) computed the way the kernels compute:
  float32 inputs:        everything in float32;
  float16 / bfloat16:    matmuls accumulated in float32, S and dP kept in float32, and only P, dS and the
                         outputs rounded to 16 bits (what a tensor-core kernel feeds to its 16-bit matmuls and
                         returns). Rounding S to 16 bits instead would make the yardstick's own error as large
                         as the output at large logits, and the rule would then pass o = 0.

Roundings that land on a few entries. At large logits (|S| ~ 1e4, inputs x100; a float32 ulp there is ~1e-3)
most rows of P are one-hot, and the error of a row whose two largest scores nearly tie is decided by a handful
of roundings. A single yardstick's error is then a matter of how its own few roundings fell (near zero by luck
while any other order's is not), so on its own it is not a yardstick. These roundings, each what a kernel
computes, are:
  S:       a kernel and the yardstick sum S_ij = scale sum_d Q_id K_jd in different orders: S_ij + delta_ij.
           To first order  d L_i = sum_j P_ij delta_ij,   d O_id = sum_j P_ij (V_jd - O_id) delta_ij;
           the backward recomputes S_ij in its own order and applies the forward's L_i, so P_ij becomes
           P_ij (1 + delta_ij):  d dV_jd = sum_i P_ij delta_ij dO_id,  d dS_ij = P_ij (dP_ij - D_i) delta_ij.
  dP - D:  dP_ij = dO_i . V_j and D_i = dO_i . O_i nearly cancel where row i is one-hot on key j, so their
           float32 rounding eps2_i becomes all of dS_ij:  d dS_ij = P_ij eps2_i.
  16 bits: a 16-bit kernel rounds P_ij and dS_ij before their matmuls: d P_ij = round(P_ij) - P_ij, and so
           for dS_ij.
  and through the matmuls  d dQ_id = scale sum_j d dS_ij K_jd,  d dK_jd = scale sum_i d dS_ij Q_id.
So the rule takes the yardstick's error as the larger of
  (a) its measured error, in two summation orders of the head dim, natural and reversed (the columns of q and
      k permuted alike: the same Q K^T, other roundings), and
  (b) the first-order terms above with every rounding falling the worst way: |delta_ij| <= eps_i, the largest
      S rounding the yardstick makes in row i, and at least one ulp of the row's largest sum of magnitudes
      |scale| sum_d |Q_id K_jd| (a row with few keys, or a lucky order, may round well where another order of
      the same sum does not: a matrix-vector product sums in other blocks than a matrix product);
      |eps2| <= eps2_i, its largest dP - D rounding in row i, with the same kind of floor (both doubled for
      16-bit inputs: tensor cores accumulate by truncation, see _accumulation_factor); the
      16-bit roundings of the float64 P and dS. (sum_j P_ij |V_jd - O_id| is bounded by the P-weighted spread
      sqrt(sum_j P_ij V_jd^2 - O_id^2).) At inputs x1 these terms are far below (a).
    bound = FACTOR * max(error(natural), error(reversed), first-order terms) + SLACK.
Everything is a function of the inputs: no sampling, no count chosen by failure rates.
"""
import numpy as np

from .inputs import cast, to_numpy

SLACK = 1e-5
FACTOR = 2.0
NAMES_FORWARD = ("o", "lse")
NAMES_BACKWARD = ("dq", "dk", "dv")


def max_error(x, ref):
    """max |x - ref| in float64; infinite where x is NaN or an infinity disagrees with ref."""
    x = to_numpy(x).astype(np.float64)
    ref = to_numpy(ref).astype(np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}")
    if x.size == 0:
        return 0.0
    if np.isnan(x).any():
        return float("inf")
    same_inf = np.isinf(ref) & (x == ref)  # -inf lse of a fully masked row, on both sides
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    diff = np.where(np.isnan(diff), np.inf, diff)  # inf - inf where only one side is infinite
    return float(diff.max())


def _naive():
    from stages import naive  # late import: stages.common must not depend on a stage at import time

    return naive


def _orders(D):
    """The two summation orders of the head dim the yardstick is evaluated in: natural and reversed."""
    return [np.arange(D), np.arange(D)[::-1]]


def oracle(q, k, v, do=None, *, causal=False, scale=None, **opts):
    """Stage 00 in float64 on the host: (o, lse) or, with do, (o, lse, dq, dk, dv). opts: the variant options
    (window, softcap, alibi_slopes, dropout_p, seed; stages/common/variants.py), passed to stage 00."""
    naive = _naive()
    q64, k64, v64 = (to_numpy(x).astype(np.float64) for x in (q, k, v))
    opts = _host(opts)
    o, lse = naive.forward(q64, k64, v64, causal=causal, scale=scale, **opts)
    if do is None:
        return o, lse
    return (o, lse) + naive.backward(q64, k64, v64, o, lse, to_numpy(do).astype(np.float64), causal=causal,
                                     scale=scale, **opts)


def _host(opts):
    """The options with ALiBi slopes as a float64 host array (they may come as CuPy or float32)."""
    if opts.get("alibi_slopes") is not None:
        opts = dict(opts, alibi_slopes=to_numpy(opts["alibi_slopes"]).astype(np.float64))
    return opts


def forward_yardsticks(q, k, v, *, causal=False, scale=None, **opts):
    """[(o, lse), ...]: stage 00 in the inputs' dtype (host arrays), one per summation order."""
    naive = _naive()
    q, k, v = (to_numpy(x) for x in (q, k, v))
    opts = _host(opts)
    out = []
    for perm in _orders(q.shape[-1]):
        out.append(naive.forward(q[..., perm], k[..., perm], v, causal=causal, scale=scale, **opts))  # same Q K^T
    return out


def backward_yardsticks(q, k, v, o, lse, do, *, causal=False, scale=None, **opts):
    """[(dq, dk, dv), ...]: stage 00's backward in the inputs' dtype from the given o, lse (host arrays), one per
    summation order of S; dq, dk come back in the natural column order."""
    naive = _naive()
    q, k, v, o, lse, do = (to_numpy(x) for x in (q, k, v, o, lse, do))
    opts = _host(opts)
    out = []
    for perm in _orders(q.shape[-1]):
        inv = np.argsort(perm)
        dq, dk, dv = naive.backward(q[..., perm], k[..., perm], v, o, lse, do, causal=causal, scale=scale, **opts)
        out.append((dq[..., inv], dk[..., inv], dv))
    return out


def _s_rounding(q, k, causal, scale, opts=None):
    """(P in float64 (B, H, Nq, Nk), eps (B, H, Nq, 1), scale, zk): eps_i = max_j |S_ij of the yardstick - S_ij in
    float64| over the keys row i sees (0 for a row that sees none); zk = Z / (1 - p) of dropout (B, H, Nq, Nk), or
    1.0 without. Grouped-query attention: S with k expanded to q's heads."""
    naive = _naive()
    from . import variants

    q, k = (to_numpy(x) for x in (q, k))
    D = q.shape[-1]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    vopts = variants.check(q, k, causal=causal, where="tolerance", **_host(opts or {}))
    k = np.repeat(k, vopts.group, axis=1) if vopts.group > 1 else k
    vopts = vopts._replace(group=1)
    s64 = naive.scores(q.astype(np.float64), k.astype(np.float64), scale, vopts, np)  # (B, H, Nq, Nk)
    s_low = naive.scores(q, k, scale, vopts, np).astype(np.float64)  # as the yardstick computes it
    with np.errstate(invalid="ignore"):
        eps = np.where(np.isinf(s64), 0.0, np.abs(s_low - s64)).max(axis=-1, keepdims=True)  # (B, H, Nq, 1)
    if np.dtype(q.dtype) != np.float64:
        # A row with few keys has few roundings to take the max over, and the yardstick's order may be lucky in
        # all of them where another order is not. The floor is one ulp of the row's largest sum of magnitudes
        # |scale| sum_d |Q_id K_jd| (2 u sum, u = 2^-24): every summation order ends in additions whose partial
        # sums are bounded by it (Higham, "Accuracy and Stability of Numerical Algorithms", section 3.1). A
        # softcap's tanh has slope <= 1, so the floor holds through it; an ALiBi bias adds one more rounding, of
        # at most one ulp of |S| (bounded by the same sum plus |bias|).
        mag = scale * np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)).swapaxes(-1, -2)
        if vopts.alibi_slopes is not None:
            B, H, Nq, Nk = mag.shape
            mag = mag + np.abs(variants.alibi_bias(variants.slopes_bh(vopts, B, H, np, np.float64), Nq, Nk))
        eps = np.maximum(eps, 2.0 ** -23 * _masked(mag, np.isinf(s64)).max(axis=-1, keepdims=True))
    eps = eps * _accumulation_factor(q.dtype)
    m = s64.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(s64 - m)
    l = p.sum(axis=-1, keepdims=True)
    zk = 1.0
    if vopts.dropout_p:
        B, H, Nq, Nk = p.shape
        zk = variants.dropout_keep(B, H, Nq, Nk, vopts.dropout_p, vopts.seed) / (1.0 - vopts.dropout_p)
    return p / np.where(l == 0, 1.0, l), eps, scale, zk


def _expand(x, group):
    return np.repeat(x, group, axis=1) if group > 1 else x


def _sum_groups(x, group):
    if group == 1:
        return x
    B, H, N, D = x.shape
    return x.reshape(B, H // group, group, N, D).sum(axis=2)


def _masked(x, hidden):
    """x with the entries of hidden keys set to 0."""
    return np.where(hidden, 0.0, x)


def _accumulation_factor(dtype):
    """How much larger one rounding of a float32 sum can be in a kernel than in the yardstick: 2 for 16-bit
    inputs, whose S and dP come from tensor-core mma, which accumulates in float32 by truncation (up to one ulp
    per addition; Fasi, Higham, Mikaitis & Pranesh, "Numerical behavior of NVIDIA tensor cores", 2021) where
    numpy rounds to nearest (half an ulp); 1 otherwise."""
    return 2.0 if np.dtype(dtype).itemsize == 2 else 1.0


def _rounding16(x, dtype):
    """|round(x) - x| elementwise for the 16-bit dtype a kernel rounds P and dS to; 0 for float32 / float64."""
    if np.dtype(dtype).itemsize != 2:
        return np.zeros_like(x)
    return np.abs(cast(cast(x, dtype), np.float64) - x)


def forward_s_terms(q, k, v, *, causal=False, scale=None, **opts):
    """(o, lse) of the first-order rounding terms of the forward (see the module docstring), float64 host
    arrays."""
    p, eps, _, zk = _s_rounding(q, k, causal, scale, opts)
    v64 = _expand(to_numpy(v).astype(np.float64), q.shape[1] // k.shape[1])
    pz = p * zk  # dropout: what multiplies V
    o = pz @ v64  # (B, H, Nq, D)
    spread = np.sqrt(np.maximum(pz @ (v64 * v64) - o * o, 0.0))  # >= sum_j P_ij |V_jd - O_id| (without dropout)
    if not np.isscalar(zk):  # with dropout, d O_id = sum_j P_ij (Z_ij V_jd / (1 - p) - O_id) delta_ij
        spread = pz @ np.abs(v64) + np.abs(o)
    r16 = _rounding16(p, to_numpy(q).dtype) * zk  # P~ rounded to 16 bits before P~ V
    return eps * spread + r16 @ np.abs(v64), eps[..., 0] * p.sum(axis=-1)


def backward_s_terms(q, k, v, o, do, *, causal=False, scale=None, **opts):
    """(dq, dk, dv) of the first-order rounding terms of the backward (see the module docstring), float64 host
    arrays. o: the forward output the backward starts from (D_i = rowsum(dO_i * O_i) is computed from it).
    Grouped-query attention: the terms of dK, dV sum over each group's query heads, as the gradients do."""
    p, eps, scale, zk = _s_rounding(q, k, causal, scale, opts)
    group = q.shape[1] // k.shape[1]
    k, v = _expand(to_numpy(k), group), _expand(to_numpy(v), group)
    q64, k64, v64, o64, do64 = (to_numpy(x).astype(np.float64) for x in (q, k, v, o, do))
    dp = do64 @ v64.swapaxes(-1, -2) * zk  # (B, H, Nq, Nk); dropout: dP = Z / (1 - p) dO V^T
    d_i = (do64 * o64).sum(axis=-1, keepdims=True)  # (B, H, Nq, 1)
    # the yardstick's own rounding of dP_ij - D_i (float32 for float32 and 16-bit inputs), per row: eps2_i
    cd = np.float64 if to_numpy(q).dtype == np.float64 else np.float32
    do_c, v_c, o_c = (to_numpy(x).astype(cd) for x in (do, v, o))
    low = ((do_c @ v_c.swapaxes(-1, -2)) * zk).astype(cd) - (do_c * o_c).sum(axis=-1, keepdims=True)  # (B, H, Nq, Nk)
    eps2 = np.where(p > 0, np.abs(low.astype(np.float64) - (dp - d_i)), 0.0).max(axis=-1, keepdims=True)
    if cd != np.float64:  # the same floor as for S: one ulp of the sums of magnitudes of dP_ij and of D_i
        mag = (np.abs(do64) @ np.abs(v64).swapaxes(-1, -2) * zk
               + (np.abs(do64) * np.abs(o64)).sum(axis=-1, keepdims=True))
        eps2 = np.maximum(eps2, 2.0 ** -23 * _masked(mag, p == 0).max(axis=-1, keepdims=True))
    eps2 = eps2 * _accumulation_factor(to_numpy(q).dtype)
    dtype = to_numpy(q).dtype  # 16 bits: P and dS rounded before their matmuls
    w = (p * eps + _rounding16(p, dtype)) * zk  # (B, H, Nq, Nk): first-order |d P'_ij| (P' = P Z / (1 - p))
    wds = p * eps * np.abs(dp - d_i) + p * eps2 + _rounding16(p * (dp - d_i), dtype)  # first-order |d dS_ij|
    return (scale * wds @ np.abs(k64), _sum_groups(scale * wds.swapaxes(-1, -2) @ np.abs(q64), group),
            _sum_groups(w.swapaxes(-1, -2) @ np.abs(do64), group))


def bounds(refs, yardsticks, terms=None, *, factor=FACTOR, slack=SLACK):
    """[bound per output]: factor * max(the largest yardstick error against refs, the largest entry of the
    matching first-order term) + slack.

    refs: the oracle's outputs; yardsticks: a list of tuples shaped like refs; terms: a tuple shaped like refs
    (forward_s_terms / backward_s_terms) or None. A yardstick with an infinite or NaN error would make the rule
    pass anything: that is refused."""
    out = []
    for n, ref in enumerate(refs):
        err = max(max_error(y[n], ref) for y in yardsticks)
        if terms is not None and terms[n].size:
            err = max(err, float(np.max(terms[n])))
        if not np.isfinite(err):
            raise ValueError(
                "the tolerance rule's yardstick (naive attention computed as the kernel computes) has an "
                "infinite or NaN error against the oracle, so the rule would pass anything")
        out.append(factor * err + slack)
    return out


def tolerance_report(out, oracle_out, yardstick, *, factor=FACTOR, slack=SLACK):
    """(ok, err, bound) of one output against one yardstick output (the rule for a single tensor)."""
    bound = bounds([oracle_out], [(yardstick,)], factor=factor, slack=slack)[0]
    err = max_error(out, oracle_out)
    return err <= bound, err, bound


def assert_within(names, outs, refs, bounds_, *, what=""):
    """Assert max_error(out, ref) <= bound for every output; return {name: (error, bound)}. The message names the
    tensor, its error and its bound."""
    result = {}
    for name, x, ref, bound in zip(names, outs, refs, bounds_):
        err = max_error(x, ref)
        if not err <= bound:
            raise AssertionError(f"{what}{name}: max error {err:.3e} against the fp64 oracle exceeds the bound "
                                 f"{bound:.3e} ({FACTOR:g} x the yardstick's error + {SLACK:g})")
        result[name] = (err, bound)
    return result


def check(names, outs, refs, yardsticks, terms=None, *, what=""):
    """The rule for every output (bounds from the yardsticks and terms); return {name: (error, bound)}."""
    return assert_within(names, outs, refs, bounds(refs, yardsticks, terms), what=what)
