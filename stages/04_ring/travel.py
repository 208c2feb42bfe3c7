"""Stage 04: what travels round the ring, and what a rank holds.

    Travel(comm, prob, k, v)      the backward's key block in two halves, each with its float32 dK, dV accumulators
    hop(todo, idx, P, home)       how many ranks a block moves after a step (steps without work are skipped)
    schedule(P, nq, nk, ...)      the steps with work, the hops and the bytes of each hop
    memory_per_token(H, Hkv, D, dtype)   what a rank holds per token of its shard, by buffer

The forward sends whole blocks (ring.py double-buffers them). The backward cannot: dK_j, dV_j must travel with K_j,
V_j, and the rank may send them on only once it has added its part. So the block is cut in two halves by key rows
(shards.halves): the rank computes with half 0 while half 1 is still arriving, then sends half 0 on while it computes
with half 1: every transfer hides behind the other half's compute.
"""
import numpy as np

from stages.common import cast

from . import candidates
from .compute import partial_dtype
from .shards import _runs, steps


def row_runs(rows):
    """[(a, b, at)]: a half's rows are rows a:b of the shard at position at of the half, run by run (layout's runs of
    consecutive rows: one per chunk), so halves are filled and emptied with slice copies."""
    return [(int(rows[e0]), int(rows[e0]) + e1 - e0, e0) for e0, e1 in _runs(rows) if e1 > e0]


def hop(todo, idx, P, home):
    """Ranks the block moves after step todo[idx]: to the next step with work, or (home=True, the gradients after
    the last step) back to the block's own rank; 0 = stays."""
    s = todo[idx]
    if idx + 1 < len(todo):
        return todo[idx + 1] - s
    return (P - s) % P if home else 0


class Travel:
    """The backward's key block on this rank, in halves (shards.halves): each half one contiguous slot of bytes holding
    the half's dK, dV accumulators (float32) then its K, V rows. arrive(h) waits for half h; depart(h, hop)
    sends it to rank r + hop while rank r - hop's half h arrives (the gradients only, on the way home). With one rank
    the block is the caller's own k, v and nothing travels.

    comm: this rank's communicator (comm.py). Two ways to move a half (SPARE): exchange it (comm.exchange) with a
    spare half-sized buffer that the arriving half lands in (the slot and the spare then swap buffers: one transfer,
    no copy, half a block more memory), or rotate it in place (comm.rotate, a method of every communicator class of
    comm.py, e.g. NcclRing.rotate: the bytes go through a staging buffer of 1/8 of them, chunk by chunk, and are
    copied back: the least memory, but a rotation is a chain of small transfers and copies, and on a GPU busy with the
    other half's kernels each of them waits for a free SM, so it can outlast that half's compute). The spare is the
    default."""
    SPARE = True

    def __init__(self, comm, prob, k, v):
        xp, self.comm = prob.xp, comm
        self.xp, self.rows = xp, prob.key_halves
        self.acc, self.dtype = partial_dtype(k.dtype), k.dtype
        self.shapes = [(prob.B, prob.Hkv, len(rows), prob.D) for rows in prob.key_halves]  # (B, Hkv, T_h, D)
        self.nbytes = max(self._sizes(shape)[-1] for shape in self.shapes)  # every slot the same size: they swap
        self.spare = xp.empty(self.nbytes, np.uint8) if self.SPARE and prob.P > 1 else None
        self.slots, self.pending = [], []
        for rows, shape in zip(prob.key_halves, self.shapes):
            slot = self._slot(xp.empty(self.nbytes, np.uint8), shape)  # [dK_h | dV_h | K_h | V_h]
            if candidates.on("fold"):  # measurement hook (candidates.py, off by default): one fill for both
                candidates.zero_grads_at_once(slot)
            else:
                slot["dk"][...] = 0  # dK_h = 0
                slot["dv"][...] = 0  # dV_h = 0
            if prob.P > 1:  # the rank's own rows of this half, copied into the slot that will travel
                for a, b, at in row_runs(rows):
                    slot["k"][:, :, at:at + b - a] = k[:, :, a:b]
                    slot["v"][:, :, at:at + b - a] = v[:, :, a:b]
            else:  # one rank: the caller's arrays, never sent
                slot["k"], slot["v"] = k, v
            self.slots.append(slot)
            self.pending.append(None)

    def _sizes(self, shape):
        """Byte offsets in a slot: [0, end of dK, end of dV, end of K, end of V]."""
        n = int(np.prod(shape))
        return [0] + np.cumsum([n * self.acc.itemsize] * 2 + [n * self.dtype.itemsize] * 2).tolist()

    def _slot(self, buf, shape):
        """The views of one slot's bytes: dk, dv, k, v, each (B, Hkv, T_h, D)."""
        at = self._sizes(shape)
        dts = [self.acc, self.acc, self.dtype, self.dtype]
        slot = {name: buf[at[i]:at[i + 1]].view(dt).reshape(shape) for i, (name, dt) in enumerate(zip(
            ("dk", "dv", "k", "v"), dts))}
        slot.update(bytes=buf, grad_bytes=at[2], size=at[-1])
        return slot

    def gradients(self, k, v):
        """dK_r, dV_r in k's dtype, from the halves (home after the last hop) back into the shard's row order."""
        dk, dv = self.xp.empty(k.shape, k.dtype), self.xp.empty(v.shape, v.dtype)
        for rows, slot, shape in zip(self.rows, self.slots, self.shapes):
            dk_h, dv_h = slot["dk"], slot["dv"]  # float32, (B, Hkv, T_h, D)
            if candidates.on("fold"):  # measurement hook (candidates.py, off by default): cast both in one pass
                dk_h, dv_h = candidates.cast_grads_at_once(slot, shape, self.acc, k.dtype)
            for a, b, at in row_runs(rows):  # a run of the half's rows: rows a:b of the shard (cast() is a no-op
                dk[:, :, a:b] = cast(dk_h[:, :, at:at + b - a], k.dtype)  # on rows the hook has cast already)
                dv[:, :, a:b] = cast(dv_h[:, :, at:at + b - a], v.dtype)
        return dk, dv

    def arrive(self, h):
        """Half h has landed here (GPU: the compute stream waits for it; the host does not)."""
        if self.pending[h] is not None:
            self.comm.wait(self.pending[h])
            self.pending[h] = None

    def depart(self, h, hop, grads_only=False):
        """Send half h on to rank r + hop (and receive rank r - hop's half h in its place), after the work queued on
        it so far."""
        slot = self.slots[h]
        n = slot["grad_bytes"] if grads_only else slot["size"]
        if not (hop and n):
            return
        if self.spare is None:
            self.pending[h] = self.comm.rotate(slot["bytes"][:n], hop)
            return
        arriving = self.spare  # the spare receives; the slot's own buffer is the spare once its bytes have left
        self.pending[h] = self.comm.exchange([slot["bytes"][:n]], [arriving[:n]], hop)
        self.spare = slot["bytes"]
        self.slots[h] = self._slot(arriving, self.shapes[h])


