"""The tolerance rule: one rule, in one place, for the tests, every run.py, the benchmarks and the ring.

Each output is checked row by row: o, lse and dq per query row (b, h, i), dk and dv per key row (b, h, j).

    err_row(x) = max over the row of |x - x_oracle|        x_oracle: stage 00 in float64
    x passes   iff  for every row:  err_row(x) <= FACTOR * max(Y_row, A_row) + SLACK      (FACTOR = 2, SLACK = 1e-5)

    Y_row  the yardstick's own error in the row, in two summation orders of the head dim (natural and reversed: the
           columns of q and k permuted alike, the same Q K^T, other roundings);
    A_row  the largest, over the row's entries, of  first_order + u_out |x_oracle| + G * magnitude  (below).

NaN never passes, and an entry that is -inf in the oracle (the lse of a row that sees no key) must be -inf. A row
that is ill-conditioned (two nearly tied scores at large logits) widens only its own bound. For the backward the
oracle is stage 00 in float64 from the o and lse the backward is given (verify.backward_start rounds the exact ones
to the inputs' dtype and to float32): their rounding is the start's, not the backward's.

The reference. Stage 00 (naive attention) is both the oracle (in float64) and the yardstick (in the inputs' dtype).
stages.common imports no stage: stage 00 hands its forward, backward and scores to register_reference() when it is
imported, and the rule reads them from there (reference() says what to import when nothing is registered).

The yardstick is naive attention (stage 00) computed the way the kernels compute:
  float32 inputs:        everything in float32;
  float16 / bfloat16:    matmuls accumulated in float32, S and dP kept in float32, and only P, dS and the
                         outputs rounded to 16 bits (what a tensor-core kernel feeds to its 16-bit matmuls and
                         returns). Rounding S to 16 bits instead would make the yardstick's own error as large
                         as the output at large logits, and the rule would then pass o = 0.

Why Y alone is not enough. FlashAttention's own tests bound a kernel's error by twice the error of a reference
computed in the same precision. Taken row by row, one yardstick's error is a sample: in a row where its roundings
happen to cancel it is near zero, while a correct kernel's are not. Two kinds of a-priori knowledge make the bound
of every row hold on its own:

  first_order: the roundings the softmax amplifies, to first order. Three sums of D products nearly cancel or are
    amplified: S_ij = scale sum_d Q_id K_jd (through exp), and dP_ij = dO_i . V_j and D_i = dO_i . O_i (dS_ij =
    P_ij (dP_ij - D_i), and dP_ij - D_i is ~0 where row i is one-hot). How far a kernel's sum of n terms t_d may
    land from the exact T = sum_d t_d is what the rule must know, for a summation order it has not seen.

    One sum. Summed in float32 in some order (a loop over d with FMA, an mma's chunks, a BLAS's lanes), the
    error is  e = sum_k delta_k s_k  (+ sum_d delta'_d t_d where a product is rounded on its own), s_k the k-th
    partial sum of the kernel's order, |delta| <= u = 2^-24. In the model of Higham & Mary ("A new approach to
    probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019: the delta independent, of mean zero) e is a
    martingale, and by Azuma-Hoeffding
        P( |e| > lambda u sqrt(sum_k s_k^2 + sum_d t_d^2) ) <= 2 exp(-lambda^2 / 2).
    The order is the kernel's, not the rule's. The inputs are drawn at random, their head-dim columns alike, so the
    partial sums of any fixed order are those of a uniformly random order, whose mean is exact: with sigma^2 =
    sum t^2 / n - (T / n)^2 (drawing k of the n terms without replacement),
        E s_k^2 = (k T / n)^2 + k (n - k) / (n - 1) sigma^2,      sum_k E s_k^2 = (n + 1) (sum_d t_d^2 + 2 T^2) / 6.
    So the rule takes, for a sum of n terms,
        rounding(t) = lambda u sqrt(W),     W = (n + 1) (sum_d t_d^2 + 2 T^2) / 6 + sum_d t_d^2,     lambda = 3,
    with sum_d t_d^2 one matmul of squares: scale^2 (Q o Q) (K o K)^T for S. It is tighter than Higham & Mary's
    bound sqrt(n) u sum_d |t_d| (which takes every partial sum as large as sum |t|), most where the terms' signs are
    random: there a partial sum of k terms is ~sqrt(k) terms, not k, as in dP_ij - D_i. With FACTOR 2 the rule
    grants 2 lambda u sqrt(W): a round-to-nearest delta spreads over [-u, u] (variance <= u^2 / 3), so that is
    ~10 standard deviations of e for an order whose sum s_k^2 is its mean, and room for the orders whose sum is a
    few times it (dev/catch_rates.py measures how much of it a plain loop's sum takes, the largest over millions of
    sums: results/catch_rates.csv, kind "rounding"). Tensor cores accumulate an mma (k = 16) with one rounding of
    up to 2u toward zero (Fasi, Higham, Mikaitis & Pranesh, "Numerical behavior of NVIDIA tensor cores", 2021):
    D/16 roundings of at most 2u |s_16m|, in sum at most 2u sqrt(D / 16) sqrt(sum_m s_16m^2); every 16th partial
    sum carries on average 1/16 of sum_k s_k^2, so that is 2u sqrt(D) sqrt(W) / 16, within 2 lambda u sqrt(W) up
    to D = 2304.

    Through the softmax. With delta_ij = rounding(scale Q_i o K_j) (0 for a hidden key; + u |bias| with ALiBi):
        d L_i  = sum_j P_ij delta_ij
        d O_id = sum_j P_ij delta_ij (V_jd - O_id)   <= sqrt(sum_j P_ij delta_ij^2) sqrt(sum_j P_ij (V_jd - O_id)^2)
    (a row whose P is one-hot cannot move O at all: V_j - O = 0). The backward recomputes S and applies the given
    L, so P_ij becomes P_ij (1 + delta_ij); and dP_ij - D_i is off by eps2_ij = lambda u sqrt(W(dO_i o V_j) +
    W(dO_i o O_i)): a kernel rounds the two sums on their own, in orders of their own, so their errors are
    independent, or equal and cancelling where one order sums the same products (a one-hot row, O_i = V_j); never
    opposed: the variances add. So
        d dS_ij = P_ij delta_ij |dP_ij - D_i| + P_ij eps2_ij,        d dV_jd = sum_i P_ij delta_ij |dO_id|,
        d dQ_id = scale sum_j d dS_ij |K_jd|,                         d dK_jd = scale sum_i d dS_ij |Q_id|.
    At inputs x100 (|S| ~ 1e4) delta is ~1e-2: this term is what a correct kernel's lse, and the P of a near-tie
    row, may be off by; at inputs x1 it is far below the rest.
  u_out |x_oracle|: the output's own rounding, half an ulp of its dtype (u_out = 2^-11 float16, 2^-8 bfloat16,
    2^-24 float32): a kernel's value off the oracle's by e rounds to within e + u_out |x| of it, to the far side of
    the oracle's value where e crosses a midpoint, which the yardstick's roundings need not show in the row (a row
    with a handful of large entries, whose roundings happen to be small, would otherwise bound a 16-bit output below
    half an ulp).
  G * magnitude: everything else (the accumulation of P V, dS K, dS^T Q, P^T dO; exp, log, the normalisation; the
    16-bit roundings of P, dS and the outputs) rounds relative to the magnitude of what is summed:
        o: sum_j (P_ij + d P_ij) |V_jd|,   lse: |L_i| + 1 (L_i = m_i + log l_i rounds relative to |L_i|, and a
        relative error of l_i is an absolute one of log l_i),   dq: scale sum_j (|dS_ij| + d dS_ij) |K_jd|,
        dk: scale sum_i (|dS_ij| + d dS_ij) |Q_id|,   dv: sum_i (P_ij + d P_ij) |dO_id|.
    G is how large the yardstick's own such error is per unit of magnitude, at its worst over every entry of the
    output and both orders: G = max (|y - y_oracle| - first_order - u_out |x_oracle| - SLACK)+ / magnitude. It
    carries the yardstick's worst row to every row, scaled by that row's own magnitude.

FACTOR 2 is the room FlashAttention's rule gives a kernel over the yardstick (other orders, the online softmax's
rescaling, tiles), on all of it. Nothing else widens the bound: no factor per dtype, no count chosen by failure rates;
everything is a function of the inputs.

What the rule catches, and what no rule that passes correct kernels could, is measured: dev/catch_rates.py feeds the
real checks correct stages and wrong ones at inputs x1, x10 and x100 (results/catch_rates.csv; the tables in
README.md and docs/DESIGN.md are generated from it), and tests/test_checks_catch_mistakes.py holds the checks to it.
dev/check_margins.py measures the correct GPU kernels' largest error / bound.
"""
import functools
import hashlib
from typing import Callable, NamedTuple

