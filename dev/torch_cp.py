"""PyTorch's own context parallel attention, timed on P GPUs: the reference point for our ring (stage 04).

What is measured. PyTorch ships ring attention as `torch.distributed.tensor.experimental.context_parallel`:
inside that context manager, `F.scaled_dot_product_attention` on a rank's shard of q, k, v runs a ring over the
ranks of a DeviceMesh (each step attends to one K/V shard, gathered from all ranks at once or passed on
rank to rank; the partial outputs are merged by their log-sum-exp), with FlashAttention-2 or cuDNN as the
kernel of each step. This module times it the way the ring benchmark times ours: the same shapes
(B, H, N, D) with N = P * tokens_per_gpu, the same dtypes, the same causal layout (PyTorch's load balancer
gives rank r the chunks r and 2P-1-r of 2P chunks: the zigzag layout), CUDA events around each call, the
median of the repeats, and the slowest rank's time. The forward is timed with inputs that require grad (as in
training: it then keeps what the backward needs), the backward alone after an untimed forward. The times
include PyTorch's host work per call (DTensor dispatch), as a user of this API pays it. Memory is the torch
allocator's peak above what was allocated before the first forward, per GPU: the output, the gathered or
passed K/V, the gradients and PyTorch's float32 accumulators.

Why a separate module. Our code runs on CuPy and our own NCCL communicator; PyTorch needs
torch.distributed. Both live in the same MPI processes here (one process per GPU, launched by mpirun): `init`
starts torch.distributed over the same ranks, and `time_context_parallel` is called by every rank, like any
collective. Results are reduced with mpi4py, so they do not depend on torch's collectives.

    from dev import torch_cp
    ok = torch_cp.init(comm)              # True, or a sentence saying why PyTorch's CP cannot run here
    r = torch_cp.time_context_parallel(comm, 2, batch=1, heads=16, kv_heads=16, tokens_per_gpu=16384,
                                       head_dim=128, dtype="bfloat16", causal=True, backend="flash")
    # r: {"fwd_ms", "bwd_ms", "peak_bytes", "rotate_method", "torch", "note"} on ranks < 2, None on the others

Things PyTorch's API imposes (read from torch 2.11 and 2.13,
torch/distributed/tensor/experimental/_context_parallel/_attention.py and _load_balancer.py):
  * `context_parallel(mesh, buffers=..., buffer_seq_dims=..., no_restore_buffers=...)` shards the given
    tensors IN PLACE (resize_ + copy_) and, on leaving, restores those not in `no_restore_buffers` the same
    way; resize_ refuses a tensor that requires grad. So q, k, v are marked requires_grad only inside the
    context, and every buffer is listed in `no_restore_buffers`.
  * It patches the attribute `torch.nn.functional.scaled_dot_product_attention`: call it through `F.`, never a
    name imported before the context opened.
  * Load balancing is a global option (`_cp_options.enable_load_balance`, on by default); the ring raises
    "Load balancing requires `is_causal=True`" when it is on for a non-causal call, so it is set per call
    (on for causal, off otherwise) and put back afterwards. Balanced causal needs N divisible by 2P, so
    tokens_per_gpu must be even.
  * In 2.11 the context manager has no try/finally: an exception inside it would leave SDPA patched for the
    rest of the process. The measurement therefore catches its own errors inside the context and re-raises
    them after the context has closed.
"""
import atexit
import functools
import socket
import statistics

_INIT = None  # the result of the first init(): True or the reason PyTorch's CP cannot run
_MESHES = {}  # P -> DeviceMesh of ranks 0..P-1 (None on the other ranks); new_group is collective, so cached

DTYPES = ("bfloat16", "float16")
BACKENDS = ("flash", "cudnn")
ROTATE_METHODS = ("allgather", "alltoall")


# ---------------------------------------------------------------- starting torch.distributed next to MPI

