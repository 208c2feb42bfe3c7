"""Stage 04: ring attention (Liu, Zaharia & Abbeel 2023, arXiv 2310.01889), the algorithm.

The sequence of N tokens is split across P ranks, T = N/P tokens each. Rank r keeps its query shard Q_r and the
key/value shards travel round the ring: at step s it holds the block K_j, V_j of rank j = (r - s) mod P, computes that
block's attention with a single-device kernel (O_rj, L_rj: the block's own softmax), merges it into its running O_r,
L_r by their log-sum-exp, and passes the block on to rank r + 1.
Backward: with the final O_r and the global L_r, P_rj = exp(S_rj - L_r) is already the exact softmax restricted to
block j, so each block's backward gives exact partial dQ_r, dK_j, dV_j. dQ_r stays home; dK_j, dV_j travel with K_j,
V_j and arrive back at rank j after the last step.

`ring=`, the keyword of every rank-level function here, is this rank's communicator (comm.py: .rank, .size,
.exchange(sends, recvs, shift) to rank + shift and from rank - shift, .wait(handle)); elsewhere it is `comm`.

Read this file first: plain_ring_forward and plain_ring_backward (the algorithm in its plainest form: whole blocks,
a double buffer, one block call per step; the tests hold the fast ring to them), merge, then ring_forward and
ring_backward (the same loops as a rank runs them fast) and the one API, forward and backward (P ranks as threads).
Then problem.py, shards.py, compute.py, travel.py, comm.py, gather.py, marks.py, launch.py and threads.py, run.py:
stage 04's README says what each holds, in this order. It runs unchanged on numpy (CPU) and CuPy (GPU) arrays.

One set of defaults for every entry point: layout="zigzag" (every rank the same causal work; no cost without a mask);
block=None, the arrays' device's: "flash" (stages 02/03, or stage 06's where registered) on CuPy arrays, "naive"
(stage 00: fast on a CPU, where the stage 02/03 tile mirrors are exact but slow) on numpy arrays.
"""
import numpy as np

from stages.common import array_module, cast, check_attention_inputs, check_backward_inputs, kernels

from . import gather
from .compute import (Compute, backward_accumulators, default_block, forward_accumulators, merge_kernel,
                      partial_dtype)
from .shards import shard, unshard
from .marks import Marks, one_call
from .problem import check_api, plain_problem, prologue
from .threads import simulate
from .travel import Travel, hop

__all__ = ["plain_ring_forward", "plain_ring_backward", "merge", "ring_forward", "ring_backward", "forward", "backward"]


