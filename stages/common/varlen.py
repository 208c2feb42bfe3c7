"""Variable-length packed batches: sequences of different lengths stored back to back, none attending across.

    q (total_q, H, D), k and v (total_k, Hkv, D); sequence s is rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and
    cu_seqlens_k[s]:cu_seqlens_k[s + 1] of k, v; o is packed like q, lse is (H, total_q).

Each sequence is its own attention problem: causal masks and windows are aligned bottom-right per sequence, and
dropout draws as batch entry 0 of a call of its own. `per_sequence_forward` / `per_sequence_backward` compute
exactly that definition, one call per sequence (stage 00, and the tile mirrors); a kernel instead launches once
for the whole batch and finds its sequence from cu_seqlens (stages 02 and 03 on the GPU).
"""
import numpy as np

from .checks import check_attention_inputs, check_backward_inputs

INT32_MAX = 2**31 - 1


def check_cu_seqlens(cu_q, cu_k, total_q, total_k, where="varlen", max_seqlen_q=None, max_seqlen_k=None):
    """The sequence boundaries of a packed batch, as host integer arrays: sequence s is rows cu[s]:cu[s + 1]."""
    out = []
    for name, cu, total, mx in (("cu_seqlens_q", cu_q, total_q, max_seqlen_q),
                                ("cu_seqlens_k", cu_k, total_k, max_seqlen_k)):
        a = np.asarray(cu.get() if hasattr(cu, "get") else cu)
        if a.ndim != 1 or a.size < 2 or not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{where}: {name} must be a 1-D array of integers (batch + 1 entries), got "
                            f"{a.dtype} of shape {a.shape}")
        if a[0] != 0:
            raise ValueError(f"{where}: {name} must start at 0, got {a[0]}")
        if (np.diff(a) < 0).any():
            raise ValueError(f"{where}: {name} must be non-decreasing, got {a.tolist()}")
        if a[-1] != total:
            raise ValueError(f"{where}: {name} ends at {a[-1]} but the packed input has {total} rows")
        if mx is not None and np.diff(a).max() > mx:
            raise ValueError(f"{where}: a sequence of {np.diff(a).max()} rows is longer than max_seqlen {mx}")
        out.append(a.astype(np.int64))
    if out[0].size != out[1].size:
        raise ValueError(f"{where}: cu_seqlens_q and cu_seqlens_k must have the same number of entries (one "
                         f"sequence each), got {out[0].size} and {out[1].size}")
    return out


def kernel_bounds(q, k, cu_seqlens_q, cu_seqlens_k, where, max_seqlen_q=None, max_seqlen_k=None):
    """check_cu_seqlens for a kernel launch over the whole packed batch: (cq, ck) on the host and (cu_q, cu_k) as
    int32 arrays on q's device, or a clear error when rows x heads overflow the kernels' 32-bit row index."""
    import cupy

    cq, ck = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], where, max_seqlen_q,
                              max_seqlen_k)
    rows = max(q.shape[0], k.shape[0]) * q.shape[1]
    if rows > INT32_MAX:
        raise ValueError(f"{where}: total rows x heads = {rows} overflows the kernels' 32-bit row index; split the "
                         "batch")
    return cq, ck, tuple(cupy.asarray(c, dtype=cupy.int32) for c in (cq, ck))


def check_packed(x, where, name):
    if x.ndim != 3:
        raise ValueError(f"{where}: {name} has shape {tuple(x.shape)}; expected packed (total_tokens, heads, "
                         "head_dim)")
    return x


def as_batch(x):
    """A packed (total, H, D) array seen as one batch entry (1, H, total, D) (a view)."""
    return x.swapaxes(0, 1)[None]


def per_sequence_forward(forward, q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
                         where="forward_varlen", **opts):
    """o (total_q, H, D), lse (H, total_q): forward(q_s, k_s, v_s, **opts) on each sequence s as a batch of one."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_packed(x, where, name)
    cq, ck = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], where, max_seqlen_q,
                              max_seqlen_k)
    xp = check_attention_inputs(as_batch(q), as_batch(k), as_batch(v), where=where, gqa=True)[0]
    out_dtype = opts.get("out_dtype") or q.dtype
    o = xp.zeros(q.shape, out_dtype)
    lse = xp.full((q.shape[1], q.shape[0]), -xp.inf, np.float64 if q.dtype == np.float64 else np.float32)
    for s in range(cq.size - 1):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if b == a or d == c:
            continue  # an empty query range, or no keys: o = 0, lse = -inf
        o_s, lse_s = forward(as_batch(q[a:b]), as_batch(k[c:d]), as_batch(v[c:d]), **opts)
        o[a:b], lse[:, a:b] = o_s[0].swapaxes(0, 1), lse_s[0]
    return o, lse


def per_sequence_backward(backward, q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                          max_seqlen_k=None, where="backward_varlen", **opts):
    """dq (total_q, H, D), dk and dv (total_k, Hkv, D): backward on each sequence as a batch of one."""
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("do", do)):
        check_packed(x, where, name)
    cq, ck = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], where, max_seqlen_q,
                              max_seqlen_k)
    xp = check_backward_inputs(as_batch(q), as_batch(k), as_batch(v), as_batch(o), lse[None], as_batch(do),
                               where=where, gqa=True)[0]
    out_dtype = opts.get("out_dtype") or q.dtype
    dq, dk, dv = (xp.zeros(x.shape, out_dtype) for x in (q, k, v))
    for s in range(cq.size - 1):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if b == a or d == c:
            continue
        g = backward(as_batch(q[a:b]), as_batch(k[c:d]), as_batch(v[c:d]), as_batch(o[a:b]), lse[None, :, a:b],
                     as_batch(do[a:b]), **opts)
        dq[a:b], dk[c:d], dv[c:d] = (x[0].swapaxes(0, 1) for x in g)
    return dq, dk, dv