import numpy as np

from .inputs import to_numpy

SLACK = 1e-5
FACTOR = 2.0
LAMBDA = 3.0  # lambda of rounding(): how many u sqrt(W) a sum of D products may be off by (see the docstring)
NAMES_FORWARD = ("o", "lse")
NAMES_BACKWARD = ("dq", "dk", "dv")


def errors(x, ref):
    """|x - ref| entry by entry in float64: 0 where both are the same infinity (the -inf lse of a row that sees no
    key), infinite where x is NaN or only one side is infinite."""
    x = to_numpy(x).astype(np.float64)
    ref = to_numpy(ref).astype(np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"shape {x.shape} does not match the reference's {ref.shape}")
    same_inf = np.isinf(ref) & (x == ref)
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    return np.where(np.isnan(diff), np.inf, diff)  # NaN in x, or inf - inf where only one side is infinite


def rows(x):
    """The largest entry of each row: over the last axis of a (B, H, N, D) array (a query row of o or dq, a key row
    of dk or dv); an array of another rank (lse, (B, H, N)) is its own rows."""
    x = np.asarray(x)
    if x.ndim == 4:
        return x.max(axis=-1, initial=0.0)
    return x


def row_errors(x, ref):
    """max |x - ref| of each row (rows())."""
    return rows(errors(x, ref))


