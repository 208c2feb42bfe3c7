"""FLOP counts, timing (CUDA events on the GPU), peak memory, device facts, the code a measurement ran."""
import os
import pathlib
import statistics
import subprocess
import time
import tracemalloc


def _driver_present():
    """True when this machine has an NVIDIA driver (a device node or the driver library)."""
    import ctypes.util
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*")) or ctypes.util.find_library("cuda") is not None


def gpu_status():
    """(True, name) with a usable CUDA device; (False, reason) on a machine with no NVIDIA driver.

    A machine WITH a driver where CuPy is missing or fails is broken, not GPU-less: that raises RuntimeError
    with CuPy's error, so a test run there fails instead of skipping every GPU test."""
    import os

    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False, "no CUDA GPU: hidden by CUDA_VISIBLE_DEVICES"
    driver = _driver_present()
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
        if n > 0:
            return True, gpu_name()
        problem = "CuPy sees no CUDA device"
    except Exception as e:  # ImportError, CUDARuntimeError (no driver / no device / driver too old), ...
        problem = f"{type(e).__name__}: {e}"
    if driver:
        raise RuntimeError(f"an NVIDIA driver is present but CuPy cannot use the GPU ({problem}); fix the CuPy "
                           "install (cupy-cuda12x or cupy-cuda13x to match the driver), or run on the CPU only "
                           "with CUDA_VISIBLE_DEVICES=-1")
    # (CuPy's own error here, "insufficient driver", only says that no driver is installed: it is not repeated)
    return False, "no CUDA GPU on this machine (no NVIDIA driver): this check runs on a GPU"


def has_gpu():
    """True when CuPy sees a CUDA device, False on a machine with no NVIDIA driver; raises on a broken setup
    (a driver but no working CuPy), see gpu_status."""
    return gpu_status()[0]


def run_devices(choice):
    """The devices a run.py runs on for --device auto|cpu|gpu: auto is the CPU, and the GPU too when there
    is one. Exits with a clear message when the GPU is asked for and CuPy sees none."""
    if choice == "gpu" and not has_gpu():
        raise SystemExit("--device gpu: no CUDA GPU found (CuPy sees no device); use --device cpu")
    return {"cpu": ["cpu"], "gpu": ["gpu"]}.get(choice) or (["cpu", "gpu"] if has_gpu() else ["cpu"])


def gpu_name():
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else name


def code_version():
    """The code a measurement ran, for a CSV's git_commit column: ATTN_GIT_COMMIT where the caller names it (a copy of
    the tree without .git, e.g. on a GPU machine given the files), else git's short HEAD, with '-dirty' when tracked
    files differ from it, else 'unknown'."""
    if os.environ.get("ATTN_GIT_COMMIT"):
        return os.environ["ATTN_GIT_COMMIT"]
    root = pathlib.Path(__file__).resolve().parents[2]

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def attention_flops(B, H, Nq, Nk, D, *, causal=False, backward=False):
    """FLOPs by the convention of the FlashAttention papers.

    Forward: two matmuls (S = QK^T, O = PV) of 2*Nq*Nk*D each -> 4*B*H*Nq*Nk*D, halved when causal.
    Backward: 2.5x the forward (five matmuls instead of two).
    """
    f = 4.0 * B * H * Nq * Nk * D
    if causal:
        f *= 0.5
    if backward:
        f *= 2.5
    return f


def time_ms(fn, *, gpu, warmup=3, repeat=10):
    """Median time of fn() in milliseconds after warm-up; CUDA events around each call on the GPU."""
    for _ in range(warmup):
        fn()
    times = []
    if gpu:
        import cupy

        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.get_current_stream().synchronize()
        for _ in range(repeat):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_queued_ms(fn, *, gpu, warmup=2, repeat=10):
    """Mean time of fn() in milliseconds when calls are queued back to back, as a training step queues them: CUDA
    events around `repeat` calls after warm-up, no wait between calls, so the host's work for one call overlaps the
    GPU's work for the one before (a call the host cannot keep up with still shows). On the CPU: time_ms."""
    if not gpu:
        return time_ms(fn, gpu=False, warmup=warmup, repeat=repeat)
    import cupy

    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.get_current_stream().synchronize()
    start.record()
    for _ in range(repeat):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeat


class PeakMemory:
    """Peak bytes allocated inside the `with` block, above what was live when it started.

    CPU: numpy reports its buffers to tracemalloc. GPU: a CuPy memory hook counts the
    memory pool's mallocs and frees (the pool's rounded sizes, which is what the GPU holds).
    """

    def __init__(self, gpu):
        self.gpu = gpu
        self.peak = 0

    def __enter__(self):
        if self.gpu:
            import cupy

            outer = self

            class _Hook(cupy.cuda.MemoryHook):
                name = "PeakMemory"

                def __init__(self):
                    self.live = 0

                def malloc_postprocess(self, **kw):
                    self.live += kw["mem_size"]
                    outer.peak = max(outer.peak, self.live)

                def free_postprocess(self, **kw):
                    self.live -= kw["mem_size"]

            cupy.cuda.Device().synchronize()
            self._hook = _Hook()
            self._hook.__enter__()
        else:
            self._was_tracing = tracemalloc.is_tracing()
            if not self._was_tracing:
                tracemalloc.start()
            tracemalloc.reset_peak()
            self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        if self.gpu:
            import cupy

            cupy.cuda.Device().synchronize()
            self._hook.__exit__(*exc)
        else:
            self.peak = max(0, tracemalloc.get_traced_memory()[1] - self._base)
            if not self._was_tracing:
                tracemalloc.stop()
        return False
