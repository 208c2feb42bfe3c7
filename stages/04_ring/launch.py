"""Stage 04: starting the ranks under mpirun: which backend, which GPU, and how an error ends the job.

    backend, reason = select("auto")   every rank agrees on a backend (choose_backend) and takes its GPU
    run_main(main)                      an error on one rank ends every rank (abort), never a hang

mpi4py launches (./scripts/mpirun, or the system's mpirun) and runs the checks. Ranks map to GPUs by their LOCAL rank
(MPI shared-memory split), so the cluster's `mpirun -n 8 --hostfile hosts` on two 4-GPU nodes gives each process its
own GPU on its own node. comm.py holds the communicators themselves.
"""
import os
import sys
import time

BACKENDS = ("auto", "nccl", "mpi", "numpy")


class BackendError(RuntimeError):
    """The backend asked for cannot run here. Decided from every rank's facts, so every rank raises the same one: a
    launcher reports it once, as a usage error."""


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
        raise BackendError(f"--backend {requested}: not known; use one of {', '.join(BACKENDS)}")
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
        raise BackendError(f"--backend {requested} needs a CUDA GPU on every rank; CuPy sees none on some "
                           "rank: use --backend numpy")
    if requested == "nccl" and not one_each:
        raise BackendError(f"--backend nccl needs one GPU per rank, but up to {shared} ranks share one GPU "
                           "(NCCL refuses two ranks on one GPU): use --backend mpi, or start fewer ranks per node")
    if requested == "nccl" and not nccl_ok:
        raise BackendError("--backend nccl: CuPy cannot load NCCL (pip install nvidia-nccl-cu12, or -cu13 for "
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
