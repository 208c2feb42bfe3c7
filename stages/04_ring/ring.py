"""Stage 04: ring attention (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889), the algorithm.

The sequence is split across P ranks. Rank r keeps its query shard Q_r for the whole call and
the key/value shards travel around the ring: at step s it holds the block K_j, V_j of rank
j = (r - s) mod P, computes that block's partial attention with a single-device kernel
(stage 02 forward, stage 03 backward), and passes the block on to rank r + 1.

Forward (per rank, P steps):
    O_r, L_r = 0, -inf
    for s in 0..P-1:                           j = (r - s) mod P
        send K_j, V_j to r+1, receive the next block from r-1   (in flight while we compute)
        O_rj, L_rj = attention(Q_r, K_j, V_j)                  the block's own softmax
        O_r, L_r = merge(O_r, L_r, O_rj, L_rj)                 log-sum-exp merge, fp32
Backward: with the final O_r and the global L_r, P_rj = exp(S_rj - L_r) is already the exact
softmax restricted to block j, so each block's backward gives exact partial dQ_r, dK_j, dV_j.
dQ_r stays home; dK_j, dV_j are accumulators that travel WITH K_j, V_j (one step behind) and
arrive back at rank j after P steps.

Causal across shards, sliding windows, the layouts (contiguous, zigzag), padding to any length, `plan` (which
kernel calls cover exactly the visible (query, key) pairs) and `steps` (the steps at which some rank has work) live
in layout.py. With a window most steps have no work: the loops above run over `steps` only, K_j, V_j hop straight
to the next such step, and dK_j, dV_j go home in one hop after the last. Grouped-query K, V travel with their own
Hkv heads. ALiBi and dropout see each pair's global indices: every block call is told where it sits in the whole
problem (origin = the global query row and key of its first row and key), so its bias -slope |i + shift - j| and its
dropout bits Z_ij are those of the whole problem, and the ring gives the one-device result, mask and all.

The communication (comm.py) and the block kernels (BLOCKS) are pluggable; this file holds the
schedule and the merge. It runs unchanged on numpy (CPU) and CuPy (GPU) arrays.
"""
import dataclasses
import time

import numpy as np

from stages import naive
from stages.common import (
    cast, check_attention_inputs, check_backward_inputs, check_causal, resolve_scale, variants,
)

from .layout import LAYOUTS, check_layout, check_ranks, plan, positions, shard, shard_len, steps, unshard

__all__ = ["ring_forward", "ring_backward", "merge", "forward", "backward", "BLOCKS", "flash_version",
           "RingMismatch", "check_same_everywhere", "LAYOUTS", "plan", "positions", "shard", "shard_len", "unshard",
           "steps", "schedule"]


# ----------------------------------------------------------------------------- block kernels
# How one (query shard, key block) pair is computed. Each returns the block's partial result in float32
# (float64 for float64 inputs): O_rj, and the parts of dQ_r, dK_j, dV_j, straight from the kernels' float32
# accumulators, never rounded to 16 bits. The ring merges and adds them in float32 and rounds once at the end,
# as a single-device kernel rounds its accumulators once, so the ring's error does not grow with P.
#   "flash": stage 02 forward / stage 03 backward: the CUDA kernels on CuPy arrays, their numpy tile mirrors on
#            numpy arrays (exact but slow on the CPU). version: the stage 02/03 version (None: "auto").
#   "naive": stage 00, computed as a kernel computes for the dtype (fast on the CPU, but it materialises the
#            block's score matrix).
def _partial_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


# Every block takes the mask of its call (causal, window) and the options of the whole problem (**opts: softcap,
# alibi_slopes, dropout_p, seed, origin).
def _flash_forward(q, k, v, *, causal, scale, version=None, **opts):
    from stages import flash_v2

    return flash_v2.forward(q, k, v, causal=causal, scale=scale, version=version or "auto",
                            out_dtype=_partial_dtype(q.dtype), **opts)


def _flash_backward(q, k, v, o, lse, do, *, causal, scale, version=None, **opts):
    from stages import flash_v2_backward

    return flash_v2_backward.backward(q, k, v, o, cast(lse, np.float32), do, causal=causal, scale=scale,
                                      version=version or "auto", out_dtype=_partial_dtype(q.dtype), **opts)