def max_error(x, ref):
    """max |x - ref| in float64; infinite where x is NaN or an infinity disagrees with ref."""
    e = errors(x, ref)
    return float(e.max()) if e.size else 0.0


def worst_row(x, ref, bound):
    """(error, bound, row index) of the row with the largest error / bound (bound: per row, or one number for all
    rows); a row with bound 0 counts as 0 / 0 = 0 when its error is 0, else as infinite."""
    err = row_errors(x, ref)
    b = np.broadcast_to(np.asarray(bound, dtype=np.float64), err.shape)
    if err.size == 0:
        return 0.0, float(np.max(b, initial=0.0)), ()
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / b)
    i = np.unravel_index(int(np.argmax(ratio)), err.shape)
    return float(err[i]), float(b[i]), tuple(int(x) for x in i)


def _contents(x):
    """A key for x by value: an array (numpy or CuPy) by its shape, dtype and a hash of its bytes; a dict, tuple or
    list by its items; anything else as it is."""
    if isinstance(x, dict):
        return tuple(sorted((name, _contents(v)) for name, v in x.items()))
    if isinstance(x, (tuple, list)):
        return tuple(_contents(v) for v in x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        a = np.ascontiguousarray(to_numpy(x))
        return a.shape, str(a.dtype), hashlib.blake2b(a.tobytes(), digest_size=16).digest()
    return type(x).__name__, x


def last_call(f):
    """f remembering its last call, keyed on its arguments' values (_contents): a check of the forward and one of
    the backward on the same inputs (verify.check_forward, then check_backward; verify.rule) share the oracle's
    forward and S's roundings instead of computing them twice, and checks of several answers on the same inputs
    share the whole rule (verify.forward_rule, backward_rule). The arrays it returns are read-only, since every
    caller of those arguments gets the same ones."""
    last = {}

    @functools.wraps(f)
    def remembered(*args, **kw):
        key = _contents((args, kw))
        if last.get("key") != key:
            out = f(*args, **kw)
            for x in out:
                if isinstance(x, np.ndarray):
                    x.flags.writeable = False
            last.update(key=key, out=out)
        return last["out"]
    return remembered


class Reference(NamedTuple):
    """What the rule compares with and measures by: stage 00's forward(q, k, v, *, causal, scale, **opts) -> (o, lse),
    backward(q, k, v, o, lse, do, *, causal, scale, **opts) -> (dq, dk, dv) and scores(q, k, scale, opts, xp) -> S,
    in float64 for float64 inputs (the oracle) and as the kernels compute for the others (the yardstick)."""
    forward: Callable
    backward: Callable
    scores: Callable


_REFERENCE = []  # [Reference] once stage 00 is imported


def register_reference(forward, backward, scores):
    """Stage 00 (stages/00_naive/__init__.py) hands the rule its naive attention when it is imported."""
    _REFERENCE[:] = [Reference(forward, backward, scores)]


def reference():
    """The registered Reference; an error that says what to import when there is none."""
    if not _REFERENCE:
        raise RuntimeError("the tolerance rule measures against stage 00 (naive attention), which is not imported: "
                           "`from stages import naive` first (stage 00 registers itself with "
                           "stages.common.tolerance when imported)")
    return _REFERENCE[0]


def _orders(D):
    """The two summation orders of the head dim the yardstick is evaluated in: natural and reversed."""
    return [np.arange(D), np.arange(D)[::-1]]


@last_call
def oracle(q, k, v, do=None, *, causal=False, scale=None, **opts):
    """Stage 00 in float64 on the host: (o, lse) or, with do, (o, lse, dq, dk, dv). opts: the variant options
    (window, softcap, alibi_slopes, dropout_p, seed; stages/common/variants.py), passed to stage 00."""
    naive = reference()
    q64, k64, v64 = (to_numpy(x).astype(np.float64) for x in (q, k, v))
    opts = _host(opts)
    o, lse = naive.forward(q64, k64, v64, causal=causal, scale=scale, **opts)
    if do is None:
        return o, lse
    return (o, lse) + naive.backward(q64, k64, v64, o, lse, to_numpy(do).astype(np.float64), causal=causal,
                                     scale=scale, **opts)


def backward_oracle(q, k, v, o, lse, do, *, causal=False, scale=None, **opts):
    """(dq, dk, dv): stage 00's backward in float64 on the host from the o and lse given (the exact gradients a
    backward started from them must compute; their own rounding is no error of that backward)."""
    naive = reference()
    q64, k64, v64, o64, do64 = (to_numpy(x).astype(np.float64) for x in (q, k, v, o, do))
    return naive.backward(q64, k64, v64, o64, to_numpy(lse).astype(np.float64), do64, causal=causal, scale=scale,
                          **_host(opts))


def _host(opts):
    """The options with ALiBi slopes as a float64 host array (they may come as CuPy or float32)."""
    if opts.get("alibi_slopes") is not None:
        opts = dict(opts, alibi_slopes=to_numpy(opts["alibi_slopes"]).astype(np.float64))
    return opts


def forward_yardsticks(q, k, v, *, causal=False, scale=None, yardstick=None, **opts):
    """[(o, lse), ...]: stage 00 in the inputs' dtype (host arrays), one per summation order. yardstick: another
    forward(q, k, v, causal=, scale=, **opts) on host arrays in stage 00's place, for a version whose roundings are
    not the inputs' dtype (stage 06's fp8: fp8.yardstick)."""
    forward = yardstick or reference().forward
    q, k, v = (to_numpy(x) for x in (q, k, v))
    opts = _host(opts)
    out = []
    for perm in _orders(q.shape[-1]):
        out.append(forward(q[..., perm], k[..., perm], v, causal=causal, scale=scale, **opts))  # same Q K^T
    return out


def backward_yardsticks(q, k, v, o, lse, do, *, causal=False, scale=None, **opts):
    """[(dq, dk, dv), ...]: stage 00's backward in the inputs' dtype from the given o, lse (host arrays), one per
    summation order of S; dq, dk come back in the natural column order."""
    naive = reference()
    q, k, v, o, lse, do = (to_numpy(x) for x in (q, k, v, o, lse, do))
    opts = _host(opts)
    out = []
    for perm in _orders(q.shape[-1]):
        inv = np.argsort(perm)
        dq, dk, dv = naive.backward(q[..., perm], k[..., perm], v, o, lse, do, causal=causal, scale=scale, **opts)
        out.append((dq[..., inv], dk[..., inv], dv))
    return out


def _unit(dtype):
    """The unit roundoff u of the precision a kernel computes in for inputs of this dtype: float32 (u = 2^-24) for
    float32 and 16-bit inputs, float64 for float64."""
    return 2.0 ** -53 if np.dtype(dtype) == np.float64 else 2.0 ** -24


OUTPUT_UNITS = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def _output_unit(dtype):
    """The unit roundoff of an output stored in this dtype: |fl(x) - x| <= u |x| (OUTPUT_UNITS)."""
    name = np.dtype(dtype).name
    if name not in OUTPUT_UNITS:
        raise ValueError(f"the tolerance rule knows the rounding of outputs in {', '.join(OUTPUT_UNITS)}, not {name}")
    return OUTPUT_UNITS[name]


def spread(squares, total, n, out=None):
    """W = (n + 1) (squares + 2 total^2) / 6 + squares: the mean, over summation orders, of the sum of squared
    partial sums of n terms t_d (squares = sum_d t_d^2, total = sum_d t_d), and the products' own roundings (see the
    module docstring). Arrays of sums at once; out: where to write it (total itself, when it is not needed after;
    never squares, which is read after total is squared)."""
    w = np.multiply(total, total, out=out)  # T^2
    w *= 2.0
    w += squares
    w *= (n + 1) / 6.0
    w += squares  # products rounded on their own (no FMA)
    return w


def rounding(w, dtype):
    """lambda u sqrt(w), in place: how far a kernel's sum may land from the exact one, w its spread() (or the sum of
    the spreads of sums whose roundings add)."""
    return np.multiply(np.sqrt(w, out=w), LAMBDA * _unit(dtype), out=w)


@last_call
def _s_rounding(q, k, causal, scale, opts=None):
    """(P, delta, scale, zk, lse): P in float64 (B, H, Nq, Nk); delta_ij = rounding(scale Q_i o K_j) (+ u |ALiBi
    bias|), the rounding a kernel may make in S_ij (0 for a hidden key); zk = Z / (1 - p) of dropout (B, H, Nq,
    Nk), or 1.0 without; lse in float64 (B, H, Nq). Grouped-query attention: S with k expanded to q's heads."""
    from . import variants

    q, k = (to_numpy(x) for x in (q, k))
    D = q.shape[-1]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    vopts = variants.check(q, k, causal=causal, where="tolerance", **_host(opts or {}))
    k = np.repeat(k, vopts.group, axis=1) if vopts.group > 1 else k
    vopts = vopts._replace(group=1)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    # The arrays below are (B, H, Nq, Nk), each reused in place where its value before is not needed again.
    total = scale * q64 @ k64.swapaxes(-1, -2)  # S_ij before softcap and bias: the sum the kernel rounds
    delta = rounding(spread(scale * scale * (q64 * q64) @ (k64 * k64).swapaxes(-1, -2), total, D, out=total), q.dtype)
    if vopts.alibi_slopes is not None:  # the bias adds one more rounding, of at most u |S + bias|
        B, H, Nq, Nk = delta.shape
        delta += _unit(q.dtype) * np.abs(variants.alibi_bias(variants.slopes_bh(vopts, B, H, np, np.float64), Nq, Nk))
    s64 = reference().scores(q64, k64, scale, vopts, np)  # (B, H, Nq, Nk)
    np.copyto(delta, 0.0, where=np.isinf(s64))  # a hidden key adds no term
    m = s64.max(axis=-1, keepdims=True)
    m = np.where(np.isinf(m), 0.0, m)
    p = np.exp(np.subtract(s64, m, out=s64), out=s64)  # P_ij unnormalised, in S's place
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(l))[..., 0]
    zk = 1.0
    if vopts.dropout_p:
        B, H, Nq, Nk = p.shape
        zk = variants.dropout_keep(B, H, Nq, Nk, vopts.dropout_p, vopts.seed) / (1.0 - vopts.dropout_p)
    p /= np.where(l == 0, 1.0, l)
    return p, delta, scale, zk, lse


