"""Stage 04: two other ways to split attention over P ranks, beside the ring: all-gather and all-to-all.

The ring (ring.py) moves K, V one shard per step and hides each move behind a step's compute. Two other schemes
train long-context models today. Both take the same shards, options and checks as the ring and give the same result
as one device (scheme= of ring_forward / ring_backward and of forward / backward):

  allgather  (Llama 3's context parallelism, Dubey et al. 2024, section 3.3)  Every rank gathers the whole K, V once,
             puts the keys in sequence order, and its query shard attends to them in a few long kernel calls (one per
             run of consecutive query positions: one for contiguous shards, two for zigzag). The backward gathers K, V
             again, adds dK, dV for every key into float32 accumulators of the whole sequence, and reduce-scatters
             them: each rank receives the P parts of its own shard and sums them in rank order.
  alltoall   (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv 2309.14509)  Heads are scattered. One all-to-all turns each
             rank's (all H heads, N/P tokens) of q, k, v into (H/P heads, all N tokens); each rank runs the
             single-device kernel on the whole sequence for its heads, and a second all-to-all brings O and L back to
             the token shards. The backward does the same with q, k, v, o, L, dO and brings dQ, dK, dV back. P must
             divide H and Hkv: a rank needs whole heads.

What a rank sends per call, e bytes per element, T = N/P tokens a rank, heads H and Hkv of D dims (traffic() below):

              forward                        backward                                 hidden behind compute
  ring        (P-1) 2 T Hkv D e              (P-1) 2 T Hkv D e + P 2 T Hkv D 4         yes, hop by hop
  allgather   (P-1) 2 T Hkv D e              (P-1) 2 T Hkv D (e + 4)                   no: gathered first
  alltoall    (P-1)/P (2 H + 2 Hkv) T D e    (P-1)/P (4 H + 4 Hkv) T D e               no
              (+ 4 H T (P-1)/P: the lse)     (+ 4 H T (P-1)/P: the lse)
(The ring's float32 dK, dV make one hop more than its K, V: the last one takes them home.)

So the ring and the all-gather move about the same bytes, and they grow with P (each rank sees every other rank's K, V);
the all-to-all moves a constant amount per token, about 1/P of theirs for every head its own: it wins at large P on
a fast all-to-all network (NVLink in a node), but it cannot use more ranks than kv heads, and nothing hides its
transfers. The all-gather is the simplest and its kernel calls are the longest (the whole sequence of keys in one
call); it pays where K, V are small (grouped-query attention, Llama 3's 8 kv heads) and P is small, and it holds
K, V of the whole sequence (and their float32 gradients in the backward) on every rank. The ring holds one and a
half blocks and hides its hops, which is what lets it scale to any P when each step's compute outlasts a hop.

This file holds the two schemes' data movement and their forward and backward (ring_forward and ring_backward call
them with scheme=); the block calls are the ring's (compute.py), the checks too (problem.py).
"""
import numpy as np

from stages.common import cast

from .compute import partial_dtype
from .shards import _runs, positions, shard_len

SCHEMES = ("ring", "allgather", "alltoall")


def check_scheme(scheme, P, H, Hkv, dropout_p, where="ring attention"):
    """scheme must be one of SCHEMES; the all-to-all gives each rank H/P query heads and Hkv/P kv heads."""
    if scheme not in SCHEMES:
        raise ValueError(f"{where}: scheme {scheme!r} is not known; use one of {SCHEMES}")
    if scheme != "alltoall":
        return scheme
    if H % P or Hkv % P:
        raise ValueError(f"{where}: scheme 'alltoall' gives each of the {P} ranks H/P query heads and Hkv/P kv heads, "
                         f"so {P} must divide H = {H} and Hkv = {Hkv}; use scheme 'ring' or 'allgather' (any P)")
    if dropout_p:
        raise ValueError(f"{where}: scheme 'alltoall' runs each rank's heads as a problem of its own, and dropout "
                         "draws its bits from a head's index in the call, so the mask would not be one device's; use "
                         "scheme 'ring' or 'allgather' with dropout")
    return scheme