def _naive_forward(q, k, v, *, causal, scale, version=None, **opts):
    return naive.forward(q, k, v, causal=causal, scale=scale, out_dtype=_partial_dtype(q.dtype), **opts)


def _naive_backward(q, k, v, o, lse, do, *, causal, scale, version=None, **opts):
    return naive.backward(q, k, v, o, lse, do, causal=causal, scale=scale, out_dtype=_partial_dtype(q.dtype),
                          **opts)


BLOCKS = {
    "flash": (_flash_forward, _flash_backward),
    "naive": (_naive_forward, _naive_backward),
}


def flash_version(dtype, version=None):
    """The stage 02 forward version the "flash" blocks run for a dtype (what stage 02's "auto" picks)."""
    from stages import flash_v2

    return flash_v2.resolve_version(version or "auto", dtype)


# ----------------------------------------------------------------------------- the merge
def merge(o_a, lse_a, o_b, lse_b):
    """Combine two partial results over disjoint key sets, in their stable log-sum-exp form.

        L = m + log(exp(L_a - m) + exp(L_b - m)),   m = max(L_a, L_b)
        O = O_a exp(L_a - L) + O_b exp(L_b - L)
    o_a, lse_a are the fp32 accumulators (updated in place and returned); o_b, lse_b the new block.
    A row that saw no key in either part keeps L = -inf and O = 0 (never NaN).
    """
    xp = np if isinstance(o_a, np.ndarray) else __import__("cupy")
    lse_b = lse_b.astype(lse_a.dtype, copy=False)
    m = xp.maximum(lse_a, lse_b)  # (B, H, Nq)
    m = xp.where(xp.isneginf(m), 0.0, m)  # both -inf: any finite m gives exp(-inf) = 0 below
    e_a, e_b = xp.exp(lse_a - m), xp.exp(lse_b - m)  # in [0, 1]: no overflow however large the logits
    total = e_a + e_b  # >= 1 unless the row is empty in both parts
    with np.errstate(divide="ignore"):
        lse_a[...] = m + xp.log(total)  # log(0) = -inf for an empty row
    total = xp.where(total == 0, 1.0, total)
    w_a, w_b = (e_a / total)[..., None], (e_b / total)[..., None]  # exp(L_a - L), exp(L_b - L): (B, H, Nq, 1)
    o_b = cast(o_b, o_a.dtype)
    if xp is np:
        o_a *= w_a
        o_a += o_b * w_b
    else:  # the same two lines fused into one pass over O on the GPU
        _merge_kernel()(w_a, o_b, w_b, o_a)
    return o_a, lse_a


def _accumulate(acc, x):
    """acc += x in place, x upcast element by element (no full-size temporary in acc's dtype)."""
    xp = np if isinstance(acc, np.ndarray) else __import__("cupy")
    xp.add(acc, x, out=acc)


_MERGE = []


def _merge_kernel():
    """O_a = O_a * w_a + O_b * w_b as one CuPy elementwise kernel (w broadcast over D)."""
    if not _MERGE:
        import cupy

        _MERGE.append(cupy.ElementwiseKernel("T w_a, T o_b, T w_b", "T o_a", "o_a = o_a * w_a + o_b * w_b",
                                             "ring_merge_o"))
    return _MERGE[0]


# ----------------------------------------------------------------------------- timing marks
def _marker(xp):
    """mark() -> a time stamp on the compute stream; ms(a, b) after the stream is done."""
    if xp is np:
        return time.perf_counter, lambda a, b: (b - a) * 1e3
    import cupy

    return (lambda: cupy.cuda.get_current_stream().record()), cupy.cuda.get_elapsed_time


def _rows(x, a, b):
    xp = np if isinstance(x, np.ndarray) else __import__("cupy")
    return xp.ascontiguousarray(x[:, :, a:b])  # (B, H, b-a, ...)


class RingMismatch(ValueError):
    """Ranks called the ring with different shapes/dtype/options, or one rank's inputs are invalid.
    Raised on EVERY rank at once (never a hang in a receive that will not come)."""