def _free_port():
    """A TCP port on 127.0.0.1 that is free now (the OS picks it); rank 0 hosts torch's store there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _why_not():
    """None if this process can run PyTorch's context parallel attention, else a sentence saying why not."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if not dist.is_available() or not dist.is_nccl_available():
        return f"torch {torch.__version__} has no NCCL backend"
    try:
        from torch.distributed.tensor.experimental import context_parallel  # noqa: F401
        from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method  # noqa: F401
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} is too old: no context_parallel ({e})"
    return None


def _device_index(device):
    """The GPU this rank uses: `device` if given, else CuPy's current device (the caller chose it)."""
    if device is not None:
        return int(device)
    import cupy

    return cupy.cuda.Device().id


def init(comm, device=None):
    """Initialise torch.distributed (NCCL) over the ranks of the mpi4py communicator `comm` (rank 0 picks a free
    TCP port on 127.0.0.1 and broadcasts it); returns True, or a string saying why PyTorch's context parallel cannot
    run here (torch missing, no CUDA, no NCCL, too old: no context_parallel). Idempotent.

    Collective over `comm`. torch uses the GPU `device` (an index), by default CuPy's current device, so that
    torch and CuPy work on the same GPU in each process. Every rank gets the same answer (a rank's reason
    is shared with all). One machine only: the store listens on 127.0.0.1."""
    global _INIT
    if _INIT is not None:
        return _INIT
    reasons = [r for r in comm.allgather(_why_not()) if r]
    if reasons:
        _INIT = reasons[0]
        return _INIT
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(_device_index(device))
    if dist.is_initialized():  # started by someone else: usable only if it spans the same ranks
        if (dist.get_rank(), dist.get_world_size()) != (comm.rank, comm.size):
            _INIT = "torch.distributed is already initialised over other ranks than this communicator's"
            return _INIT
    else:
        port = comm.bcast(_free_port() if comm.rank == 0 else None, root=0)
        # No device_id: NCCL communicators are then created lazily, by the first collective of each group,
        # among its members only (a ring of 2 in a 4-rank job touches 2 GPUs).
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                                world_size=comm.size)
        atexit.register(shutdown)  # torch warns at exit if the process group was not destroyed
    _INIT = True
    return _INIT


def shutdown():
    """Destroy torch's process groups (the cached rings included). init() may be called again afterwards."""
    global _INIT
    import torch.distributed as dist

    _MESHES.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    _INIT = None


def _mesh(P):
    """The 1-D DeviceMesh of global ranks 0..P-1, or None on the other ranks.

    torch.distributed.new_group is collective over the WORLD: every rank calls it, members or not, in the
    same order; non-members get a placeholder and no mesh. The group is cached per P (a new one per call
    would create new NCCL communicators each time)."""
    if P not in _MESHES:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        group = dist.new_group(ranks=list(range(P)), backend="nccl")
        _MESHES[P] = DeviceMesh.from_group(group, "cuda") if dist.get_rank() < P else None
    return _MESHES[P]


# ---------------------------------------------------------------- one measurement

