"""The a-priori roundings of the tolerance rule (stages/common/tolerance.py): how far a kernel's sums of D products
may land, whatever its summation order, and what that moves in o, lse, dq, dk and dv, to first order.

Three sums of D products are amplified or nearly cancel: S_ij = scale sum_d Q_id K_jd (through exp), and dP_ij =
dO_i . V_j and D_i = dO_i . O_i (dS_ij = P_ij (dP_ij - D_i), and dP_ij - D_i is ~0 where row i is one-hot). How far
a kernel's sum of n terms t_d may land from the exact T = sum_d t_d is what the rule must know, for a summation
order it has not seen.

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
    sum_rounding(t) = lambda u sqrt(W),     W = (n + 1) (sum_d t_d^2 + 2 T^2) / 6 + sum_d t_d^2,     lambda = 3,
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

Through the softmax. With delta_ij = sum_rounding(scale Q_i o K_j) (0 for a hidden key; + u |bias| with ALiBi):
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

The functions take stage 00's scores(q, k, scale, opts, xp) (the float64 S with every variant option) as an argument:
stages.common imports no stage (tolerance.forward_s_terms / backward_s_terms hand in the registered one).
"""
from typing import NamedTuple

import numpy as np

from . import variants
from .inputs import to_numpy
from .memo import last_call

LAMBDA = 3.0  # lambda of sum_rounding(): how many u sqrt(W) a sum of D products may be off by (see the docstring)


def host_options(opts):
    """The options with ALiBi slopes as a float64 host array (they may come as CuPy or float32)."""
    if opts.get("alibi_slopes") is not None:
        opts = dict(opts, alibi_slopes=to_numpy(opts["alibi_slopes"]).astype(np.float64))
    return opts


def _unit(dtype):
    """The unit roundoff u of the precision a kernel computes in for inputs of this dtype: float32 (u = 2^-24) for
    float32 and 16-bit inputs, float64 for float64."""
    return 2.0 ** -53 if np.dtype(dtype) == np.float64 else 2.0 ** -24


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


def sum_rounding(w, dtype):
    """lambda u sqrt(w), in place: how far a kernel's sum may land from the exact one, w its spread() (or the sum of
    the spreads of sums whose roundings add)."""
    return np.multiply(np.sqrt(w, out=w), LAMBDA * _unit(dtype), out=w)


@last_call
def _s_rounding(q, k, scores, causal, scale, opts=None):
    """(P, delta, scale, zk, lse): P in float64 (B, H, Nq, Nk); delta_ij = sum_rounding(scale Q_i o K_j) (+ u |ALiBi
    bias|), the rounding a kernel may make in S_ij (0 for a hidden key); zk = Z / (1 - p) of dropout (B, H, Nq,
    Nk), or 1.0 without; lse in float64 (B, H, Nq). Grouped-query attention: S with k expanded to q's heads. scores:
    stage 00's (the float64 S_ij with every variant option)."""
    q, k = (to_numpy(x) for x in (q, k))
    D = q.shape[-1]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    vopts = variants.check(q, k, causal=causal, where="tolerance", **host_options(opts or {}))
    k = np.repeat(k, vopts.group, axis=1) if vopts.group > 1 else k
    vopts = vopts._replace(group=1)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    # The arrays below are (B, H, Nq, Nk), each reused in place where its value before is not needed again.
    total = scale * q64 @ k64.swapaxes(-1, -2)  # S_ij before softcap and bias: the sum the kernel rounds
    squares = scale * scale * (q64 * q64) @ (k64 * k64).swapaxes(-1, -2)  # sum_d t_d^2 of each S_ij
    delta = sum_rounding(spread(squares, total, D, out=total), q.dtype)
    del squares
    if vopts.alibi_slopes is not None:  # the bias adds one more rounding, of at most u |S + bias|
        B, H, Nq, Nk = delta.shape
        delta += _unit(q.dtype) * np.abs(variants.alibi_bias(variants.slopes_bh(vopts, B, H, np, np.float64), Nq, Nk))
    s64 = scores(q64, k64, scale, vopts, np)  # (B, H, Nq, Nk)
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


def forward_s_terms(q, k, v, scores, *, causal=False, scale=None, **opts):
    """(Terms of o, Terms of lse): see the module docstring."""
    p, delta, _, zk, lse = _s_rounding(q, k, scores, causal, scale, opts)
    v64 = _expand(to_numpy(v).astype(np.float64), q.shape[1] // k.shape[1])
    dropout = not np.isscalar(zk)  # else zk = 1
    o = (p * zk if dropout else p) @ v64  # (B, H, Nq, D); dropout: Z / (1 - p) multiplies V
    pd = p * delta  # (B, H, Nq, Nk): first-order |d P_ij| before normalisation
    if not dropout:
        # d O_id = sum_j P_ij delta_ij (V_jd - O_id) <= sqrt(sum_j P_ij delta_ij^2) sqrt(sum_j P_ij (V_jd - O_id)^2)
        v_dev = np.sqrt(np.maximum(p @ (v64 * v64) - o * o, 0.0))  # sqrt(sum_j P_ij (V_jd - O_id)^2)
        o_first = np.sqrt((pd * delta).sum(axis=-1, keepdims=True)) * v_dev
    else:  # dropout: d O_id = sum_j P_ij delta_ij (Z_ij V_jd / (1 - p) - O_id)
        o_first = (pd * zk) @ np.abs(v64) + np.abs(o) * pd.sum(axis=-1, keepdims=True)
    pp = p + pd  # P_ij + |d P_ij|
    o_mag = (pp * zk if dropout else pp) @ np.abs(v64)
    finite = np.isfinite(lse)
    lse_mag = np.where(finite, np.abs(np.where(finite, lse, 0.0)) + 1.0, 0.0)  # m_i + log l_i: |L_i|, and 1 for log
    return Terms(o_first, o_mag), Terms(pd.sum(axis=-1), lse_mag)


def backward_s_terms(q, k, v, o, do, scores, *, causal=False, scale=None, **opts):
    """(Terms of dq, dk, dv): see the module docstring. o: the forward output the backward starts from (D_i =
    rowsum(dO_i * O_i) is computed from it). Grouped-query attention: the terms of dK, dV sum over each group's
    query heads, as the gradients do."""
    p, delta, scale, zk, _ = _s_rounding(q, k, scores, causal, scale, opts)
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
    eps2 = sum_rounding(eps2, dtype)  # in place
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