def traffic(scheme, P, T, H, Hkv, D, dtype):
    """(forward, backward): bytes a rank sends per call, with T tokens a rank and every step of the ring busy."""
    e, f = np.dtype(dtype).itemsize, 8 if np.dtype(dtype) == np.float64 else 4  # f: the float32 lse and gradients
    if scheme == "alltoall":
        share = (P - 1) / P * T
        return int(share * ((2 * H + 2 * Hkv) * D * e + H * f)), int(share * ((4 * H + 4 * Hkv) * D * e + H * f))
    kv = 2 * T * Hkv * D  # K and V of one shard (or dK and dV)
    if scheme == "ring":
        return (P - 1) * kv * e, (P - 1) * kv * e + P * kv * f
    return (P - 1) * kv * e, (P - 1) * kv * (e + f)


# ----------------------------------------------------------------------------- shards <-> the sequence in order
def _placements(j, P, n, layout):
    """[(a, b, at)]: rows a:b of rank j's shard are rows at:at + b - a of the sequence (padding rows included: they sit
    at positions >= n, after every real row). Zigzag shards are two runs, contiguous ones one."""
    pos = positions(j, P, n, layout)
    return [(a, b, int(pos[a])) for a, b in _runs(pos)]


def to_sequence(parts, P, n, layout, out):
    """Put shards into out (B, h, P T, ...), a sequence in order: parts {j: rank j's shard (B, h, T, ...)}."""
    for j, part in parts.items():
        for a, b, at in _placements(j, P, n, layout):
            out[:, :, at:at + b - a] = part[:, :, a:b]
    return out


def from_sequence(x, j, P, n, layout, xp):
    """Rank j's shard (B, h, T, ...) of x (B, h, m, ...), a sequence in order of m <= P T rows; rows past m are zero."""
    T = shard_len(n, P, layout)
    out = xp.zeros(x.shape[:2] + (T,) + x.shape[3:], x.dtype)
    for a, b, at in _placements(j, P, n, layout):
        b = min(b, a + max(0, x.shape[2] - at))  # rows past the end of x stay zero (padding)
        out[:, :, a:b] = x[:, :, at:at + b - a]
    return out


def _heads(x, j, P):
    """Rank j's share of the heads of x (B, H, ...): heads j H/P .. (j+1) H/P (a view)."""
    h = x.shape[1] // P
    return x[:, j * h:(j + 1) * h]


# Both schemes move their data by P - 1 pairwise exchanges, the ring's own primitive (the communicator's exchange
# method: NcclRing.exchange, NumpyRing.exchange, ... in comm.py) with a longer reach: at each shift = 1 .. P-1 rank r
# sends to rank r + shift what that rank needs and receives from rank r - shift what it needs itself. A rank holds one
# piece in flight at a time (a shard's worth), never P of them. comm: this rank's communicator.

# ----------------------------------------------------------------------------- all-gather
def gather_sequence(comm, arrays, n, layout, xp):
    """Every rank's shards of `arrays` (each (B, h, T, D)), gathered and put in sequence order: (B, h, P T, D) each."""
    P, r = comm.size, comm.rank
    full = [xp.empty(x.shape[:2] + (P * x.shape[2],) + x.shape[3:], x.dtype) for x in arrays]
    for f, x in zip(full, arrays):
        to_sequence({r: x}, P, n, layout, f)
    landing = [xp.empty_like(x) for x in arrays]
    for shift in range(1, P):
        comm.wait(comm.exchange(arrays, landing, shift=shift))  # rank r - shift's shards are here
        for f, x in zip(full, landing):
            to_sequence({(r - shift) % P: x}, P, n, layout, f)
    return full