def _draw(shape, dtype, seed, device):
    """A standard normal tensor, the same on every rank for the same seed."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def _timed_ms(sync, fn):
    """GPU time of one call of fn (CUDA events on the current stream), the ranks lined up first."""
    import torch

    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _measure(sub, q, k, v, dout, *, causal, gqa, repeat, warmup):
    """Inside the context: q, k, v, dout are this rank's shards. Returns (fwd_ms, bwd_ms, peak_bytes, note)."""
    import torch
    import torch.nn.functional as F

    for t in (q, k, v):  # only now: the context has already resized them in place (see the module docstring)
        t.requires_grad_(True)
    note = ""

    def forward():
        if gqa == "native":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        if gqa == "repeat":  # what a model does when its SDPA cannot broadcast K/V heads itself
            rep = q.shape[1] // k.shape[1]
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, dim=1),
                                                  v.repeat_interleave(rep, dim=1), is_causal=causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def backward(o):
        o.backward(dout)
        for t in (q, k, v):  # a fresh gradient each time, not accumulated: one backward's work
            t.grad = None

    def sync():
        torch.cuda.synchronize()
        sub.Barrier()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    if gqa == "native":  # does this torch's CP take K/V with fewer heads? One try; the same outcome on every rank
        try:
            backward(forward())
        except Exception as e:  # any refusal: fall back to K/V repeated to `heads` heads
            gqa = "repeat"
            for t in (q, k, v):
                t.grad = None
            note = (f"enable_gqa failed under context_parallel ({type(e).__name__}: {str(e)[:200]}); k, v are "
                    "repeated to `heads` heads inside the timed forward (repeat_interleave on dim 1)")
    for _ in range(warmup):
        backward(forward())
    # forward alone: its output (and the graph kept for the backward) is dropped inside _timed_ms
    fwd = [_timed_ms(sync, forward) for _ in range(repeat)]
    bwd = []
    for _ in range(repeat):
        o = forward()
        bwd.append(_timed_ms(sync, functools.partial(backward, o)))
        del o
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(fwd), statistics.median(bwd), peak, note


def time_context_parallel(comm, P, *, batch, heads, kv_heads, tokens_per_gpu, head_dim, dtype, causal, backend,
                          repeat=5, warmup=2, rotate_method=None, seed=0):
    """Time PyTorch's context parallel attention on a ring of the first P ranks of `comm`.

    Every rank of `comm` calls this (the group creation is collective); ranks < P form the ring, the others
    return None. Each member draws the full (B, H, N, D) q and dout and (B, kv_heads, N, D) k and v, with
    N = P * tokens_per_gpu and the same seed on every member; `context_parallel` keeps this rank's shard of
    each along dim 2, and F.scaled_dot_product_attention(q, k, v, is_causal=causal) runs under
    sdpa_kernel(backend). Grouped-query attention (kv_heads < heads) first tries enable_gqa=True; if this
    torch refuses it under context parallel, k and v are repeated to `heads` heads and "note" says so.
    Causal runs use PyTorch's load balancing (rank r holds chunks r and 2P-1-r); non-causal runs do not
    (PyTorch refuses it there, and every rank has the same work anyway).

    dtype: "bfloat16" or "float16"; backend: "flash" or "cudnn"; rotate_method: "allgather" (PyTorch's
    default: each rank gathers all K/V once), "alltoall" (K/V passed to the next rank at each step, as in our
    ring) or None (keep PyTorch's current setting); the backward always passes dK/dV on with all-to-all.
    After `warmup` untimed forward+backward calls, CUDA events time `repeat` calls, median per rank:
    fwd_ms the forward alone (inputs requiring grad, as in training), bwd_ms o.backward(dout) alone after an
    untimed forward; peak_bytes is torch.cuda.max_memory_allocated() above what was allocated before the
    first forward (peak statistics reset there).

    Returns on every member the same dict {"fwd_ms", "bwd_ms", "peak_bytes" (each the max over members),
    "rotate_method", "torch" (torch.__version__), "note" ("" or what was changed)}, or raises RuntimeError
    with the first member's error. init(comm) must have returned True. Frees its tensors and empties torch's
    cache before returning (the caller's CuPy pool shares the GPU).
    """
    from mpi4py import MPI

    if _INIT is not True:
        raise RuntimeError(f"torch_cp.init(comm) has not succeeded: {_INIT or 'not called'}")
    _check_args(comm, P, heads, kv_heads, tokens_per_gpu, dtype, causal, backend, rotate_method, repeat)
    mesh = _mesh(P)  # collective over all ranks
    sub = comm.Split(0 if comm.rank < P else MPI.UNDEFINED, comm.rank)  # the members, for the max and the barriers
    if mesh is None:
        return None
    try:
        result, error = _run_member(sub, mesh, P, batch, heads, kv_heads, tokens_per_gpu, head_dim, dtype, causal,
                                    backend, repeat, warmup, rotate_method, seed)
        errors = [e for e in sub.allgather(error) if e]  # a rank that failed must not leave the others waiting
        if errors:
            raise RuntimeError(f"PyTorch context parallel attention failed on P={P} ({backend}, {dtype}, "
                               f"causal={causal}): {errors[0]}")
        fwd_ms, bwd_ms, peak, note, method, version = result
        return {"fwd_ms": sub.allreduce(fwd_ms, op=MPI.MAX), "bwd_ms": sub.allreduce(bwd_ms, op=MPI.MAX),
                "peak_bytes": sub.allreduce(peak, op=MPI.MAX), "rotate_method": method, "torch": version,
                "note": note}
    finally:
        sub.Free()