def check_same_everywhere(ring, **facts):
    """Every rank must call the ring with the same shapes, dtype and options: a mismatch would make
    the send/recv sizes disagree and hang. Raise on EVERY rank, naming the ranks that differ.
    A rank whose own inputs are invalid sends {"problem": message} instead, and every rank raises that."""
    every = ring.allgather(facts)
    problems = [(r, f["problem"]) for r, f in enumerate(every) if "problem" in f]
    if problems:
        raise RingMismatch("ring attention: " + "; ".join(f"rank {r} cannot run: {msg}" for r, msg in problems))
    bad = [r for r, f in enumerate(every) if f != every[0]]
    if bad:
        keys = sorted({key for r in bad for key in facts if every[r][key] != every[0][key]})
        lines = "\n".join(f"  rank {r}: " + ", ".join(f"{key}={every[r][key]}" for key in keys)
                          for r in range(len(every)))
        raise RingMismatch(f"ring attention: ranks {bad} disagree with rank 0 on {', '.join(keys)} "
                           f"(every rank must pass the same shapes, dtype and options):\n{lines}")


@dataclasses.dataclass(frozen=True)
class Call:
    """What forward and backward agree on before the ring turns: ranks, this rank, the array module, the
    shard shapes (B, H, Hkv, Lq, Lk, D), the global lengths, the resolved mask, scale and the options that act on
    scores or probabilities (softcap, ALiBi, dropout), and the steps with work (layout.steps)."""
    P: int
    r: int
    xp: object
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    nq: int
    nk: int
    causal: bool
    scale: float
    window: object  # (left, right) or None
    softcap: object  # c or None
    alibi_slopes: object  # (H,) or (B, H), or None
    dropout_p: float
    seed: int
    todo: tuple  # the steps at which some rank has work

    def options(self, qpos, kpos, c):
        """The options block call c takes besides its mask (none for plain attention): softcap when set; with ALiBi or
        dropout also where the call sits in the whole problem, origin (global row of its first query, global index
        of its first key, the problem's shift nk - nq)."""
        out = {} if self.softcap is None else {"softcap": self.softcap}
        if self.alibi_slopes is not None or self.dropout_p:
            out.update(alibi_slopes=self.alibi_slopes, dropout_p=self.dropout_p, seed=self.seed,
                       origin=(int(qpos[c.a]), int(kpos[c.c]), self.nk - self.nq))
        return out

    def calls(self, qpos, src, layout):
        """The kernel calls of this rank's queries against the block of rank src, with the keys' global positions."""
        kpos = positions(src, self.P, self.nk, layout)
        runs = self.alibi_slopes is not None or bool(self.dropout_p)  # each call on consecutive global positions
        return plan(qpos, kpos, self.nq, self.nk, self.causal, self.window, runs), kpos


def check_block(block, version, where="ring attention"):
    """block must be a key of BLOCKS; version is for the flash blocks only (the naive block has none)."""
    if block not in BLOCKS:
        raise ValueError(f"{where}: block {block!r} is not known; use one of {sorted(BLOCKS)}")
    if block == "naive" and version is not None:
        raise ValueError(f"{where}: block='naive' (stage 00) has no versions, got version={version!r}; "
                         "pass version=None, or block='flash' to run a stage 02/03 version")
    return block


def check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where):
    """(window, opts): the window as the ring uses it (None when unbounded) and the checked variants.Options. The ring
    takes every variant of stage 00 but packed variable-length batches: grouped-query k, v, window, softcap, ALiBi
    and dropout."""
    opts = variants.check(q, k, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                          dropout_p=dropout_p, seed=seed, where=where)
    window = None if opts.left < 0 and opts.right < 0 else (opts.left, -1 if causal else opts.right)
    return window, opts


def check_dropout_tiles(call, layout, block, where):
    """Dropout through the CUDA kernels: they draw the mask 16 x 16 blocks at a time, so every block call of this
    rank must start at a global query row and key that are multiples of 16 (variants.check_kernel_origin). That holds
    when the shards are whole 16-row tiles and there is no left window side (a band's calls start one key apart).
    A clear error before the ring turns, instead of one in the middle of it."""
    if not call.dropout_p or block != "flash" or call.xp is np:
        return
    qpos = positions(call.r, call.P, call.nq, layout)
    for s in call.todo:
        calls, kpos = call.calls(qpos, (call.r - s) % call.P, layout)
        for c in calls:
            if qpos[c.a] % 16 or kpos[c.c] % 16:
                raise ValueError(
                    f"{where}: dropout on the GPU: the kernels draw the mask in 16 x 16 blocks of the whole problem, "
                    f"and with {call.P} ranks, layout {layout}, nq={call.nq}, nk={call.nk} and window "
                    f"{call.window} a block call starts at query {qpos[c.a]}, key {kpos[c.c]}. Use lengths whose "
                    "shards are whole 16-row tiles (N a multiple of 16 P contiguous, 32 P zigzag) and no left window "
                    "side (a band's calls start one key apart), or block='naive'")


