"""Stage 04: how blocks move around the ring. One small interface, four backends.

    ring.rank, ring.size             this process's place in the ring
    h = ring.start(sends, recvs, tag=0)  send each array to rank+1, receive each buffer from rank-1 (non-blocking);
                                     transfers of one tag arrive in the order they were started
    ring.wait(h)                     the receives have landed (GPU backends: the compute stream waits)
    ring.allgather(obj)              every rank's obj, as a list (the agreement checks)

    nccl     one GPU per rank: cupy.cuda.nccl send/recv, grouped, on a stream of its own. The compute
             stream records an event before each transfer (its buffers are ready) and waits on the
             transfer's event before using what arrived, so the next block is in flight while the
             current one is computed, and the host never blocks.
    mpi      CuPy arrays staged through host memory with mpi4py Isend/Irecv: works with more ranks than
             GPUs (4 ranks on 1 GPU), slower (device -> host -> MPI -> host -> device).
    numpy    numpy arrays on the CPU with mpi4py Isend/Irecv: any laptop, no GPU.
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


def choose_backend(comm, requested="auto"):
    """The backend every rank will use, and why. Decided from all ranks' facts, so all agree.

    "One GPU per rank" is decided from the GPUs' PCI bus ids on each host, so it also holds when a launcher
    (SLURM, a wrapper script) gives each rank its own CUDA_VISIBLE_DEVICES."""
    if requested not in BACKENDS:
        raise ValueError(f"backend {requested!r} is not known; use one of {BACKENDS}")
    lrank, _ = local_rank(comm)
    gpus = _gpu_count()
    gpu_id = (_host_name(), _my_gpu(lrank)[1]) if gpus else None
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


class NumpyRing:
    """numpy arrays, mpi4py non-blocking point-to-point."""

    def __init__(self, comm):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()

    def start(self, sends, recvs, tag=0, shift=1):
        """Post sends to rank + shift and receives from rank - shift (shift 1: the ring's neighbours)."""
        reqs = []
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        for i, (s, r) in enumerate(zip(sends, recvs)):
            reqs.append(self.comm.Irecv(_bytes(r), source=src, tag=8 * tag + i))
            reqs.append(self.comm.Isend(_bytes(s), dest=dst, tag=8 * tag + i))
        return reqs

    def wait(self, reqs):
        from mpi4py import MPI

        MPI.Request.Waitall(reqs)

    def allgather(self, obj):
        return self.comm.allgather(obj)


class MpiRing(NumpyRing):
    """CuPy arrays staged through the host: device -> host, MPI, host -> device.

    start() copies the sends to the host (this waits for the compute queued before it) and posts the
    MPI calls; the next block's kernels are then queued on the GPU, and wait() blocks the host in MPI
    while they run, then queues the host -> device copies behind them. More ranks than GPUs work.
    """

    def start(self, sends, recvs, tag=0, shift=1):
        host_sends = [_bytes(s).get() for s in sends]  # (nbytes,) uint8 on the host
        host_recvs = [np.empty(r.nbytes, np.uint8) for r in recvs]
        return super().start(host_sends, host_recvs, tag, shift), host_sends, host_recvs, recvs

    def wait(self, handle):
        from mpi4py import MPI

        reqs, _, host_recvs, recvs = handle
        MPI.Request.Waitall(reqs)  # the host arrays stay referenced by handle until here
        for hr, r in zip(host_recvs, recvs):
            _bytes(r).set(hr)  # host -> device on the compute stream


class NcclRing:
    """One GPU per rank: NCCL send/recv grouped on a dedicated stream, ordered by events."""

    def __init__(self, comm):
        import cupy

        nccl = _nccl_module()
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)  # the NCCL id travels over MPI
        self.nccl = nccl
        self.nc = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)  # transfers overlap the compute stream's kernels

    def start(self, sends, recvs, tag=0, shift=1):  # one stream: every transfer arrives in the order started
        import cupy

        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(cupy.cuda.get_current_stream())  # the sends are written and the recv buffers free...
        self.stream.wait_event(ready)  # ...in compute-stream order, before the transfer may start
        src, dst = (self.rank - shift) % self.size, (self.rank + shift) % self.size
        self.nccl.groupStart()  # one group: every rank's send to r+shift pairs with r+shift's recv from r
        for s, r in zip(sends, recvs):
            self.nc.send(s.data.ptr, s.nbytes, self.nccl.NCCL_INT8, dst, self.stream.ptr)
            self.nc.recv(r.data.ptr, r.nbytes, self.nccl.NCCL_INT8, src, self.stream.ptr)
        self.nccl.groupEnd()
        done = cupy.cuda.Event(disable_timing=True)
        done.record(self.stream)
        return done, sends, recvs  # keep the buffers referenced until the transfer is waited on

    def wait(self, handle):
        import cupy

        cupy.cuda.get_current_stream().wait_event(handle[0])  # the GPU waits; the host runs on

    def allgather(self, obj):
        return self.comm.allgather(obj)


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

    def _box(self, rank, tag, sender):
        with self.shared["cond"]:  # one FIFO per (receiver, tag, sender), as MPI matches source and tag
            return self.shared["boxes"].setdefault((rank, tag, sender), queue.Queue())

    def start(self, sends, recvs, tag=0, shift=1):
        dst = (self.rank + shift) % self.size
        self._box(dst, tag, self.rank).put([s.copy() for s in sends])  # "send": a copy into rank+shift's mailbox
        return recvs, tag, (self.rank - shift) % self.size

    def wait(self, handle):
        recvs, tag, src = handle
        for r, got in zip(recvs, self._get(self._box(self.rank, tag, src))):
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