def _check_args(comm, P, heads, kv_heads, tokens_per_gpu, dtype, causal, backend, rotate_method, repeat):
    """The same checks on every rank, before anything collective, so a bad argument fails everywhere at once."""
    if not 1 <= P <= comm.size:
        raise RuntimeError(f"P={P} GPUs asked for, but the communicator has {comm.size} ranks")
    if dtype not in DTYPES:
        raise RuntimeError(f"dtype {dtype!r}: PyTorch's CP kernels take {DTYPES}")
    if backend not in BACKENDS:
        raise RuntimeError(f"backend {backend!r}: choose one of {BACKENDS}")
    if rotate_method is not None and rotate_method not in ROTATE_METHODS:
        raise RuntimeError(f"rotate_method {rotate_method!r}: choose one of {ROTATE_METHODS} or None")
    if kv_heads < 1 or heads % kv_heads:
        raise RuntimeError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
    if causal and tokens_per_gpu % 2:
        raise RuntimeError(f"tokens_per_gpu={tokens_per_gpu}: causal load balancing cuts each rank's tokens in "
                           "two chunks, so it must be even")
    if repeat < 1:
        raise RuntimeError("repeat must be at least 1")


def _run_member(sub, mesh, P, batch, heads, kv_heads, tokens_per_gpu, head_dim, dtype, causal, backend, repeat,
                warmup, rotate_method, seed):
    """One member's measurement: ((fwd_ms, bwd_ms, peak, note, rotate_method, torch version), None) or
    (None, the error as text). PyTorch's global CP options are set for this call and put back afterwards."""
    import torch
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    device = torch.device("cuda", torch.cuda.current_device())
    N = P * tokens_per_gpu
    tdtype = getattr(torch, dtype)
    gqa = "native" if kv_heads != heads else None
    saved = (_cp_options.enable_load_balance, _cp_options.rotate_method)
    buffers = []  # q, k, v, dout: this list is their only reference, so that clearing it frees them
    result = error = None
    try:
        for i, h in enumerate((heads, kv_heads, kv_heads, heads)):
            buffers.append(_draw((batch, h, N, head_dim), tdtype, seed + i, device))
        _cp_options.enable_load_balance = bool(causal)  # PyTorch refuses load balancing without a causal mask
        if rotate_method is not None:
            set_rotate_method(rotate_method)
        method = {"ALL_GATHER": "allgather", "ALL_TO_ALL": "alltoall"}.get(_cp_options.rotate_method.name,
                                                                           _cp_options.rotate_method.name)
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
            try:  # errors stay inside: torch 2.11 would leave SDPA patched if one crossed the context's exit
                with sdpa_kernel(kernel):
                    result = _measure(sub, *buffers, causal=causal, gqa=gqa, repeat=repeat, warmup=warmup)
            except Exception as e:  # reported to every member, then raised as RuntimeError
                error = f"{type(e).__name__}: {e}"
        if result is not None:
            result = (*result, method, torch.__version__)
    except Exception as e:  # e.g. out of memory, or the sharding itself failed
        error = f"{type(e).__name__}: {e}"
    finally:
        _cp_options.enable_load_balance, _cp_options.rotate_method = saved
        buffers.clear()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the caller's CuPy pool shares this GPU
    return result, error