def _prologue(q, k, v, ring, nq, nk, causal, scale, layout, block, version, extra, window, softcap, alibi_slopes,
              dropout_p, seed):
    """Checks shared by forward and backward, agreed by every rank; returns a Call.

    The local checks run first and their error (if any) is shared with the agreement check, so a bad input on
    one rank is an error on every rank."""
    P, r = ring.size, ring.rank
    where = "ring attention backward" if extra else "ring attention"
    call = None
    try:
        xp, B, H, Lq, Lk, D = (check_backward_inputs(q, k, v, *extra, where=where, gqa=True) if extra
                               else check_attention_inputs(q, k, v, where=where, gqa=True))
        check_block(block, version, where)
        check_layout(layout, where)
        causal = check_causal(causal, where)
        window, opts = check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where)
        softcap = opts.softcap or None
        nq, nk = nq or P * Lq, nk or P * Lk
        if Lq != shard_len(nq, P, layout) or Lk != shard_len(nk, P, layout):
            raise ValueError(f"{where}: shards have {Lq} query / {Lk} key rows; with {P} ranks, layout {layout}, "
                             f"nq={nq} and nk={nk} they must have {shard_len(nq, P, layout)} / "
                             f"{shard_len(nk, P, layout)} (cut them with ring.shard)")
        scale = resolve_scale(scale, D)
        call = Call(P, r, xp, B, H, k.shape[1], Lq, Lk, D, nq, nk, causal, scale, window, softcap,
                    opts.alibi_slopes, opts.dropout_p, opts.seed, tuple(steps(P, nq, nk, layout, causal, window)))
        check_dropout_tiles(call, layout, block, where)
        facts = _facts(q, k, v, nq=nq, nk=nk, causal=causal, scale=scale, layout=layout, extra=extra,
                       window=window, softcap=softcap, alibi_slopes=opts.alibi_slopes, dropout_p=opts.dropout_p,
                       seed=opts.seed)
    except (TypeError, ValueError) as e:
        facts = {"problem": f"{type(e).__name__}: {e}"}
    check_same_everywhere(ring, **facts)
    return call


def _facts(q, k, v, *, nq, nk, causal, scale, layout, extra=(), window=None, softcap=None, alibi_slopes=None,
           dropout_p=0.0, seed=0):
    slopes = None if alibi_slopes is None else tuple(cast(alibi_slopes, np.float64).ravel().tolist())
    return dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), dtype=str(q.dtype),
                device=type(q).__module__.split(".")[0], nq=nq, nk=nk, causal=bool(causal), scale=float(scale),
                layout=layout, window=window, softcap=softcap, alibi_slopes=slopes, dropout_p=dropout_p, seed=seed,
                **{f"arg{i}": (tuple(t.shape), str(t.dtype)) for i, t in enumerate(extra)})


def schedule(P, nq, nk, *, layout="zigzag", causal=False, window=None, kv_shape=None, dtype=None):
    """What the ring will do, as a dict: the steps with work (layout.steps) out of P, the hops K, V make (forward
    and backward) and the hops the dK, dV accumulators make (backward; the last one takes them home), and, given
    one rank's K shard shape (B, Hkv, Lk, D) and dtype, the bytes of one hop: K and V, dK and dV (float32).
    Grouped-query k, v travel with their Hkv heads: H / Hkv times fewer bytes than H heads."""
    todo = steps(P, nq, nk, layout, causal, window)
    out = {"steps": todo, "of": P,
           "kv_hops": len(todo) - 1 + (1 if todo and todo[0] > 0 else 0) if todo else 0,
           "dkv_hops": len(todo) - 1 + (1 if todo and todo[-1] > 0 else 0) if todo else 0}
    if kv_shape is not None:
        n = int(np.prod(kv_shape))
        out["kv_bytes_per_hop"] = 2 * n * np.dtype(dtype).itemsize
        out["dkv_bytes_per_hop"] = 2 * n * _partial_dtype(dtype).itemsize
    return out


