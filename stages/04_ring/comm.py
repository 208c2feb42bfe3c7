"""Stage 04: how blocks move around the ring. One small interface, five communicators.

MPI and NCCL in ten lines, for the ring:
  * `mpirun -n P python script.py` starts P copies of one program, the ranks. Each asks MPI's world communicator
    (mpi4py: MPI.COMM_WORLD) for its number r = Get_rank() and for P = Get_size(), and works on its own share.
  * Ranks share no memory: data moves only as messages. Every send to rank d is matched by a receive on rank d from
    the sender, of the same size.
  * A send may wait until its receiver has posted the matching receive. In a ring every rank sends to r + 1 and
    receives from r - 1 at once: if each rank first sends and only then receives, each waits for the next forever (a
    deadlock). So both are posted together: non-blocking (MPI Isend and Irecv, then Waitall) or in one group
    (NCCL's groupStart ... groupEnd), and the library matches them in any order.
  * NCCL moves GPU memory directly (NVLink, or the network between nodes); its sends and receives are queued on a
    CUDA stream, like kernels. MPI (mpi4py) starts the ranks, moves host memory, and broadcasts NCCL's unique id so
    that the ranks can open one NCCL communicator.

The interface. comm below is this rank's communicator, an instance of one of the classes of this file (the ring's
functions take it as `ring=`; the methods are the classes', e.g. NcclRing.exchange, not functions of this module):

    comm.rank, comm.size             this process's place in the ring
    h = comm.exchange(sends, recvs, shift=1)  each array of sends goes to rank + shift, rank - shift's arrive in recvs
    h = comm.rotate(buf, shift=1)    IN PLACE: this rank's bytes of buf go to rank + shift, and rank - shift's bytes
                                     replace them
    comm.wait(h)                     the transfer has landed (GPU backends: the compute stream waits); transfers are
                                     non-blocking where the backend can (a GPU stream) and arrive in the order started
    comm.allgather(obj)              every rank's obj, as a list (the agreement checks)
    comm.allreduce_sum(arrays)       the arrays summed over the ranks, the same bits on every rank (stage 05's
                                     parameter gradients)

The ring's forward exchanges whole blocks: the block in use goes on while the next one lands in a second buffer. The
backward's halves carry float32 dK, dV as well; each half lands in a spare half (exchange), or, for the least memory,
rotates in place (rotate): where the network cannot send and receive the same bytes at once (NCCL), a rotation goes a
chunk at a time through a small staging buffer: send chunk c to rank + shift while rank - shift's chunk c lands in the
staging buffer, then copy it over chunk c.

    nccl      one GPU per rank: cupy.cuda.nccl send/recv, grouped, on a stream of its own. The compute stream
              records an event before each transfer (the bytes are ready) and waits on the transfer's event before
              using what arrived, so a half block travels while the other half is computed, and the host never blocks.
    mpi       CuPy arrays staged through host memory with MPI: works with more ranks than GPUs (4 ranks on 1 GPU),
              slower: device -> host, MPI, host -> device. exchange() copies the sends to the host (which waits for the
              compute queued before it) and posts non-blocking Isend/Irecv; wait() blocks the host in Waitall, then
              queues the copies back. The MPI transfer can overlap the GPU's compute queued in between; the copies
              to and from the host do not, and a rotation overlaps nothing.
    numpy     numpy arrays on the CPU with MPI: any laptop, no GPU. Isend/Irecv are posted before the compute and
              waited for after it; how much of a transfer moves during the compute is the MPI library's affair (many
              move a large message only inside an MPI call, here the Waitall).
    threads   P ranks as threads of ONE process (threads.py): the notebook, the tests, `stages.ring.forward/backward`.
    loopback  rank r of P alone on one device: that rank's exact schedule with no peer (LoopbackRing), so a rank's own
              cost is measured on one GPU (dev/bench_rank.py).
launch.py picks the backend with every rank, maps ranks to GPUs and ends the job on an error; setup() below picks
the backend (launch.select) and makes that backend's communicator.
"""
import numpy as np

from stages.common import to_numpy