def scatter_sum(comm, arrays, n, layout, xp):
    """The reduce-scatter of the backward: arrays (B, h, P T, D) in sequence order hold this rank's part of every
    key's gradient; each rank receives everyone's part of its own shard and adds them in a fixed order (its own, then
    rank r - 1's, r - 2's, ...). Returns this rank's sums, (B, h, T, D) each."""
    P, r = comm.size, comm.rank
    totals = [from_sequence(x, r, P, n, layout, xp) for x in arrays]
    landing = [xp.empty_like(t) for t in totals]
    for shift in range(1, P):
        parts = [from_sequence(x, (r + shift) % P, P, n, layout, xp) for x in arrays]  # rank r + shift's rows
        comm.wait(comm.exchange(parts, landing, shift=shift))  # rank r - shift's part of our rows
        for t, x in zip(totals, landing):
            t += x
    return totals


# ----------------------------------------------------------------------------- all-to-all
def heads_to_sequence(comm, arrays, n, layout, xp):
    """(B, H, T, ...) token shards of every rank -> (B, H/P, n, ...): this rank's H/P heads over the whole sequence,
    in order (rank r takes heads r H/P .. (r+1) H/P). Padding rows (positions >= n) are dropped."""
    P, r = comm.size, comm.rank
    full = [xp.empty(_heads(x, r, P).shape[:2] + (P * x.shape[2],) + x.shape[3:], x.dtype) for x in arrays]
    for f, x in zip(full, arrays):
        to_sequence({r: _heads(x, r, P)}, P, n, layout, f)
    landing = [xp.empty(_heads(x, r, P).shape, x.dtype) for x in arrays]
    for shift in range(1, P):
        sends = [xp.ascontiguousarray(_heads(x, (r + shift) % P, P)) for x in arrays]  # r + shift: its heads, our rows
        comm.wait(comm.exchange(sends, landing, shift=shift))  # our heads, rank r - shift's rows
        for f, x in zip(full, landing):
            to_sequence({(r - shift) % P: x}, P, n, layout, f)
    return [f if n == f.shape[2] else xp.ascontiguousarray(f[:, :, :n]) for f in full]


def sequence_to_heads(comm, arrays, n, layout, xp):
    """The way back: (B, H/P, n, ...) of this rank's heads -> (B, H, T, ...), this rank's token shard of every head."""
    P, r = comm.size, comm.rank
    out = []
    for x in arrays:
        own = from_sequence(x, r, P, n, layout, xp)  # (B, H/P, T, ...)
        mine = xp.empty((x.shape[0], P * x.shape[1]) + own.shape[2:], x.dtype)
        _heads(mine, r, P)[...] = own
        out.append(mine)
    landing = [xp.empty_like(_heads(o, r, P)) for o in out]
    for shift in range(1, P):
        sends = [from_sequence(x, (r + shift) % P, P, n, layout, xp) for x in arrays]  # r + shift: its rows, our heads
        comm.wait(comm.exchange(sends, landing, shift=shift))  # our rows, rank r - shift's heads
        for o, x in zip(out, landing):
            _heads(o, (r - shift) % P, P)[...] = x
    return out


# ----------------------------------------------------------------------------- the schemes' forward and backward
def gathered_forward(comm, prob, runner, q, k, v, o_run, lse_run, timer):
    """scheme "allgather": K, V of the whole sequence gathered in order, then this rank's queries against all of them
    in a few long calls, merged into O_r, L_r as the ring merges its blocks."""
    t0 = timer.mark()
    k_all, v_all = gather_sequence(comm, [k, v], prob.nk, prob.layout, prob.xp)  # (B, Hkv, P Tk, D)
    t1 = timer.mark()
    calls, kpos = prob.gathered_calls()
    runner.forward_step(q, k_all, v_all, o_run, lse_run, calls, kpos)
    timer.add(0, (t1, timer.mark()), (t0, t1))  # computed, after waiting for the gather