# ----------------------------------------------------------------------------- forward
def ring_forward(q, k, v, *, ring, nq=None, nk=None, causal=False, scale=None, layout="contiguous",
                 block="flash", version=None, timeline=None, window=None, softcap=None, alibi_slopes=None,
                 dropout_p=0.0, seed=0):
    """This rank's part of ring attention: (o, lse) for its query shard.

    q (B, H, Lq, D), k and v (B, Hkv, Lk, D): this rank's shards in `layout` (see shard()); Hkv divides H
    (grouped-query attention: the ring sends the Hkv heads). nq, nk: the global unpadded lengths (default P*Lq,
    P*Lk). window=(left, right), softcap, alibi_slopes, dropout_p and seed as in stage 00 (variants.py): the result
    is the one-device result, the same dropout mask included. ring: a communicator from comm.py.
    timeline: a list that receives one dict per step with work {step, compute_ms, exposed_ms} (exposed = time
    waiting on the ring).
    """
    call = _prologue(q, k, v, ring, nq, nk, causal, scale, layout, block, version, (), window, softcap,
                     alibi_slopes, dropout_p, seed)
    P, r, xp, B, H, Lq, D, nq = call.P, call.r, call.xp, call.B, call.H, call.Lq, call.D, call.nq
    fwd, _ = BLOCKS[block]
    acc = np.float64 if q.dtype == np.float64 else np.float32
    o_acc = xp.zeros((B, H, Lq, D), dtype=acc)  # O_r: normalised over the keys merged so far
    lse_acc = xp.full((B, H, Lq), -np.inf, dtype=acc)  # L_r
    qpos = positions(r, P, nq, layout)
    mark, ms = _marker(xp)
    k, v = xp.ascontiguousarray(k), xp.ascontiguousarray(v)  # (B, Hkv, Lk, D) row-major: transfers move raw bytes
    k_cur, v_cur, spare = k, v, None  # double buffers: the block in use and the one arriving

    def receive(shift):  # post the transfer of the block in use to rank r + shift (ours comes from r - shift)
        nxt = spare if spare is not None else (xp.empty(k.shape, k.dtype), xp.empty(v.shape, v.dtype))
        return nxt, ring.start([k_cur, v_cur], list(nxt), shift=shift)

    seen = np.zeros(Lq, dtype=bool)  # rows that already hold a partial result
    marks, todo = [], call.todo
    if todo and todo[0] > 0:  # the first step with work is not our own block's: fetch that block first
        nxt, handle = receive(todo[0])
        ring.wait(handle)
        k_cur, v_cur = nxt
    for idx, s in enumerate(todo):
        src = (r - s) % P  # Alg.: at step s rank r holds the block of rank r - s
        last = idx == len(todo) - 1
        if not last:  # post the next block's transfer before computing on this one (steps without work skipped)
            nxt, handle = receive(todo[idx + 1] - s)
        t0 = mark()
        calls, kpos = call.calls(qpos, src, layout)
        for c in calls:
            o_b, lse_b = fwd(_rows(q, c.a, c.b), _rows(k_cur, c.c, c.m), _rows(v_cur, c.c, c.m), scale=call.scale,
                             version=version, **c.mask(), **call.options(qpos, kpos, c))  # O_rj, L_rj (B, H, b-a, [D])
            if seen[c.a:c.b].any():  # (a row not seen yet holds O = 0, L = -inf: the merge takes the new block)
                merge(o_acc[:, :, c.a:c.b], lse_acc[:, :, c.a:c.b], o_b, lse_b)  # in place on rows a:b of O_r, L_r
            else:  # first block these rows see: nothing to merge with
                xp.copyto(o_acc[:, :, c.a:c.b], o_b)  # upcast into the accumulator, no temporary
                lse_acc[:, :, c.a:c.b] = lse_b
            seen[c.a:c.b] = True
        t1 = mark()
        if not last:
            ring.wait(handle)  # the next block has arrived (GPU: the compute stream waits, not the host)
            spare = (k_cur, v_cur) if k_cur is not k else None  # the caller's k, v are never overwritten
            k_cur, v_cur = nxt
        marks.append((s, t0, t1, mark()))
    o = cast(o_acc, q.dtype)
    lse = lse_acc.astype(np.float64 if acc == np.float64 else np.float32)  # (B, H, Lq): float32 by the API
    _record(timeline, marks, ms, xp)
    return o, lse