from .launch import (  # noqa: F401 - the launch helpers, reached as comm.X by the launchers
    BACKENDS, BackendError, abort, choose_backend, gpus_in_use, local_rank, quiet_barrier, run_main, select, world,
    _nccl_module,
)
from .threads import fixed_order_sum, pack, simulate  # noqa: F401


def _bytes(a):
    """A flat uint8 view of a contiguous array (MPI and NCCL move bytes; bfloat16 has no MPI type)."""
    return a.reshape(-1).view(np.uint8)


MAX_MPI_BYTES = 1 << 30  # MPI counts are C ints: a rotation of more bytes goes in pieces


class NumpyRing:
    """numpy arrays on the CPU; MPI_Sendrecv_replace rotates a buffer in place (MPI keeps its own staging)."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self._sending = []  # send requests still in flight: their buffers may be received into only once they are done

    def _sendrecv_replace(self, host, shift):
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        for at in range(0, host.size, MAX_MPI_BYTES):
            self.comm.Sendrecv_replace(host[at:at + MAX_MPI_BYTES], dest=dst, sendtag=7, source=src, recvtag=7)

    def exchange(self, sends, recvs, shift=1):
        """Post sends to rank + shift and receives from rank - shift (shift 1: the ring's neighbours). A buffer that
        an earlier exchange sends from may be a receive buffer here (as on a GPU stream, where transfers run in the
        order they were posted): the earlier sends are finished first."""
        from mpi4py import MPI

        MPI.Request.Waitall(self._sending)
        reqs, self._sending = [], []
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        for i, (s, r) in enumerate(zip(sends, recvs)):
            reqs.append(self.comm.Irecv(_bytes(r), source=src, tag=i))
            self._sending.append(self.comm.Isend(_bytes(s), dest=dst, tag=i))
        return reqs + self._sending

    def rotate(self, buf, shift=1):
        """buf (1-D uint8, contiguous): rank + shift gets our bytes, we get rank - shift's. Done on return."""
        self._sendrecv_replace(buf, shift)

    def wait(self, handle):
        """The receives of exchange() have landed (rotate() returns done: None)."""
        if handle is not None:
            from mpi4py import MPI

            MPI.Request.Waitall(handle)

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def allreduce_sum(self, arrays):
        """The arrays summed over the ranks: gathered to every rank (a typed Allgather of one flat host buffer) and
        added in rank order, so every rank gets the same bits."""
        if self.size == 1:
            return list(arrays)
        xp = np if isinstance(arrays[0], np.ndarray) else __import__("cupy")
        flat = np.ascontiguousarray(to_numpy(pack(arrays)[0]))  # (n,) on the host
        every = np.empty((self.size, flat.size), flat.dtype)
        self.comm.Allgather(flat, every)
        return pack(arrays)[1](xp.asarray(fixed_order_sum(list(every))))


class MpiRing(NumpyRing):
    """CuPy arrays staged through the host: device -> host, MPI_Sendrecv_replace, host -> device.

    rotate() copies the bytes to the host (this waits for the compute queued before it), exchanges them and copies
    the neighbour's back: no overlap with the GPU's work, but more ranks than GPUs work.
    """

    def exchange(self, sends, recvs, shift=1):
        """Copies the sends to the host (this waits for the compute queued before it) and posts the MPI calls; wait()
        blocks the host in MPI, then queues the host -> device copies."""
        host_sends = [_bytes(s).get() for s in sends]  # (nbytes,) uint8 on the host
        host_recvs = [np.empty(r.nbytes, np.uint8) for r in recvs]
        return super().exchange(host_sends, host_recvs, shift), host_sends, host_recvs, recvs

    def rotate(self, buf, shift=1):
        host = buf.get()  # (nbytes,) uint8 on the host, after the kernels that wrote buf
        self._sendrecv_replace(host, shift)
        buf.set(host)  # host -> device on the compute stream

    def wait(self, handle):
        if handle is None:
            return
        from mpi4py import MPI

        reqs, _, host_recvs, recvs = handle
        MPI.Request.Waitall(reqs)  # the host arrays stay referenced by handle until here
        for hr, r in zip(host_recvs, recvs):
            _bytes(r).set(hr)  # host -> device on the compute stream


class _TransferStream:
    """Transfers on a CUDA stream of their own, ordered by events: the transfer stream waits for the compute queued so
    far (what it sends is written, what it overwrites is no longer read), and wait(handle) makes the compute stream
    wait for the transfer (the host never blocks)."""

    def _stream(self):
        import cupy

        if getattr(self, "stream", None) is None:
            # High priority: when a compute kernel's block ends, the scheduler starts the transfer's blocks before the
            # next compute block, instead of after the whole kernel. (CUDA clamps a priority to its range [0, -5 or
            # so], lower is higher: -100 is the highest the GPU has.)
            self.stream = cupy.cuda.Stream(non_blocking=True, priority=-100)
        return self.stream

    def _after_compute(self):
        import cupy

        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self._stream().wait_event(ready)

    def _done(self, *keep):
        import cupy

        done = cupy.cuda.Event(disable_timing=True)
        done.record(self._stream())
        return (done, *keep)  # keep the buffers referenced until the transfer is waited on

    def wait(self, handle):
        import cupy

        cupy.cuda.get_current_stream().wait_event(handle[0])  # the GPU waits; the host runs on


class NcclRing(_TransferStream):
    """One GPU per rank: NCCL send/recv grouped on a dedicated stream, ordered by events."""

    MIN_CHUNK = 8 << 20  # bytes: smaller pieces would cost more in launches than they save in staging memory
    CHUNKS = 8  # a rotation in this many pieces: the staging buffer is 1/8 of the bytes in flight

    def __init__(self, comm):
        nccl = _nccl_module()
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)  # the NCCL id travels over MPI
        self.nccl = nccl
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._stream()  # transfers overlap the compute stream's kernels

    def exchange(self, sends, recvs, shift=1):
        """Post sends to rank + shift and receives from rank - shift, grouped, on the transfer stream."""
        self._after_compute()
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        # One group: NCCL's send waits for the peer's matching recv, and every rank sends first, so ungrouped the ranks
        # would wait on each other forever; grouped, NCCL starts this rank's sends and receives together.
        self.nccl.groupStart()
        for s, r in zip(sends, recvs):
            self.nc.send(s.data.ptr, s.nbytes, self.nccl.NCCL_INT8, dst, self.stream.ptr)
            self.nc.recv(r.data.ptr, r.nbytes, self.nccl.NCCL_INT8, src, self.stream.ptr)
        self.nccl.groupEnd()
        return self._done(sends, recvs)

    def rotate(self, buf, shift=1):
        """Post the in-place rotation of buf (1-D uint8) on the transfer stream, after the compute stream's work so
        far; returns (event, buf, staging) for wait(). One stream: transfers run in the order they were posted."""
        import cupy

        self._after_compute()
        n = buf.nbytes
        chunk = min(n, max(self.MIN_CHUNK, -(-n // self.CHUNKS)))
        stage = cupy.empty(chunk, np.uint8)
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        for at in range(0, n, chunk):
            size = min(chunk, n - at)
            self.nccl.groupStart()  # one group, as in exchange(): our send to dst and our receive from src together
            self.nc.send(buf.data.ptr + at, size, self.nccl.NCCL_INT8, dst, self.stream.ptr)
            self.nc.recv(stage.data.ptr, size, self.nccl.NCCL_INT8, src, self.stream.ptr)
            self.nccl.groupEnd()
            cupy.cuda.runtime.memcpyAsync(buf.data.ptr + at, stage.data.ptr, size,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)  # chunk sent: refill
        return self._done(buf, stage)

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def allreduce_sum(self, arrays):
        """The arrays (CuPy, one dtype) summed over the ranks on the GPUs: one NCCL all-reduce of one flat buffer,
        on the compute stream. NCCL gives every rank the same result bits (each reduced piece is computed once and
        then copied to every rank)."""
        import cupy

        if self.size == 1:
            return list(arrays)
        flat, unpack = pack(arrays)
        kind = {np.dtype(np.float32): self.nccl.NCCL_FLOAT32, np.dtype(np.float64): self.nccl.NCCL_FLOAT64}
        if flat.dtype not in kind:
            raise TypeError(f"allreduce_sum: NCCL sums float32 or float64 here, got {flat.dtype}")
        self.nc.allReduce(flat.data.ptr, flat.data.ptr, flat.size, kind[flat.dtype], self.nccl.NCCL_SUM,
                          cupy.cuda.get_current_stream().ptr)
        return unpack(flat)


class LoopbackRing(_TransferStream):
    """Rank `rank` of a ring of `size` ranks, alone on one device (a GPU for CuPy arrays, the CPU for numpy ones). It
    runs that rank's exact schedule, its block calls, merges, buffers and copies, with no peer, so a rank's own cost is
    measured on one GPU (dev/bench_rank.py); what a real ring adds on top is the network's.

        mode "copy"    each exchange copies the sends into the receives (GPU: device copies on a transfer stream of
                       their own, ordered by events as NCCL's transfers are); a rotation copies the bytes through a
                       staging buffer and back, chunk by chunk, as NcclRing's. The rank meets its own K, V at every
                       step: the same work on other values.
        mode "none"    no bytes move (the receives keep what they held); the transfer stream's events and the waits
                       stay.
        mode "replay"  the receives get, in order, the arrays a real ring delivered to this rank (`received`, from
                       threads.recorded), so the rank computes exactly what it computed in that ring: a check.
    allgather(obj) answers as if every rank had passed obj; allreduce_sum(arrays) as if every rank held these arrays.
    """
    MODES = ("copy", "none", "replay")

    def __init__(self, rank, size, mode="copy", received=None):
        if mode not in self.MODES:
            raise ValueError(f"LoopbackRing: mode {mode!r} is not one of {self.MODES}")
        if not 0 <= rank < size:
            raise ValueError(f"LoopbackRing: rank {rank} is not a rank of a ring of {size}")
        if (mode == "replay") != (received is not None):
            raise ValueError("LoopbackRing: mode 'replay' takes the arrays to replay (received=), no other mode does")
        self.rank, self.size, self.mode, self.stream = rank, size, mode, None
        self.replay = iter(received or ())

    def exchange(self, sends, recvs, shift=1):
        if self.mode == "replay" or isinstance(sends[0], np.ndarray):
            if self.mode == "copy":
                for s, r in zip(sends, recvs):
                    _bytes(r)[...] = _bytes(s)
            return None if self.mode != "replay" else list(recvs)
        import cupy

        self._after_compute()
        if self.mode == "copy":
            for s, r in zip(sends, recvs):
                cupy.cuda.runtime.memcpyAsync(r.data.ptr, s.data.ptr, s.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                              self.stream.ptr)
        return self._done(sends, recvs)

    def rotate(self, buf, shift=1):
        if self.mode == "replay" or isinstance(buf, np.ndarray):
            return [buf] if self.mode == "replay" else None  # copy on the CPU: the bytes come back as they were
        import cupy

        self._after_compute()
        n = buf.nbytes
        chunk = min(n, max(NcclRing.MIN_CHUNK, -(-n // NcclRing.CHUNKS)))  # NcclRing's staging buffer
        stage = cupy.empty(chunk, np.uint8)
        if self.mode == "copy":
            for at in range(0, n, chunk):  # each chunk out to the staging buffer and back, as NCCL's rotation does
                size = min(chunk, n - at)
                for dst, src in ((stage.data.ptr, buf.data.ptr + at), (buf.data.ptr + at, stage.data.ptr)):
                    cupy.cuda.runtime.memcpyAsync(dst, src, size, cupy.cuda.runtime.memcpyDeviceToDevice,
                                                  self.stream.ptr)
        return self._done(buf, stage)

    def wait(self, handle):
        if handle is None:
            return
        if self.mode == "replay":
            for r in handle:
                _bytes(r)[...] = _bytes(next(self.replay))  # (on the compute stream: a check, not timed)
            return
        super().wait(handle)

    def allgather(self, obj):
        return [obj] * self.size

    def allreduce_sum(self, arrays):
        return [a * self.size for a in arrays]


RINGS = {"nccl": NcclRing, "mpi": MpiRing, "numpy": NumpyRing}  # backend -> communicator class over MPI


def setup(requested="auto", comm=None):
    """(ring, backend, reason): launch.select(), then this backend's communicator over `comm` (default: every rank)."""
    comm = comm or world()
    backend, reason = select(requested, comm)
    return RINGS[backend](comm), backend, reason
