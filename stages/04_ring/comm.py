"""Stage 04: how blocks move around the ring. One small interface, four backends.

    ring.rank, ring.size             this process's place in the ring
    h = ring.exchange(sends, recvs, shift=1)  each array of sends goes to rank + shift, rank - shift's arrive in recvs
    h = ring.rotate(buf, shift=1)    IN PLACE: this rank's bytes of buf go to rank + shift, and rank - shift's bytes
                                     replace them
    ring.wait(h)                     the transfer has landed (GPU backends: the compute stream waits); transfers are
                                     non-blocking where the backend can (a GPU stream) and arrive in the order started
    ring.allgather(obj)              every rank's obj, as a list (the agreement checks)
    ring.allreduce_sum(arrays)       the arrays summed over the ranks, the same bits on every rank (stage 05's
                                     parameter gradients)

The forward exchanges whole blocks: the block in use goes on while the next one lands in a second buffer. The
backward's blocks carry float32 dK, dV as well, and travel by rotation, in place, so that a block in flight costs no
second copy of itself: the ring's memory per GPU is its shards, its accumulators and one travelling block. Where the
network cannot send and receive the same bytes at once (NCCL), a rotation goes a chunk at a time through a small
staging buffer: send chunk c to rank + shift while rank - shift's chunk c lands in the staging buffer, then copy it
over chunk c.

    nccl     one GPU per rank: cupy.cuda.nccl send/recv, grouped, on a stream of its own. The compute stream
             records an event before each rotation (the bytes are ready) and waits on the rotation's event before
             using what arrived, so a half block travels while the other half is computed, and the host never blocks.
    mpi      CuPy arrays staged through host memory with MPI_Sendrecv_replace: works with more ranks than GPUs
             (4 ranks on 1 GPU), slower (device -> host -> MPI -> host -> device, and no overlap).
    numpy    numpy arrays on the CPU with MPI_Sendrecv_replace: any laptop, no GPU.
    threads  P ranks as threads of ONE process (no MPI): the in-process simulation used by the notebook,
             the tests and `stages.ring.forward/backward`.

mpi4py launches (mpirun), broadcasts the NCCL unique id and runs the checks. Ranks map to GPUs by
their LOCAL rank (MPI shared-memory split), so `mpirun -n 8 --hostfile hosts` on two 4-GPU nodes
gives each process its own GPU on its own node.
"""
import os
import queue
import sys
import threading
import time

import numpy as np

BACKENDS = ("auto", "nccl", "mpi", "numpy")


def _bytes(a):
    """A flat uint8 view of a contiguous array (MPI and NCCL move bytes; bfloat16 has no MPI type)."""
    return a.reshape(-1).view(np.uint8)