def _record(timeline, marks, ms, xp):
    if timeline is None:
        return
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    for s, t0, t1, t2 in marks:
        timeline.append({"step": s, "compute_ms": ms(t0, t1), "exposed_ms": ms(t1, t2)})


# ----------------------------------------------------------------------------- backward
def ring_backward(q, k, v, o, lse, do, *, ring, nq=None, nk=None, causal=False, scale=None,
                  layout="contiguous", block="flash", version=None, timeline=None, window=None, softcap=None,
                  alibi_slopes=None, dropout_p=0.0, seed=0):
    """This rank's part of the ring backward: (dq, dk, dv) for its own shards.

    o, lse: this rank's shard of the FINAL forward output (ring_forward's result). K, V rotate as in the forward;
    the dK, dV accumulators of each block follow one step behind, and after the last step with work s_last they go
    home to the block's rank (a hop of P - s_last). With grouped-query k, v the accumulators have Hkv heads: each
    block's backward has already summed its group's H / Hkv query heads.
    """
    call = _prologue(q, k, v, ring, nq, nk, causal, scale, layout, block, version, (o, lse, do), window, softcap,
                     alibi_slopes, dropout_p, seed)
    P, r, xp, B, H, Lq, D, nq = call.P, call.r, call.xp, call.B, call.H, call.Lq, call.D, call.nq
    _, bwd = BLOCKS[block]
    acc = np.float64 if q.dtype == np.float64 else np.float32
    valid = int((positions(r, P, nq, layout) < nq).sum())  # padding rows are a suffix of the shard
    if valid < Lq:  # padded query rows must send no gradient anywhere: dO = 0 there gives dS = 0
        do = do.copy()
        do.view(f"u{do.itemsize}")[:, :, valid:] = 0  # bit pattern 0 is +0.0 in every float dtype
    dq_acc = xp.zeros((B, H, Lq, D), dtype=acc)  # dQ_r stays home
    travel = [(xp.zeros(k.shape, dtype=acc), xp.zeros(k.shape, dtype=acc)), None]  # dK_j, dV_j: 2 buffers
    qpos = positions(r, P, nq, layout)
    mark, ms = _marker(xp)
    k, v = xp.ascontiguousarray(k), xp.ascontiguousarray(v)  # (B, Hkv, Lk, D) row-major: transfers move raw bytes
    k_cur, v_cur, spare = k, v, None  # double buffers

    def receive(shift):
        nxt = spare if spare is not None else (xp.empty(k.shape, k.dtype), xp.empty(v.shape, v.dtype))
        return nxt, ring.start([k_cur, v_cur], list(nxt), tag=0, shift=shift)

    marks, dkv_handle, todo = [], None, call.todo
    if todo and todo[0] > 0:  # the first step with work is not our own block's: fetch that block first
        nxt, kv_handle = receive(todo[0])
        ring.wait(kv_handle)
        k_cur, v_cur = nxt
    for idx, s in enumerate(todo):
        src = (r - s) % P
        last = idx == len(todo) - 1
        if not last:  # K_j, V_j for the next step with work, in flight during this step's compute
            nxt, kv_handle = receive(todo[idx + 1] - s)
        t0 = mark()
        block_grads = []  # this step's dK_j, dV_j parts, until block j's accumulator arrives
        calls, kpos = call.calls(qpos, src, layout)
        for c in calls:
            dq_b, dk_b, dv_b = bwd(_rows(q, c.a, c.b), _rows(k_cur, c.c, c.m), _rows(v_cur, c.c, c.m),
                                   _rows(o, c.a, c.b), _rows(lse, c.a, c.b), _rows(do, c.a, c.b), scale=call.scale,
                                   version=version, **c.mask(), **call.options(qpos, kpos, c))
            _accumulate(dq_acc[:, :, c.a:c.b], dq_b)  # dQ_r += dS_rj K_j   (scale included)
            block_grads.append((c, dk_b, dv_b))
        t1 = mark()
        if idx > 0:
            ring.wait(dkv_handle)  # block j's accumulator, from the rank that computed with block j last, is here
        for c, dk_b, dv_b in block_grads:  # (first step: travel[0] starts at zero)
            _accumulate(travel[0][0][:, :, c.c:c.m], dk_b)  # dK_j += dS_rj^T Q_r
            _accumulate(travel[0][1][:, :, c.c:c.m], dv_b)  # dV_j += P_rj^T dO_r
        hop = todo[idx + 1] - s if not last else (P - s) % P  # on to the next step with work, or home
        if hop:
            if travel[1] is None:
                travel[1] = (xp.empty_like(travel[0][0]), xp.empty_like(travel[0][1]))
            dkv_handle = ring.start(list(travel[0]), list(travel[1]), tag=1, shift=hop)  # dK_j, dV_j follow K_j, V_j
            travel.reverse()  # the buffer just received into is next step's accumulator
        if not last:
            ring.wait(kv_handle)
            spare = (k_cur, v_cur) if k_cur is not k else None
            k_cur, v_cur = nxt
        marks.append((s, t0, t1, mark()))
    if todo and todo[-1] > 0:
        ring.wait(dkv_handle)  # our own dK_r, dV_r are home, in travel[0]
    dk, dv = travel[0]
    _record(timeline, marks, ms, xp)
    return cast(dq_acc, q.dtype), cast(dk, k.dtype), cast(dv, v.dtype)


