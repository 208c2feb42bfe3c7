"""Stage 04: P ranks as threads of ONE process (no MPI): the in-process ring of the notebook, the tests and
`stages.ring.forward/backward`. Each thread runs the very code an MPI rank runs; mailboxes stand in for the network.

    simulate(fn, P)              fn(comm) on P simulated ranks, their results in rank order (comm: that rank's
                                 communicator, a ThreadRing, what ring_forward takes as ring=)
    recorded(fn, P)              the same, and every array each rank received, in order (comm.LoopbackRing replays
                                 them: one rank alone then computes exactly what it computed in the ring)
"""
import queue
import threading

import numpy as np


def fixed_order_sum(every):
    """The sum of P ranks' arrays, added in rank order 0, 1, ..., P-1: every rank that adds the same arrays in the same
    order gets the same bits (an MPI Allreduce may round differently on different ranks)."""
    total = every[0].copy()
    for x in every[1:]:
        total += x
    return total


def pack(arrays):
    """One flat buffer of the arrays (all of one dtype, one array module): (flat, unpack), unpack(flat) -> list."""
    xp = np if isinstance(arrays[0], np.ndarray) else __import__("cupy")
    flat = xp.concatenate([a.reshape(-1) for a in arrays])  # (n,)

    def unpack(buf):
        out, at = [], 0
        for a in arrays:
            out.append(buf[at:at + a.size].reshape(a.shape))
            at += a.size
        return out

    return flat, unpack


class ThreadRing:
    """Rank `rank` of P ranks that are threads of one process: mailboxes instead of a network."""

    def __init__(self, rank, shared):
        self.rank, self.size, self.shared = rank, shared["P"], shared
        self.calls = 0

    def _get(self, box):
        while True:  # poll, so that one failed rank ends every rank instead of hanging them
            if self.shared["failed"].is_set():
                raise RuntimeError("another simulated rank failed")
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                pass

    def _box(self, rank, sender):
        with self.shared["cond"]:  # one FIFO per (receiver, sender), as MPI matches source and tag
            return self.shared["boxes"].setdefault((rank, sender), queue.Queue())

    def exchange(self, sends, recvs, shift=1):
        """Post copies of the sends to rank + shift's mailbox; wait() copies rank - shift's into recvs."""
        self._box((self.rank + shift) % self.size, self.rank).put([s.copy() for s in sends])
        return recvs, (self.rank - shift) % self.size

    def rotate(self, buf, shift=1):
        """Post a copy of buf to rank + shift's mailbox; wait() copies rank - shift's into buf."""
        return self.exchange([buf], [buf], shift)

    def wait(self, handle):
        recvs, src = handle
        for r, got in zip(recvs, self._get(self._box(self.rank, src))):
            r[...] = got

    def allgather(self, obj):
        sh, gen = self.shared, self.calls
        self.calls += 1
        with sh["cond"]:
            slot = sh["gathers"].setdefault(gen, [None] * self.size)  # one list per allgather call
            slot[self.rank] = (obj,)
            sh["cond"].notify_all()
            while any(x is None for x in slot):  # wait for every rank, or for a failed one
                if sh["failed"].is_set():
                    raise RuntimeError("another simulated rank failed")
                sh["cond"].wait(0.05)
        return [x[0] for x in slot]

    def allreduce_sum(self, arrays):
        """Every rank's arrays (host copies), added in rank order: the same bits on every rank."""
        if self.size == 1:
            return list(arrays)
        from stages.common import to_numpy

        xp = np if isinstance(arrays[0], np.ndarray) else __import__("cupy")
        flat, unpack = pack(arrays)
        every = self.allgather(to_numpy(flat))
        return unpack(xp.asarray(fixed_order_sum(every)))


def simulate(fn, P):
    """Run fn(comm) for P simulated ranks (threads), comm each rank's ThreadRing, and return their results in rank
    order.

    The first exception on any rank is re-raised here; the other ranks stop instead of hanging.
    """
    shared = {"P": P, "boxes": {}, "gathers": {}, "cond": threading.Condition(), "failed": threading.Event()}
    results, errors = [None] * P, [None] * P

    def body(rank):
        try:
            results[rank] = fn(ThreadRing(rank, shared))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[rank] = e
            shared["failed"].set()  # the other ranks stop at their next receive or gather

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and "another simulated rank failed" not in str(e)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class Recording:
    """A communicator that passes everything to `inner` and keeps a copy of every array this rank receives, in the
    order its waits complete (received)."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.received = inner, inner.rank, inner.size, []

    def exchange(self, sends, recvs, shift=1):
        return self.inner.exchange(sends, recvs, shift), list(recvs)

    def rotate(self, buf, shift=1):
        return self.inner.rotate(buf, shift), [buf]

    def wait(self, handle):
        inner, recvs = handle
        self.inner.wait(inner)
        self.received.extend(r.copy() for r in recvs)

    def allgather(self, obj):
        return self.inner.allgather(obj)

    def allreduce_sum(self, arrays):
        return self.inner.allreduce_sum(arrays)


def recorded(fn, P):
    """(results, received): simulate(fn, P), and for each rank the arrays it received, in order."""
    rings = [None] * P

    def body(ring):
        rings[ring.rank] = Recording(ring)
        return fn(rings[ring.rank])

    results = simulate(body, P)
    return results, [ring.received for ring in rings]