# ----------------------------------------------------------------------------- the plain ring: read this first
def _block_of_step(r, j, T, layout, causal):
    """(query rows, key rows, causal) of rank r's one block call against the block of rank j, or None when no query of
    rank r sees a key of block j (shards of T rows, no padding; shards.py draws the layouts):
      full attention        every query against every key
      contiguous, causal    j == r: causal (the diagonal block); j < r: every key; j > r: nothing
      zigzag, causal        rank r holds chunks r and 2P-1-r of c = T/2 rows. j == r: causal over the whole shard (chunk
                            2P-1-r sees all of chunk r); j < r: every query against chunk j (the block's first half);
                            j > r: chunk 2P-1-r (the shard's second half) against every key."""
    every = slice(None)
    if not causal or j == r:
        return every, every, bool(causal)
    if layout == "contiguous":
        return (every, every, False) if j < r else None
    return (every, slice(0, T // 2), False) if j < r else (slice(T // 2, T), every, False)


def _part(xp, x, rows):
    return xp.ascontiguousarray(x[:, :, rows])  # (B, H, rows, ...)


def plain_ring_forward(q, k, v, *, ring, causal=False, scale=None, layout="zigzag", block=None):
    """Rank r's ring forward, plainly: whole blocks, a double buffer, one block call per step. q (B, H, T, D), k, v
    (B, Hkv, T, D): this rank's shards (shard()) of N = P T tokens, no padding. ring: this rank's communicator (comm.py:
    .rank, .size, .exchange, .wait; the module docstring says what each does). Returns (O_r, L_r) as ring_forward."""
    xp, scale, (fwd, _) = plain_problem(q, k, layout, causal, scale, block)
    P, r = ring.size, ring.rank
    O_r = xp.zeros(q.shape, partial_dtype(q.dtype))  # normalised over the keys merged so far (float32)
    L_r = xp.full(q.shape[:3], -np.inf, O_r.dtype)  # log sum exp of the scores over those keys
    kv, arriving = (k.copy(), v.copy()), (xp.empty_like(k), xp.empty_like(v))  # the double buffer
    for s in range(P):
        j = (r - s) % P  # at step s rank r holds K_j, V_j
        if s < P - 1:  # K_j, V_j go on to rank r + 1 while we compute; K_j-1, V_j-1 land in the other buffer
            handle = ring.exchange(list(kv), list(arriving), shift=1)
        call = _block_of_step(r, j, q.shape[2], layout, causal)
        if call is not None:
            rows, keys, diagonal = call
            O_rj, L_rj = fwd(_part(xp, q, rows), _part(xp, kv[0], keys), _part(xp, kv[1], keys), causal=diagonal,
                             scale=scale, out_dtype=O_r.dtype)  # the block's own softmax: O_rj, L_rj
            merge(O_r[:, :, rows], L_r[:, :, rows], O_rj, L_rj)  # O_r, L_r and block j's, by their log-sum-exp
        if s < P - 1:
            ring.wait(handle)  # the next block is here
            kv, arriving = arriving, kv
    return cast(O_r, q.dtype), L_r


def plain_ring_backward(q, k, v, o, lse, do, *, ring, causal=False, scale=None, layout="zigzag", block=None):
    """Rank r's ring backward, plainly: K_j, V_j travel as in the forward, and with them the float32 dK_j, dV_j that
    the ranks before this one added to; after the last step the gradients make one more hop, home to rank j. o, lse:
    this rank's shards of the forward's final O and global L (O_r, L_r). ring: this rank's communicator, as in
    plain_ring_forward. A rank sends dK_j, dV_j on only once it has added its part, so here every exchange is waited
    for at once, after the step's compute (ring_backward hides the transfers: its blocks travel in halves)."""
    xp, scale, (_, bwd) = plain_problem(q, k, layout, causal, scale, block)
    P, r, acc = ring.size, ring.rank, partial_dtype(q.dtype)
    dQ = xp.zeros(q.shape, acc)  # dQ_r stays home
    blk = [k.copy(), v.copy(), xp.zeros(k.shape, acc), xp.zeros(v.shape, acc)]  # K_j, V_j, dK_j, dV_j travel together
    arriving = [xp.empty_like(x) for x in blk]
    for s in range(P):
        j = (r - s) % P
        call = _block_of_step(r, j, q.shape[2], layout, causal)
        if call is not None:
            (rows, keys, diagonal), (K, V, dK, dV) = call, blk  # K_j, V_j, dK_j, dV_j
            Q_r, O_r, L_r, dO_r = (_part(xp, x, rows) for x in (q, o, lse, do))
            dQ_rj, dK_rj, dV_rj = bwd(Q_r, _part(xp, K, keys), _part(xp, V, keys), O_r, L_r, dO_r, causal=diagonal,
                                      scale=scale, out_dtype=acc)  # exact partial gradients: L_r is the global one
            dQ[:, :, rows] += dQ_rj  # dQ_r += dS_rj K_j   (scale included)
            dK[:, :, keys] += dK_rj  # dK_j += dS_rj^T Q_r
            dV[:, :, keys] += dV_rj  # dV_j += P_rj^T dO_r
        moving = slice(2, 4) if s == P - 1 else slice(0, 4)  # after the last step only dK_j, dV_j go on: home
        ring.wait(ring.exchange(blk[moving], arriving[moving], shift=1))
        blk, arriving = arriving, blk
    return cast(dQ, q.dtype), cast(blk[2], k.dtype), cast(blk[3], v.dtype)


# ----------------------------------------------------------------------------- the merge
def merge(o_a, lse_a, o_b, lse_b):
    """Combine two partial results over disjoint key sets, in their stable log-sum-exp form.

        L = m + log(exp(L_a - m) + exp(L_b - m)),   m = max(L_a, L_b)
        O = O_a exp(L_a - L) + O_b exp(L_b - L)
    o_a, lse_a are the fp32 accumulators (updated in place and returned); o_b, lse_b the new block. Where L_a = -inf
    (nothing merged yet) O_a may be uninitialised, even NaN, and its value never reaches the result: the numpy line
    below multiplies it by w_a = 0 and np.where drops that product; the GPU's merge_kernel (as the kernels' own merge
    in their epilogue) does not read it at all. A row that saw no key in either part keeps L = -inf and O = 0 (never
    NaN).
    """
    xp = array_module(o_a)
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
        with np.errstate(invalid="ignore", over="ignore"):  # O_a w_a where w_a = 0 is computed, then dropped
            o_a[...] = np.where(w_a != 0, o_a * w_a, 0) + o_b * w_b
    else:  # the same line as one pass over O on the GPU
        merge_kernel()(w_a, o_b, w_b, o_a)
    return o_a, lse_a


# ----------------------------------------------------------------------------- the fast ring: forward
def ring_forward(q, k, v, *, ring, nq=None, nk=None, causal=False, scale=None, layout="zigzag", block=None,
                 version=None, timeline=None, window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0,
                 scheme="ring"):
    """This rank's part of ring attention: (o, lse) for its query shard. ring: this rank's communicator (comm.py).

    q (B, H, Tq, D), k and v (B, Hkv, Tk, D): this rank's shards in `layout` (shard()); Hkv divides H (grouped-query:
    the ring sends the Hkv heads). nq, nk: the global unpadded lengths (default P Tq, P Tk). window, softcap,
    alibi_slopes, dropout_p and seed as in stage 00: the result is the one-device result, dropout mask included.
    block: "naive", "flash" or None (the defaults above); version: the stage 02 version of the flash blocks. timeline:
    a list that receives {step, compute_ms, exposed_ms} per step with work (marks.py). scheme: "ring", "allgather" or
    "alltoall" (gather.py), the same result."""
    block = default_block(block, q)
    prob = prologue(q, k, v, ring, nq=nq, nk=nk, causal=causal, scale=scale, layout=layout, block=block,
                    version=version, window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                    seed=seed, scheme=scheme)
    runner = Compute(prob, block, version, q.dtype, backward=False, merge=merge)  # this rank's block calls
    timer = Marks(prob.xp, timeline)  # the timing marks (marks.py), taken only when asked
    q, k, v = (kernels.row_major(x) for x in (q, k, v))  # row-major: the kernels read rows in place
    whole = prob.whole_call()
    if whole is not None:  # one rank, one call: the kernel writes the result in the inputs' dtype itself
        return one_call(prob.xp, timeline, "forward", lambda: runner.whole_forward(q, k, v, *whole))
    if prob.scheme == "alltoall":
        o, lse = gather.alltoall_forward(ring, prob, runner, q, k, v, timer)
    else:
        with timer.span("fill"):
            o_run, lse_run = forward_accumulators(prob, q.dtype)  # O_r, L_r: nothing merged yet
        turn = _turn_forward if prob.scheme == "ring" else gather.gathered_forward
        turn(ring, prob, runner, q, k, v, o_run, lse_run, timer)
        with timer.span("cast"):
            o, lse = cast(o_run, q.dtype), lse_run  # lse: float32 by the API (float64 for float64 inputs)
    timer.record()
    return o, lse


def _turn_forward(comm, prob, runner, q, k, v, o_run, lse_run, timer):
    """The ring: the blocks travel whole, double-buffered, each merged into O_r, L_r at the step it is here; the steps
    without work (a window's) are skipped, the block hopping straight to the next step with work."""
    xp, todo = prob.xp, prob.todo
    k_cur, v_cur, spare = k, v, None  # double buffers: the block in use and the one arriving

    def send_and_receive(n):  # post: the block in use goes to rank r + n, rank r - n's lands in the other buffer
        nxt = spare if spare is not None else (xp.empty_like(k), xp.empty_like(v))
        return nxt, comm.exchange([k_cur, v_cur], list(nxt), shift=n)  # (the landing buffer, the handle to wait on)

    if todo and todo[0] > 0:  # the first step with work is not our own block's: fetch that block first
        nxt, handle = send_and_receive(todo[0])
        comm.wait(handle)
        k_cur, v_cur = nxt
    for idx, s in enumerate(todo):  # at step s rank r holds the block of rank r - s
        t0 = timer.mark()
        n = hop(todo, idx, prob.P, home=False)
        if n:  # post the next block's transfer before computing on this one
            nxt, handle = send_and_receive(n)
        t1 = timer.mark()
        calls, kpos = prob.calls(s)
        runner.forward_step(q, k_cur, v_cur, o_run, lse_run, calls, kpos)
        t2 = timer.mark()
        if n:
            comm.wait(handle)  # the next block has arrived (GPU: the compute stream waits, not the host)
            spare = (k_cur, v_cur) if k_cur is not k else None  # the caller's k, v are never overwritten
            k_cur, v_cur = nxt
        timer.phase("post", t0, t1, step=s)
        timer.add(s, (t1, t2), (t2, timer.mark()))  # computed, then waited for the next block


# ----------------------------------------------------------------------------- the fast ring: backward
def ring_backward(q, k, v, o, lse, do, *, ring, nq=None, nk=None, causal=False, scale=None, layout="zigzag",
                  block=None, version=None, timeline=None, window=None, softcap=None, alibi_slopes=None,
                  dropout_p=0.0, seed=0, scheme="ring"):
    """This rank's part of the ring backward: (dq, dk, dv) for its own shards, from its shard of the FINAL forward
    output o, lse. K, V travel in two halves (travel.py) with their float32 dK, dV: each rank adds its part, and after
    the last step with work s_last they go home (a hop of P - s_last). version: the stage 03 version of the flash
    blocks. Other arguments as ring_forward's."""
    block = default_block(block, q)
    prob = prologue(q, k, v, ring, extra=(o, lse, do), nq=nq, nk=nk, causal=causal, scale=scale, layout=layout,
                    block=block, version=version, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                    dropout_p=dropout_p, seed=seed, scheme=scheme)
    xp, runner = prob.xp, Compute(prob, block, version, q.dtype, backward=True)  # as in ring_forward
    timer = Marks(xp, timeline, "backward")
    q, k, v = (kernels.row_major(x) for x in (q, k, v))
    whole = prob.whole_call()
    if whole is not None:  # one rank, one call: the kernels write the gradients in the inputs' dtype themselves
        return one_call(xp, timeline, "backward", lambda: runner.whole_backward(q, k, v, o, lse, do, *whole))
    if prob.scheme == "alltoall":
        grads = gather.alltoall_backward(ring, prob, runner, q, k, v, o, lse, do, timer)
    else:
        with timer.span("fill"):
            o, lse, do, dq_run = backward_accumulators(prob, o, lse, do)  # dQ_r = 0: it stays home
        turn = _turn_backward if prob.scheme == "ring" else gather.gathered_backward
        # make_dkv: a function that returns dK_r, dV_r in k's dtype, called once dQ_r is cast (less memory at once)
        make_dkv = turn(ring, prob, runner, q, k, v, o, lse, do, dq_run, timer)
        with timer.span("cast"):
            dq = cast(dq_run, q.dtype)
            del dq_run  # (memory back to the pool before dK, dV are made)
            grads = (dq, *make_dkv())
    timer.record()
    return grads


def _turn_backward(comm, prob, runner, q, k, v, o, lse, do, dq_run, timer):
    """The ring: the key blocks travel in halves with their dK, dV accumulators (travel.Travel); returns a function
    that makes dK_r, dV_r once they are home."""
    with timer.span("copy-in"):
        travelling, todo = Travel(comm, prob, k, v), prob.todo  # K_j, V_j and their dK_j, dV_j accumulators, in halves
    if todo and todo[0] > 0:
        for h in range(len(travelling.slots)):
            travelling.depart(h, todo[0])
    for idx, s in enumerate(todo):
        for h, slot in enumerate(travelling.slots):
            t0 = timer.mark()
            travelling.arrive(h)  # half h of K_j, V_j and of the dK_j, dV_j summed so far is here
            t1 = timer.mark()
            calls, kpos = prob.calls(s, h)
            runner.backward_step(q, slot["k"], slot["v"], o, lse, do, dq_run, slot["dk"], slot["dv"], calls, kpos)
            t2 = timer.mark()
            last = idx == len(todo) - 1
            travelling.depart(h, hop(todo, idx, prob.P, home=True), grads_only=last)  # the last hop: dK, dV go home
            timer.phase("post", t2, timer.mark(), step=s, half=h)
            timer.add(s, (t1, t2), (t0, t1), half=h)  # waited for the half, then computed
    with timer.span("home"):
        for h in range(len(travelling.slots)):
            travelling.arrive(h)  # our own dK_r, dV_r are home
    travelling.spare = None  # (memory back to the pool before the outputs are made)
    return lambda: travelling.gradients(k, v)


# ----------------------------------------------------------------------------- the one API: P ranks in one process
def forward(q, k, v, *, causal=False, scale=None, layout="zigzag", ranks=4, block=None, version=None, window=None,
            softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0, scheme="ring"):
    """The one API: ring attention of full (B, H, N, D) arrays on `ranks` simulated ranks (threads), each running
    ring_forward on its shard as an MPI rank would; the shards are gathered. Options as ring_forward's. The inputs are
    checked first, so an error quotes the caller's arrays, not a shard."""
    _, _, _, nq, nk, D = check_attention_inputs(q, k, v, where="ring.forward", gqa=True)
    kw = dict(causal=causal, scale=scale, layout=layout, block=default_block(block, q), version=version, window=window,
              softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, scheme=scheme)
    check_api(q, k, D=D, ranks=ranks, where="ring.forward", **kw)
    outs = simulate(lambda comm: ring_forward(*(shard(x, comm.rank, comm.size, layout) for x in (q, k, v)), ring=comm,
                                              nq=nq, nk=nk, **kw), ranks)  # comm: each simulated rank's communicator
    return unshard([o for o, _ in outs], nq, layout), unshard([lse for _, lse in outs], nq, layout)


def backward(q, k, v, o, lse, do, *, causal=False, scale=None, layout="zigzag", ranks=4, block=None, version=None,
             window=None, softcap=None, alibi_slopes=None, dropout_p=0.0, seed=0, scheme="ring"):
    """The one API's backward: ring_backward on `ranks` simulated ranks; returns full (dq, dk, dv)."""
    _, _, _, nq, nk, D = check_backward_inputs(q, k, v, o, lse, do, where="ring.backward", gqa=True)
    kw = dict(causal=causal, scale=scale, layout=layout, block=default_block(block, q), version=version, window=window,
              softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, scheme=scheme)
    check_api(q, k, D=D, ranks=ranks, where="ring.backward", **kw)
    outs = simulate(lambda comm: ring_backward(*(shard(x, comm.rank, comm.size, layout) for x in (q, k, v, o, lse, do)),
                                               ring=comm, nq=nq, nk=nk, **kw), ranks)
    return tuple(unshard([g[i] for g in outs], n, layout) for i, n in enumerate((nq, nk, nk)))