# ----------------------------------------------------------------------------- P ranks in one process
def _check_api(q, k, causal, scale, D, layout, ranks, block, version, where, window, softcap, alibi_slopes,
               dropout_p, seed):
    """The options of the one-process API, checked before any shard is cut."""
    check_causal(causal, where)
    resolve_scale(scale, D)
    check_layout(layout, where)
    check_ranks(ranks, where)
    check_block(block, version, where)
    check_ring_options(q, k, causal, window, softcap, alibi_slopes, dropout_p, seed, where)


def forward(q, k, v, *, causal=False, scale=None, layout="zigzag", ranks=4, block="naive", version=None,
            window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0):
    """The one API: ring attention of full (B, H, N, D) arrays with `ranks` simulated ranks (threads).

    layout: "contiguous" or "zigzag"; block: "naive" (stage 00) or "flash" (stages 02/03); version: the block
    kernel's version (stage 02/03 `version=`; None picks the fastest for the dtype). k, v may have Hkv heads
    (grouped-query); window, softcap, alibi_slopes, dropout_p and seed as in stage 00. Each thread runs
    ring_forward on its shard, exactly as an MPI rank would; the shards are gathered. Inputs are checked here first,
    so an error quotes the caller's arrays, not a shard.
    """
    from .comm import simulate

    _, _, _, nq, nk, D = check_attention_inputs(q, k, v, where="ring.forward", gqa=True)
    _check_api(q, k, causal, scale, D, layout, ranks, block, version, "ring.forward", window, softcap, alibi_slopes,
               dropout_p, seed)

    def rank_fn(ring):
        r, P = ring.rank, ring.size
        return ring_forward(shard(q, r, P, layout), shard(k, r, P, layout), shard(v, r, P, layout), ring=ring,
                            nq=nq, nk=nk, causal=causal, scale=scale, layout=layout, block=block,
                            version=version, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                            dropout_p=dropout_p, seed=seed)

    outs = simulate(rank_fn, ranks)
    return unshard([o for o, _ in outs], nq, layout), unshard([lse for _, lse in outs], nq, layout)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, layout="zigzag", ranks=4, block="naive",
             version=None, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0):
    """The one API's backward: ring_backward on `ranks` simulated ranks; returns full (dq, dk, dv).
    Inputs are checked here first, so an error quotes the caller's arrays, not a shard."""
    from .comm import simulate

    _, _, _, nq, nk, D = check_backward_inputs(q, k, v, o, lse, do, where="ring.backward", gqa=True)
    _check_api(q, k, causal, scale, D, layout, ranks, block, version, "ring.backward", window, softcap,
               alibi_slopes, dropout_p, seed)

    def rank_fn(ring):
        r, P = ring.rank, ring.size
        cut = [shard(x, r, P, layout) for x in (q, k, v, o, lse, do)]
        return ring_backward(*cut, ring=ring, nq=nq, nk=nk, causal=causal, scale=scale, layout=layout,
                             block=block, version=version, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             dropout_p=dropout_p, seed=seed)

    outs = simulate(rank_fn, ranks)
    return tuple(unshard([g[i] for g in outs], n, layout) for i, n in enumerate((nq, nk, nk)))