def _expand(x, group):
    return np.repeat(x, group, axis=1) if group > 1 else x


def _sum_groups(x, group):
    if group == 1:
        return x
    B, H, N, D = x.shape
    return x.reshape(B, H // group, group, N, D).sum(axis=2)


class Terms(NamedTuple):
    """What the rule knows of one output a priori, entry by entry (arrays shaped like the output, float64):
    first_order, the worst first-order effect of the roundings that the softmax amplifies (S, and dP - D in the
    backward); magnitude, the sum of magnitudes of the terms the output's last sum adds (its plain roundings are
    relative to it)."""
    first_order: np.ndarray
    magnitude: np.ndarray


def forward_s_terms(q, k, v, *, causal=False, scale=None, **opts):
    """(Terms of o, Terms of lse): see the module docstring."""
    p, delta, _, zk, lse = _s_rounding(q, k, causal, scale, opts)
    v64 = _expand(to_numpy(v).astype(np.float64), q.shape[1] // k.shape[1])
    dropout = not np.isscalar(zk)  # else zk = 1
    o = (p * zk if dropout else p) @ v64  # (B, H, Nq, D); dropout: Z / (1 - p) multiplies V
    pd = p * delta  # (B, H, Nq, Nk): first-order |d P_ij| before normalisation
    if not dropout:
        # d O_id = sum_j P_ij delta_ij (V_jd - O_id) <= sqrt(sum_j P_ij delta_ij^2) sqrt(sum_j P_ij (V_jd - O_id)^2)
        spread = np.sqrt(np.maximum(p @ (v64 * v64) - o * o, 0.0))
        o_first = np.sqrt((pd * delta).sum(axis=-1, keepdims=True)) * spread
    else:  # dropout: d O_id = sum_j P_ij delta_ij (Z_ij V_jd / (1 - p) - O_id)
        o_first = (pd * zk) @ np.abs(v64) + np.abs(o) * pd.sum(axis=-1, keepdims=True)
    pp = p + pd  # P_ij + |d P_ij|
    o_mag = (pp * zk if dropout else pp) @ np.abs(v64)
    finite = np.isfinite(lse)
    lse_mag = np.where(finite, np.abs(np.where(finite, lse, 0.0)) + 1.0, 0.0)  # m_i + log l_i: |L_i|, and 1 for log
    return Terms(o_first, o_mag), Terms(pd.sum(axis=-1), lse_mag)


def backward_s_terms(q, k, v, o, do, *, causal=False, scale=None, **opts):
    """(Terms of dq, dk, dv): see the module docstring. o: the forward output the backward starts from (D_i =
    rowsum(dO_i * O_i) is computed from it). Grouped-query attention: the terms of dK, dV sum over each group's
    query heads, as the gradients do."""
    p, delta, scale, zk, _ = _s_rounding(q, k, causal, scale, opts)
    dtype = to_numpy(q).dtype
    D = q.shape[-1]
    group = q.shape[1] // k.shape[1]
    k, v = _expand(to_numpy(k), group), _expand(to_numpy(v), group)
    q64, k64, v64, o64, do64 = (to_numpy(x).astype(np.float64) for x in (q, k, v, o, do))
    dropout = not np.isscalar(zk)  # else zk = 1
    # The arrays below are (B, H, Nq, Nk) but d_i, each updated in place where its value before is not needed again.
    dp = do64 @ v64.swapaxes(-1, -2)  # dP = dO V^T
    # dP_ij - D_i: two sums of D products, each rounded on its own (only where P_ij > 0 does it matter)
    eps2 = spread((do64 * do64) @ (v64 * v64).swapaxes(-1, -2), dp, D)  # W of dP_ij
    if dropout:  # dP = Z / (1 - p) dO V^T
        dp *= zk
        eps2 *= zk * zk
    d_i = (do64 * o64).sum(axis=-1, keepdims=True)  # (B, H, Nq, 1)
    eps2 += spread((do64 * do64 * o64 * o64).sum(axis=-1, keepdims=True), d_i, D)  # + W of D_i
    eps2 = rounding(eps2, dtype)  # in place
    pw = p * delta  # first-order |d P_ij|: P_ij (1 + delta_ij) for S rounded by delta_ij
    dp -= d_i  # dP_ij - D_i
    w = np.abs(dp)
    w *= pw
    w += np.multiply(p, eps2, out=eps2)  # first-order |d dS_ij| = P_ij delta_ij |dP_ij - D_i| + P_ij eps2_ij
    ds = np.abs(np.multiply(p, dp, out=dp), out=dp)
    ds += w  # |dS_ij| and its perturbation: the magnitudes dS K, dS^T Q sum
    w *= scale  # dQ = scale dS K, dK = scale dS^T Q
    ds *= scale
    absk, absq, absdo = np.abs(k64), np.abs(q64), np.abs(do64)
    dq = Terms(w @ absk, ds @ absk)
    dk = Terms(_sum_groups(w.swapaxes(-1, -2) @ absq, group), _sum_groups(ds.swapaxes(-1, -2) @ absq, group))
    pp = np.add(p, pw, out=w)  # P_ij + |d P_ij| (w is not needed again)
    if dropout:
        pw *= zk
        pp *= zk
    dv = Terms(_sum_groups(pw.swapaxes(-1, -2) @ absdo, group), _sum_groups(pp.swapaxes(-1, -2) @ absdo, group))
    return dq, dk, dv


def _plain_rounding(errs, terms, slack):
    """G: the yardstick's largest error beyond its first-order terms and the slack, per unit of magnitude, over
    every entry of the output and both summation orders: max (|y - ref| - first_order - slack)+ / magnitude, over
    entries with magnitude > 0. (An error within the slack, such as a float32 underflow, needs no G.)"""
    g = 0.0
    ok = terms.magnitude > 0
    for e in errs:
        excess = np.maximum(e - terms.first_order - slack, 0.0)
        if ok.any():
            g = max(g, float((excess[ok] / terms.magnitude[ok]).max()))
    return g


def bounds(refs, yardsticks, terms=None, *, factor=FACTOR, slack=SLACK):
    """[bound per row of each output]: factor * max(the yardstick's error in the row, the row's largest
    first_order + G magnitude) + slack (see the module docstring); one number per row (rows()).

    refs: the oracle's outputs; yardsticks: a list of tuples shaped like refs; terms: a tuple of Terms shaped like
    refs (forward_s_terms / backward_s_terms) or None (then the yardstick's row error alone). A yardstick with an
    infinite or NaN error would make the rule pass anything: that is refused."""
    out = []
    for n, ref in enumerate(refs):
        errs = [errors(y[n], ref) for y in yardsticks]
        if any(not np.isfinite(e).all() for e in errs):
            raise ValueError(
                "the tolerance rule's yardstick (naive attention computed as the kernel computes) has an "
                "infinite or NaN error against the oracle, so the rule would pass anything")
        bound = rows(np.max(errs, axis=0))
        if terms is not None:
            # a-priori: the first-order terms and the output's own rounding, half an ulp of its dtype (the
            # yardstick's) at the entry: a kernel's value a little off the oracle's may round to its far side
            known = terms[n].first_order + _output_unit(yardsticks[0][n].dtype) * np.abs(
                np.where(np.isfinite(ref), ref, 0.0))
            g = _plain_rounding(errs, Terms(known, terms[n].magnitude), slack)
            bound = np.maximum(bound, rows(known + g * terms[n].magnitude))
        out.append(factor * bound + slack)
    return out


def tolerance_report(out, oracle_out, yardstick, *, factor=FACTOR, slack=SLACK):
    """(ok, err, bound) of one output against one yardstick output (the rule for a single tensor, without the
    first-order terms), at the row with the largest error / bound."""
    bound = bounds([oracle_out], [(yardstick,)], factor=factor, slack=slack)[0]
    err, b, _ = worst_row(out, oracle_out, bound)
    return bool((row_errors(out, oracle_out) <= bound).all()), err, b


def assert_within(names, outs, refs, bounds_, *, what=""):
    """Assert every row's max error against ref is within its bound (bounds_: per output, an array of one bound per
    row, or one number for every row); return {name: (error, bound)} at each output's row of largest error / bound.
    The message names the tensor, the worst row, its error and its bound."""
    result = {}
    for name, x, ref, bound in zip(names, outs, refs, bounds_):
        err_rows = row_errors(x, ref)
        err, b, row = worst_row(x, ref, bound)
        bad = ~(err_rows <= np.asarray(bound))
        if bad.any():
            raise AssertionError(
                f"{what}{name}: max error {err:.3e} against the fp64 oracle exceeds the bound {b:.3e} in row {row} "
                f"({int(bad.sum())} of {bad.size} rows out of bounds; the rule: {FACTOR:g} x the yardstick's error "
                f"or the rounding terms, + {SLACK:g})")
        result[name] = (err, b)
    return result


def check(names, outs, refs, yardsticks, terms=None, *, what=""):
    """The rule for every output (bounds from the yardsticks and terms); return {name: (error, bound)} at each
    output's worst row."""
    return assert_within(names, outs, refs, bounds(refs, yardsticks, terms), what=what)