# ----------------------------------------------------------------------------- MPI side
def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def local_rank(comm):
    """(local rank, ranks on this node) from a shared-memory split: the GPU index to use."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    out = node.Get_rank(), node.Get_size()
    node.Free()
    return out


def _gpu_count():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, no device
        return 0


def _nccl_module():
    """cupy.cuda.nccl, or None. CuPy finds libnccl from the system or its own config; if it did not, load
    the nvidia-nccl wheel's copy (which PyTorch installs too) and import CuPy's NCCL binding once more."""
    try:
        from cupy.cuda import nccl

        if getattr(nccl, "available", True):
            return nccl
    except Exception:  # no CuPy at all
        return None
    try:
        import ctypes
        import glob

        import nvidia  # namespace package of the NVIDIA wheels: nvidia/nccl/lib/libnccl.so.2 (cu12, cu13)

        libs = sorted(p for d in nvidia.__path__ for p in glob.glob(os.path.join(d, "**", "libnccl.so*"),
                                                                       recursive=True))
        if libs:
            ctypes.CDLL(libs[0], mode=ctypes.RTLD_GLOBAL)  # the binding below finds it by its soname
            from cupy_backends.cuda.libs import nccl  # what cupy.cuda.nccl re-exports

            return nccl
    except Exception:
        pass
    return None


def _host_name():
    from mpi4py import MPI

    return MPI.Get_processor_name()


def _my_gpu(lrank):
    """(GPU index, PCI bus id) this rank will use: local rank modulo the GPUs it sees."""
    import cupy

    dev = lrank % cupy.cuda.runtime.getDeviceCount()
    try:
        bus = cupy.cuda.Device(dev).pci_bus_id
    except Exception:  # an old CuPy: fall back to the index (wrong only under per-rank CUDA_VISIBLE_DEVICES)
        bus = f"device {dev}"
    return dev, bus


def _gpu_id(lrank):
    """(host, PCI bus id) of the GPU this rank will use: one physical GPU, whatever index the rank sees it by."""
    return _host_name(), _my_gpu(lrank)[1]


def choose_backend(comm, requested="auto"):
    """The backend every rank will use, and why. Decided from all ranks' facts, so all agree.

    "One GPU per rank" is decided from the GPUs' PCI bus ids on each host, so it also holds when a launcher
    (SLURM, a wrapper script) gives each rank its own CUDA_VISIBLE_DEVICES."""
    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is not known; use one of {BACKENDS}")
    lrank, _ = local_rank(comm)
    gpus = _gpu_count()
    gpu_id = _gpu_id(lrank) if gpus else None
    facts = comm.allgather((gpus, gpu_id, gpus > 0 and requested in ("auto", "nccl") and _nccl_module() is not None))
    every_gpu = all(g > 0 for g, _, _ in facts)
    ids = [i for _, i, _ in facts]
    one_each = every_gpu and len(set(ids)) == len(ids)  # no two ranks on one physical GPU
    nccl_ok = all(n for _, _, n in facts)
    shared = max(ids.count(i) for i in ids) if every_gpu else 0
    if requested == "auto":
        if not every_gpu:
            return "numpy", "no CUDA GPU (CuPy sees none) on some rank: numpy arrays on the CPU"
        if one_each and nccl_ok and comm.Get_size() > 1:
            return "nccl", f"{comm.Get_size()} ranks, one GPU each: NCCL send/recv"
        why = ("a single rank" if comm.Get_size() == 1 else f"up to {shared} ranks share one GPU" if not one_each
               else "NCCL is not available to CuPy")
        return "mpi", f"{why}: CuPy arrays staged through the host"
    if requested in ("nccl", "mpi") and not every_gpu:
        raise RuntimeError(f"--backend {requested} needs a CUDA GPU on every rank; CuPy sees none on some "
                           "rank: use --backend numpy")
    if requested == "nccl" and not one_each:
        raise RuntimeError(f"--backend nccl needs one GPU per rank, but up to {shared} ranks share one GPU "
                           "(NCCL refuses two ranks on one GPU): use --backend mpi, or start fewer ranks per node")
    if requested == "nccl" and not nccl_ok:
        raise RuntimeError("--backend nccl: CuPy cannot load NCCL (pip install nvidia-nccl-cu12, or -cu13 for "
                           "CUDA 13, or put libnccl.so.2 on LD_LIBRARY_PATH); use --backend mpi")
    return requested, "as asked"


def gpus_in_use(comm):
    """How many GPUs the ranks of comm compute on: distinct (host, PCI bus id) pairs, so that ranks on several nodes,
    or each given its own CUDA_VISIBLE_DEVICES, are counted right. Every rank calls it (an allgather)."""
    return len(set(comm.allgather(_gpu_id(local_rank(comm)[0]))))


def select(requested="auto", comm=None):
    """(backend, reason): pick the backend with every rank, and put this rank on its GPU (GPU backends)."""
    comm = comm or world()
    backend, reason = choose_backend(comm, requested)
    if backend in ("nccl", "mpi"):
        import cupy

        dev, _ = _my_gpu(local_rank(comm)[0])
        cupy.cuda.Device(dev).use()  # local rank -> GPU (before NCCL is initialised: it binds to this GPU)
    return backend, reason


def setup(requested="auto", comm=None):
    """(ring, backend, reason): select(), then this backend's communicator over `comm` (default: every rank)."""
    comm = comm or world()
    backend, reason = select(requested, comm)
    return RINGS[backend](comm), backend, reason