def schedule(P, nq, nk, *, layout="zigzag", causal=False, window=None, kv_shape=None, dtype=None):
    """What the ring will do, as a dict: the steps with work (shards.steps) out of P, the hops K, V make (forward
    and backward) and the hops the dK, dV accumulators make (backward; the last one takes them home), and, given
    one rank's K shard shape (B, Hkv, Tk, D) and dtype, the bytes of one hop: K and V, dK and dV (float32).
    Grouped-query k, v travel with their Hkv heads: H / Hkv times fewer bytes than H heads."""
    todo = steps(P, nq, nk, layout, causal, window)
    out = {"steps": todo, "of": P,
           "kv_hops": len(todo) - 1 + (1 if todo and todo[0] > 0 else 0) if todo else 0,
           "dkv_hops": len(todo) - 1 + (1 if todo and todo[-1] > 0 else 0) if todo else 0}
    if kv_shape is not None:
        n = int(np.prod(kv_shape))
        out["kv_bytes_per_hop"] = 2 * n * np.dtype(dtype).itemsize
        out["dkv_bytes_per_hop"] = 2 * n * partial_dtype(dtype).itemsize
    return out


def memory_per_token(H, Hkv, D, dtype):
    """What a rank of a ring of P >= 2 holds per token of its shard at its busiest moment (the backward's steps), in
    bytes, by buffer: [(buffer, bytes per token)]. The same for every P: a rank's memory follows its shard. One device
    holds per token of the whole sequence its inputs, o, a float32 dQ accumulator and the gradients, (4 H + 4 Hkv) D e
    + 4 H D bytes (e: the dtype's size), so a rank holds about sum(memory_per_token) / (P x that) of one device's
    peak: more than 1/P, because of the float32 accumulators and the block in flight (stage 04's README). A ring of
    one rank is one stages 02/03 call: one device's memory."""
    e, f = np.dtype(dtype).itemsize, partial_dtype(dtype).itemsize
    kv = 2 * Hkv * D  # K and V, or dK and dV, per token
    return [("q, k, v, dO shards (the caller's)", (2 * H * D + kv) * e),
            ("o, lse (the forward's result, kept for the backward)", H * D * e + 4 * H),
            ("dQ_r accumulator, float32", H * D * f),
            ("the block in halves: K, V and dK, dV (float32); two halves and a spare", 3 * kv * (e + f) // 2)]