def _head_options(prob):
    """The options of scheme "alltoall"'s one call: the whole problem's mask and options, for this rank's heads."""
    out = {"causal": prob.causal}
    if prob.window is not None:
        out["window"] = prob.window
    if prob.softcap is not None:
        out["softcap"] = prob.softcap
    if prob.alibi_slopes is not None:
        h = prob.H // prob.P
        out["alibi_slopes"] = prob.alibi_slopes[..., prob.r * h:(prob.r + 1) * h]  # (H,) or (B, H): our heads
    return out


def alltoall_forward(comm, prob, runner, q, k, v, timer):
    """scheme "alltoall": this rank's H/P heads over the whole sequence (heads_to_sequence), one single-device call,
    and O, L back to the token shards."""
    xp, layout = prob.xp, prob.layout
    t0 = timer.mark()
    q_h, = heads_to_sequence(comm, [q], prob.nq, layout, xp)  # (B, H/P, nq, D)
    k_h, v_h = heads_to_sequence(comm, [k, v], prob.nk, layout, xp)  # (B, Hkv/P, nk, D)
    t1 = timer.mark()
    o_h, lse_h = runner.fwd(q_h, k_h, v_h, scale=prob.scale, version=runner.version, **_head_options(prob))
    del q_h, k_h, v_h  # (memory back to the pool before the way back)
    t2 = timer.mark()
    o, lse = sequence_to_heads(comm, [o_h, lse_h], prob.nq, layout, xp)  # (B, H, Tq, D), (B, H, Tq)
    timer.add(0, (t1, t2), (t0, t1))
    timer.add(0, None, (t2, timer.mark()))  # the transfer back: no compute beside it
    return o, lse


def gathered_backward(comm, prob, runner, q, k, v, o, lse, do, dq_run, timer):
    """scheme "allgather": K, V gathered again, dK, dV of every key added into float32 accumulators of the whole
    sequence, then reduce-scattered (scatter_sum); returns a function that makes dK_r, dV_r."""
    xp = prob.xp
    t0 = timer.mark()
    k_all, v_all = gather_sequence(comm, [k, v], prob.nk, prob.layout, xp)
    t1 = timer.mark()
    dk_all, dv_all = (xp.zeros(k_all.shape, partial_dtype(k.dtype)) for _ in range(2))
    calls, kpos = prob.gathered_calls()
    runner.backward_step(q, k_all, v_all, o, lse, do, dq_run, dk_all, dv_all, calls, kpos)
    t2 = timer.mark()
    del k_all, v_all
    dk, dv = scatter_sum(comm, [dk_all, dv_all], prob.nk, prob.layout, xp)  # this rank's keys, summed
    timer.add(0, (t1, t2), (t0, t1))
    timer.add(0, None, (t2, timer.mark()))  # the reduce-scatter
    return lambda: (cast(dk, k.dtype), cast(dv, v.dtype))


def alltoall_backward(comm, prob, runner, q, k, v, o, lse, do, timer):
    """scheme "alltoall": q, k, v, o, L, dO of this rank's heads over the whole sequence, one single-device backward,
    and dQ, dK, dV back to the token shards."""
    xp, layout = prob.xp, prob.layout
    t0 = timer.mark()
    q_h, o_h, do_h, lse_h = heads_to_sequence(comm, [q, o, do, lse], prob.nq, layout, xp)
    k_h, v_h = heads_to_sequence(comm, [k, v], prob.nk, layout, xp)
    t1 = timer.mark()
    dq_h, dk_h, dv_h = runner.bwd(q_h, k_h, v_h, o_h, lse_h, do_h, scale=prob.scale, version=runner.version,
                                   **_head_options(prob))
    del q_h, k_h, v_h, o_h, lse_h, do_h
    t2 = timer.mark()
    dq, = sequence_to_heads(comm, [dq_h], prob.nq, layout, xp)
    dk, dv = sequence_to_heads(comm, [dk_h, dv_h], prob.nk, layout, xp)
    timer.add(0, (t1, t2), (t0, t1))
    timer.add(0, None, (t2, timer.mark()))  # the transfer back
    return dq, dk, dv