def quiet_barrier(comm, poll_s=0.005):
    """A barrier that sleeps instead of spinning: ranks waiting here leave the cores to the rank still
    working (MPI's own Barrier busy-polls, which would slow a timing taken on a shared CPU or GPU)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


ABORT_GRACE_S = 1.0  # seconds between printing the error and MPI_Abort: mpirun forwards the text first


def abort(exc, comm=None, trace=""):
    """Print the error with the rank and end the WHOLE job: the other ranks may be blocked in a receive
    that will never come, and an uncaught exception would leave them hanging there."""
    comm = comm or world()
    sys.stdout.flush()
    sys.stderr.write(f"{trace}[rank {comm.Get_rank()}] ERROR: {type(exc).__name__}: {exc}\n")  # one write
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)  # MPI_Abort kills every process at once: let mpirun forward this rank's output
    comm.Abort(1)


def run_main(main, everywhere=()):
    """Exit with main()'s status on this rank; an error on one rank ends the whole job (abort) instead of leaving the
    other ranks blocked in a transfer. Errors of the types in `everywhere` are raised on every rank at once: each rank
    prints its own before the job ends. SystemExit (argparse's --help or a bad option) exits as usual."""
    try:
        status = main()
    except SystemExit:
        raise
    except everywhere as e:
        world().Barrier()  # every rank has reached this point (and printed) before the abort
        abort(e)
    except BaseException as e:
        import traceback

        abort(e, trace=traceback.format_exc())
    else:
        sys.exit(status)
    os._exit(1)  # MPI_Abort returned (some MPIs do, while mpirun tears the job down): never exit 0


def fixed_order_sum(every):
    """The sum of P ranks' arrays, added in rank order 0, 1, ..., P-1: every rank that adds the same arrays in the same
    order gets the same bits (an MPI Allreduce may round differently on different ranks)."""
    total = every[0].copy()
    for x in every[1:]:
        total += x
    return total


def _pack(arrays):
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
        from stages.common import to_numpy

        xp = np if isinstance(arrays[0], np.ndarray) else __import__("cupy")
        flat = np.ascontiguousarray(to_numpy(_pack(arrays)[0]))  # (n,) on the host
        every = np.empty((self.size, flat.size), flat.dtype)
        self.comm.Allgather(flat, every)
        return _pack(arrays)[1](xp.asarray(fixed_order_sum(list(every))))


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


class NcclRing:
    """One GPU per rank: NCCL send/recv grouped on a dedicated stream, ordered by events."""

    MIN_CHUNK = 8 << 20  # bytes: smaller pieces would cost more in launches than they save in staging memory
    CHUNKS = 8  # a rotation in this many pieces: the staging buffer is 1/8 of the bytes in flight

    def __init__(self, comm):
        import cupy

        nccl = _nccl_module()
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)  # the NCCL id travels over MPI
        self.nccl = nccl
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)
        # Transfers overlap the compute stream's kernels. High priority: when a compute kernel's block ends, the
        # scheduler starts NCCL's blocks before the next compute block, instead of after the whole kernel.
        # (CUDA clamps a priority to its range [0, -5 or so], lower is higher: -100 is the highest the GPU has.)
        self.stream = cupy.cuda.Stream(non_blocking=True, priority=-100)

    def _after_compute(self):
        """The transfer stream waits for the work queued on the compute stream so far (what it sends is written, what
        it overwrites is no longer read)."""
        import cupy

        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(ready)

    def _done(self, *keep):
        import cupy

        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return (done, *keep)  # keep the buffers referenced until the transfer is waited on

    def exchange(self, sends, recvs, shift=1):
        """Post sends to rank + shift and receives from rank - shift, grouped, on the transfer stream."""
        self._after_compute()
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        self.nccl.groupStart()  # one group: every rank's send to r+shift pairs with r+shift's recv from r
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
            self.nccl.groupStart()  # one group: our send to dst pairs with dst's receive from us
            self.nc.send(buf.data.ptr + at, size, self.nccl.NCCL_INT8, dst, self.stream.ptr)
            self.nc.recv(stage.data.ptr, size, self.nccl.NCCL_INT8, src, self.stream.ptr)
            self.nccl.groupEnd()
            cupy.cuda.runtime.memcpyAsync(buf.data.ptr + at, stage.data.ptr, size,
                                          cupy.cuda.runtime.memcpyDeviceToDevice, self.stream.ptr)  # chunk sent: refill
        return self._done(buf, stage)

    def wait(self, handle):
        import cupy

        cupy.cuda.get_current_stream().wait_event(handle[0])  # the GPU waits; the host runs on

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def allreduce_sum(self, arrays):
        """The arrays (CuPy, one dtype) summed over the ranks on the GPUs: one NCCL all-reduce of one flat buffer,
        on the compute stream. NCCL gives every rank the same result bits (each reduced piece is computed once and
        then copied to every rank)."""
        import cupy

        if self.size == 1:
            return list(arrays)
        flat, unpack = _pack(arrays)
        kind = {np.dtype(np.float32): self.nccl.NCCL_FLOAT32, np.dtype(np.float64): self.nccl.NCCL_FLOAT64}
        if flat.dtype not in kind:
            raise TypeError(f"allreduce_sum: NCCL sums float32 or float64 here, got {flat.dtype}")
        self.nc.allReduce(flat.data.ptr, flat.data.ptr, flat.size, kind[flat.dtype], self.nccl.NCCL_SUM,
                          cupy.cuda.get_current_stream().ptr)
        return unpack(flat)


RINGS = {"nccl": NcclRing, "mpi": MpiRing, "numpy": NumpyRing}  # backend -> communicator class


# ----------------------------------------------------------------------------- in-process simulation
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
        flat, unpack = _pack(arrays)
        every = self.allgather(to_numpy(flat))
        return unpack(xp.asarray(fixed_order_sum(every)))


def simulate(fn, P):
    """Run fn(ring) for P simulated ranks (threads) and return their results in rank order.

    The first exception on any rank is re-raised here; the other ranks stop instead of hanging.
    """
    shared = {"P": P, "boxes": {}, "gathers": {}, "cond": threading.Condition(),
              "failed": threading.Event()}
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

