"""Benchmark: our FlashAttention-2 kernels (stage 02 forward, stage 03 backward) beside PyTorch's
scaled_dot_product_attention, side by side in one run on one GPU.

    python3 dev/bench.py                           # the full sweep (several minutes on an H100)
    python3 dev/bench.py --quick                   # a small subset (about a minute)
    python3 dev/bench.py --direction fwd --dtypes bf16 --head-dims 128 --seqs 4096 8192
    python3 dev/bench.py --markdown results/bench.csv   # the README table from a committed CSV (no GPU)

Implementations (CSV impl/version):
  ours  fp32_overlap  forward: stages.flash_v2.forward(version="fp32_overlap"), stage 02's optimised float32
                   kernel (loads overlapping the math; CSVs written before stage 02 kept the paper's plain loop as
                   version "fp32" beside it name this one "fp32": dev/bench_report.py reads them so)
  ours  fp32       backward: stages.flash_v2_backward.backward(version="fp32")
  ours  fp32x3     version="fp32x3", forward and backward: fp32 on TF32 tensor cores with the 3xTF32 split (fp32
                   table only)
  ours  tc         version="tc": mma.sync tensor cores, bf16/fp16
  ours  pipelined  forward version="pipelined" (cp.async double buffering, padded shared memory)
  ours  hopper     stage 06 on an sm_90 GPU: stages.hopper.flash_v3.forward (version "pingpong": TMA, wgmma, warp
                   specialisation, ping-pong; float32: version "fp32x3", 3xTF32 on wgmma) and
                   stages.hopper.flash_v3_backward.backward(version="auto": "ws", 16-bit); "missing" on other GPUs
  ours  tc-det     backward version="tc", deterministic=True (no atomics: a separate dQ pass)
  torch flash      F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION), bf16/fp16
  torch cudnn      ... SDPBackend.CUDNN_ATTENTION, bf16/fp16
  torch efficient  ... SDPBackend.EFFICIENT_ATTENTION, the fp32 comparison
A version that is not there yet, or raises, gets status "missing: ..." / "error: ..." and the sweep goes on.

Method:
  sizes     B = tokens // N (default 16384 tokens) and H = 16 heads: every N gives the GPU the same
            B*H*N rows of Q (2048 Q tiles of 128 rows), enough to fill it. q, k, v, dO ~ N(0, 1), fresh per config.
  check     before timing, every (config, implementation) runs once on a small problem of the same dtype, head
            dim and causality (B=1, H=2, N=256) and is held to the one tolerance rule (stages/common/tolerance.py:
            in every row of o, lse and dq, dk, dv, the max error against the fp64 oracle within that row's bound).
            Ours goes through stages.common.verify.check_forward / check_backward; a row that fails is
            "mismatch: <message>" and is not timed. Torch's outputs on the same inputs are measured by the same
            rule (o only in the forward: sdpa returns no lse; its backward from its own forward), and the CSV
            column err_over_bound holds the worst output's error/bound at its worst row; a torch row past 1 is
            "torch outside the rule: ..." and still timed (it is the reference, not under test).
            tc-det must also give bit-identical dq, dk, dv on two runs.
  timing    two modes, after a warm-up of --settle-ms of untimed calls (a GPU's clock drops under a power-hungry
            kernel and recovers gradually: without it, whichever implementation follows cuDNN's backward would be
            timed at that lower clock), each the median of repeats (enough for --target-ms of GPU time):
            queued (ms, tflops): CUDA events around each call, the host running ahead, so its launch overhead
              hides behind the GPU's work, as in a long run of kernels nobody waits on;
            synced (ms_synced): the host's clock around the call and a wait for the GPU, every call starting on
              an idle GPU, as in a training loop that reads its loss each step: host time adds to GPU time.
            --rounds R: the implementations of a config take turns R times, and each column is the median of their
              R timings. A GPU at its power limit runs at a clock that drifts with its temperature over a run, by
              more than the gap between two fast kernels; taking turns spreads the drift over all of them.
            host_us: the host's time inside one call (input checks, configuration choice, allocation, launches),
              the median over the queued mode's first 32 calls (before the launch queue can fill and make a
              launch wait for the GPU): the part of a call a short sequence cannot hide.
            Torch gets q, k, v, dO in its own (B, N, H, d) memory layout, as (B, H, N, d) transposed views (no
            copies). Torch forward runs under torch.no_grad() (its inference path); torch backward is
            torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) on a graph built once: the backward
            alone, no forward. Ours: backward(q, k, v, o, lse, dO) with o, lse from the reference.
  FLOPs     4*B*H*N*N*d, half when causal; backward 2.5x the forward (stages.common.attention_flops).
Outputs: a table on screen (GPU named), DIR/bench.csv (this run only, overwritten; columns in
dev/bench_report.py, with provenance: git commit, GPU, driver, CUDA runtime, CuPy, torch, date),
DIR/bench_forward.png and DIR/bench_backward.png. Exit status 1 when any row of ours is a mismatch (or this
script fails on a config).
"""
import argparse
import csv
import os
import contextlib
import importlib
import math
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
import warnings

import bench_report as report  # dev/ is on sys.path: this file runs as a script from it

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: `stages` imports with no install

# ---- configuration (each overridable on the command line)
TOKENS = 16384  # B*N: B = TOKENS // N
HEADS = 16  # H
SEQS = (512, 1024, 2048, 4096, 8192, 16384)  # N for bf16/fp16
FP32_SEQS = (1024, 2048, 4096)  # N for fp32 (the fp32 kernels are ~10x slower)
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16", "fp32")
TARGET_MS = 300.0  # GPU time spent timing each (config, implementation), after warm-up
SETTLE_MS = 200.0  # the warm-up: untimed calls for this long before each implementation's timing (settle)
QUICK = dict(seqs=[512, 4096], fp32_seqs=[1024], head_dims=[64, 128], fp32_head_dims=[64], dtypes=["bf16", "fp32"],
             target_ms=40.0, settle_ms=20.0)
REF_BYTES = 6e9  # memory the chunked reference (o, lse our backward starts from) may use for its N x N matrices
CHECK_SHAPE = (1, 2, 256)  # B, H, N of the small problem every implementation is checked on before timing

# stage 02's versions, and stage 06 ("hopper")
OURS_FWD = {"16": ["tc", "pipelined", "hopper"], "32": ["fp32_overlap", "fp32x3", "hopper"]}
HOPPER = ("hopper", "flash_v3", None)  # (column, module of stages.hopper, its version: pingpong, fp32x3 for float32)
HOPPER_BWD = ("hopper", "flash_v3_backward", "auto")  # the same for the backward (ws at d = 64, 128)
OURS_BWD = {"16": [("tc", False, "tc"), ("tc", True, "tc-det")], "32": [("fp32", False, "fp32"),
                                                                        ("fp32x3", False, "fp32x3")]}  # stage 03
TORCH_VERSIONS = {"16": ["flash", "cudnn"], "32": ["efficient"]}


def _precision(dtype):
    return "32" if dtype == "fp32" else "16"


def _short(e, n=160):
    """An exception as one short line for the CSV's status column."""
    msg = " ".join(f"{type(e).__name__}: {e}".split())
    return msg if len(msg) <= n else msg[: n - 3] + "..."


# ---------------------------------------------------------------------------------------------- environment
def _environment():
    """(cupy, torch) or SystemExit with a message saying what is missing."""
    hint = "(to turn a committed CSV into the README table without a GPU: python3 dev/bench.py --markdown CSV)"
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no CuPy, no driver or no device
        raise SystemExit(f"bench.py needs a CUDA GPU and CuPy: none found ({_short(e, 120)}). {hint}")
    if n == 0:
        raise SystemExit(f"bench.py needs a CUDA GPU: CuPy sees no device. {hint}")
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"bench.py compares against PyTorch, which is not installed ({e}): pip install torch "
                         f"(a CUDA build). {hint}")
    if not torch.cuda.is_available():
        raise SystemExit(f"bench.py: PyTorch {torch.__version__} sees no CUDA device (a CPU-only build?). {hint}")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32, not tf32
    torch.backends.cudnn.allow_tf32 = False
    return cupy, torch


def provenance(cupy, torch, gpu):
    """The columns that say which run a CSV row comes from (the same on every row of one run)."""
    import datetime

    from stages.common import code_version

    def out(cmd):
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            return ""

    driver = str(cupy.cuda.runtime.driverGetVersion())
    smi = out(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).splitlines()
    if smi and smi[0].strip():
        driver += f" ({smi[0].strip()})"
    return dict(git_commit=code_version(), gpu=gpu, driver=driver,
                cuda_runtime=str(cupy.cuda.runtime.runtimeGetVersion()),
                cupy=cupy.__version__, torch=getattr(torch, "__version__", "") if torch is not None else "",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def hopper_session(script):
    """(cupy, torch, provenance) for a dev script that times stage 06 beside PyTorch on this GPU; SystemExit with a
    message that names what is missing (CuPy, a CUDA build of PyTorch, a device, an sm_90 GPU)."""
    try:
        import cupy
        import torch

        cupy.cuda.runtime.getDeviceCount()
        if not torch.cuda.is_available():
            raise RuntimeError(f"PyTorch {torch.__version__} sees no CUDA device")
    except Exception as e:  # no CuPy, no torch, no driver or no device
        raise SystemExit(f"{script} needs an sm_90 GPU, CuPy and a CUDA build of PyTorch ({e})")
    from stages.common import device, gpu_name
    from stages.hopper import sm90a

    try:
        sm90a.require_hopper()
    except device.UnsupportedDevice as e:
        raise SystemExit(f"{script} times stage 06: {e}")
    return cupy, torch, provenance(cupy, torch, gpu_name())


def take_turns_us(fns, rounds, reps, torch):
    """{name: microseconds per call} of each fn in fns ({name: fn}): each runs reps times back to back between two
    CUDA events after a warm-up (queued), the fns take turns `rounds` times, and each value is the median of its
    rounds."""
    from stages.common import time_queued_ms

    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            times[name].append(time_queued_ms(fn, gpu=True, warmup=10, repeat=reps) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def hopper_timing_parser(doc, *, head_dims, reps, rounds):
    """The options a dev script that times stage 06 at a fixed number of tokens shares (--seqs, --head-dims from
    head_dims, --dtype, --tokens, --heads, --reps, --rounds, --out); parse with parse_timing_args."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(head_dims), choices=list(head_dims))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--tokens", type=int, default=16384, help="B*N, B = tokens // N (default 16384)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=reps, help="calls between the two events of one timing")
    ap.add_argument("--rounds", type=int, default=rounds, help="turns of all the timings; medians over them")
    ap.add_argument("--out", default=None, help="CSV file to write (default: print only)")
    return ap


def parse_timing_args(ap):
    """ap's arguments, --reps, --rounds and --seqs checked."""
    args = ap.parse_args()
    if args.reps < 1 or args.rounds < 1:
        ap.error("--reps and --rounds must be at least 1")
    if any(n < 1 for n in args.seqs):
        ap.error(f"--seqs must be positive, got {args.seqs}")
    return args


def write_rows(path, columns, rows):
    """rows ({column: value}) as a CSV file with these columns, in this order."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} ({len(rows)} rows)")


def _stage(name):
    """(module, None) or (None, status) for a stage that is not there or does not import."""
    try:
        return importlib.import_module(f"stages.{name}"), None
    except ImportError as e:
        return None, f"missing: stages.{name} does not import ({_short(e, 100)})"
    except Exception as e:
        return None, f"error: import stages.{name}: {_short(e)}"


def _hopper(cfg, direction):
    """(the stage 06 module, its version, None) where stage 06 runs this config in this direction, else (None, None,
    "missing: why")."""
    _, module, version = HOPPER if direction == "fwd" else HOPPER_BWD
    try:
        mod = importlib.import_module(f"stages.hopper.{module}")
        importlib.import_module("stages.hopper.sm90a").require_hopper()
    except Exception as e:  # not an sm_90 GPU, or cuda-bindings missing
        return None, None, f"missing: stage 06: {_short(e, 120)}"
    if cfg.head_dim not in mod.HEAD_DIMS:
        return None, None, f"missing: stage 06 takes head dims {mod.HEAD_DIMS}"
    return mod, version, None


def _has_version(mod, version):
    versions = getattr(mod, "VERSIONS", None)
    return versions is None or version in versions


# ---------------------------------------------------------------------------------------------- timing
class _Clock:
    """CUDA events of one library (CuPy or torch), so each implementation is timed on its own stream."""

    def __init__(self, lib, cupy):
        self.lib, self.cupy = lib, cupy

    def event(self):
        if self.lib == "torch":
            import torch

            return torch.cuda.Event(enable_timing=True)
        return self.cupy.cuda.Event()

    def elapsed(self, a, b):
        return a.elapsed_time(b) if self.lib == "torch" else self.cupy.cuda.get_elapsed_time(a, b)


HOST_CALLS = 32  # host_us: the first calls of the queued mode, before the launch queue can fill


def settle(fn, cupy, settle_ms=SETTLE_MS, min_calls=2, now=time.perf_counter):
    """Untimed calls of fn, each waited for, until settle_ms have passed on the host's clock `now` (at least
    min_calls); returns the number of calls. A GPU lowers its clock when its power draw is high, and raises it
    again only gradually: right after a power-hungry implementation (cuDNN's backward, say) the next one runs
    slower for a while, then steadies. Warmed up for a fixed time instead of a fixed number of calls, every
    implementation is timed in the state its own work keeps the GPU in, whichever ran before it."""
    sync = cupy.cuda.Device().synchronize
    t0, n = now(), 0
    while n < min_calls or (now() - t0) * 1e3 < settle_ms:
        fn()
        sync()
        n += 1
    return n


def time_call(fn, clock, cupy, *, target_ms, settle_ms=SETTLE_MS, min_reps=3, max_reps=200):
    """Queued timing: (median ms of fn() from CUDA events around every call, all recorded before one wait, so the
    host runs ahead and its launch overhead hides behind the GPU's work; median us the host spends inside fn()).

    The host time is the median over the first HOST_CALLS calls only. The driver queues about a thousand launches
    and events; past that a launch waits for the GPU to retire earlier work, and that wait is the GPU's time, not
    the launcher's (a long problem's later calls would all report it)."""
    settle(fn, cupy, settle_ms)
    a, b = clock.event(), clock.event()
    a.record()
    fn()
    b.record()
    b.synchronize()
    reps = int(min(max_reps, max(min_reps, target_ms / max(clock.elapsed(a, b), 1e-3))))
    starts, stops = [clock.event() for _ in range(reps)], [clock.event() for _ in range(reps)]
    host = []
    for i, (s, e) in enumerate(zip(starts, stops)):
        s.record()
        t0 = time.perf_counter()
        fn()
        if i < HOST_CALLS:
            host.append((time.perf_counter() - t0) * 1e6)
        e.record()
    stops[-1].synchronize()
    return statistics.median(clock.elapsed(s, e) for s, e in zip(starts, stops)), statistics.median(host)


def time_synced(fn, cupy, *, target_ms, warmup=2, min_reps=10, max_reps=200):
    """Synced timing: median ms of fn() plus a wait for the GPU, on the host's clock. Each call starts on an idle
    GPU, as in a training loop that reads its loss every step, so the host's time per call (input checks,
    configuration, allocation, launches) adds to the GPU's."""
    for _ in range(warmup):
        fn()
    sync = cupy.cuda.Device().synchronize
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    reps = int(min(max_reps, max(min_reps, target_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    total = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        total.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(total)


# ---------------------------------------------------------------------------------------------- data + reference
def _to_torch(x, torch):
    """A CuPy array as a torch tensor on the same memory (DLPack); bf16 travels as int16 bits."""
    from stages.common import bfloat16
    import numpy as np

    if x.dtype == bfloat16:
        return torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


def _to_cupy(t, cupy, torch):
    """A torch tensor as a CuPy array on the same memory (DLPack); bf16 travels as int16 bits."""
    from stages.common import bfloat16

    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return cupy.from_dlpack(t.view(torch.int16)).view(bfloat16)
    return cupy.from_dlpack(t)


def attention_chunked(q, k, v, do, *, causal, scale, dtype, torch):
    """Naive attention (forward and, if do is given, backward) computed in `dtype`, a few heads at a time.

    q, k, v, do: (B, H, N, d) torch tensors. Returns o, lse (B, H, N) and dq, dk, dv (or None), all in dtype.
    bench.py uses it in fp32/fp64 for the full-size o, lse our backward is timed from (the check is elsewhere:
    the small problem, by the tolerance rule).
    """
    B, H, N, D = q.shape
    BH = B * H
    flat = [None if t is None else t.reshape(BH, N, D) for t in (q, k, v, do)]  # (B*H, N, d)
    o = torch.empty((BH, N, D), dtype=dtype, device=q.device)
    lse = torch.empty((BH, N), dtype=dtype, device=q.device)
    grads = [torch.empty((BH, N, D), dtype=dtype, device=q.device) for _ in range(3)] if do is not None else None
    chunk = max(1, int(REF_BYTES // (3 * N * N * torch.finfo(dtype).bits // 8)))
    above = torch.ones(N, N, dtype=torch.bool, device=q.device).triu_(1) if causal else None  # key j > query i
    for s in range(0, BH, chunk):
        qs, ks, vs = (t[s:s + chunk].to(dtype) for t in flat[:3])  # (c, N, d)
        S = torch.matmul(qs, ks.transpose(1, 2)) * scale  # (c, N, N)
        if causal:
            S.masked_fill_(above, float("-inf"))
        lse[s:s + chunk] = torch.logsumexp(S, dim=-1)  # (c, N)
        P = torch.softmax(S, dim=-1)  # (c, N, N)
        del S
        O = torch.matmul(P, vs)  # (c, N, d)
        o[s:s + chunk] = O
        if do is not None:
            dos = flat[3][s:s + chunk].to(dtype)  # (c, N, d)
            grads[2][s:s + chunk] = torch.matmul(P.transpose(1, 2), dos)  # dV = P^T dO
            dS = torch.matmul(dos, vs.transpose(1, 2))  # dP = dO V^T   (c, N, N)
            Dvec = (dos * O).sum(dim=-1, keepdim=True)  # D_i = rowsum(dO_i * O_i)   (c, N, 1)
            dS.sub_(Dvec).mul_(P)  # dS = P * (dP - D)
            del P
            grads[0][s:s + chunk] = torch.matmul(dS, ks) * scale  # dQ = scale dS K
            grads[1][s:s + chunk] = torch.matmul(dS.transpose(1, 2), qs) * scale  # dK = scale dS^T Q
            del dS
        else:
            del P
    shape = (B, H, N, D)
    out = [o.reshape(shape), lse.reshape(B, H, N)]
    out += [g.reshape(shape) for g in grads] if grads is not None else [None, None, None]
    return out


def _bit_equal(a, b):
    """a and b (CuPy arrays) identical bit for bit."""
    import cupy

    return a.shape == b.shape and bool(cupy.array_equal(a.view(f"i{a.dtype.itemsize}"),
                                                        b.view(f"i{b.dtype.itemsize}")))


def _bnhd(x, torch):
    """A (B, H, N, d) CuPy array as a torch tensor in torch's own layout: (B, N, H, d) contiguous (a copy)."""
    return _to_torch(x, torch).transpose(1, 2).contiguous()


# ---------------------------------------------------------------------------------------------- one config
class Config:
    def __init__(self, dtype, head_dim, causal, seq_len, tokens, heads):
        self.dtype, self.head_dim, self.causal, self.seq_len = dtype, head_dim, causal, seq_len
        self.batch, self.heads = max(1, tokens // seq_len), heads

    def label(self):
        return (f"{self.dtype} d={self.head_dim} {'causal' if self.causal else 'full'} N={self.seq_len} "
                f"(B={self.batch} H={self.heads})")


def _plan(cfg, direction):
    """[(impl, version)] to run for one config and direction, in table order: our versions that take the config's
    head dim (version "tc" of the forward stops at 128), then PyTorch's."""
    from stages import flash_v2, flash_v2_backward

    p = _precision(cfg.dtype)
    if direction == "fwd":
        ours = [v for v in OURS_FWD[p] if v == HOPPER[0] or cfg.head_dim in flash_v2.head_dims(v)]
    else:
        ours = [name for base, _, name in OURS_BWD[p] if cfg.head_dim in flash_v2_backward.HEAD_DIMS[base]]
        ours += [HOPPER_BWD[0]] if p == "16" else []
    return [("ours", v) for v in ours] + [("torch", v) for v in TORCH_VERSIONS[p]]



class _Small:
    """The small check problem of one (config, direction): inputs (CuPy, (B, H, N, d)) and what the tolerance rule
    needs (the fp64 oracle's outputs and the bound of each output)."""

    def __init__(self, cfg, direction, cupy):
        from stages import naive  # noqa: F401  (stage 00: the tolerance rule's reference, registered on import)
        from stages.common import bfloat16, cast, tolerance, verify
        import numpy as np

        self.tol, self.verify = tolerance, verify
        B, H, N = CHECK_SHAPE
        np_dtype = {"bf16": bfloat16, "fp16": np.float16, "fp32": np.float32}[cfg.dtype]
        rng = cupy.random.default_rng(0)
        shape = (B, H, N, cfg.head_dim)
        self.q, self.k, self.v, self.do = (cast(rng.standard_normal(shape, dtype=np.float32), np_dtype)
                                           for _ in range(4))
        q, k, v, do, c = self.q, self.k, self.v, self.do, cfg.causal
        if direction == "fwd":
            self.names = tolerance.NAMES_FORWARD
            self.refs = tolerance.oracle(q, k, v, causal=c)
            ys = tolerance.forward_yardsticks(q, k, v, causal=c)
            terms = tolerance.forward_s_terms(q, k, v, causal=c)
        else:  # as verify.check_backward: the backward starts from the oracle's o, lse
            self.names = tolerance.NAMES_BACKWARD
            self.o_in, self.lse_in = verify.backward_start(q, *tolerance.oracle(q, k, v, causal=c))
            self.refs = tolerance.backward_oracle(q, k, v, self.o_in, self.lse_in, do, causal=c)
            ys = tolerance.backward_yardsticks(q, k, v, self.o_in, self.lse_in, do, causal=c)
            terms = tolerance.backward_s_terms(q, k, v, self.o_in, do, causal=c)
        self.bounds = dict(zip(self.names, tolerance.bounds(self.refs, ys, terms)))
        self.refs = dict(zip(self.names, self.refs))

    def worst(self, outs):
        """(name, error, bound) of the output with the largest error/bound, at its worst row (the rule bounds each row
        on its own); outs: {name: array}."""
        rows = {n: self.tol.worst_row(x, self.refs[n], self.bounds[n])[:2] for n, x in outs.items()}
        n = max(rows, key=lambda n: rows[n][0] / rows[n][1])
        return (n, *rows[n])


class Bench:
    def __init__(self, args, cupy, torch, gpu, prov):
        self.args, self.cupy, self.torch, self.gpu, self.prov = args, cupy, torch, gpu, prov
        self.clocks = {"ours": _Clock("cupy", cupy), "torch": _Clock("torch", cupy)}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        import torch.nn.functional as F

        self.sdpa_kernel, self.F = sdpa_kernel, F
        self.backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}
        self.mismatches = 0
        self.torch_outside = 0

    def _row(self, cfg, direction, impl, version, ms=None, synced=None, status="ok", ratio=None, worst=None):
        from stages.common import attention_flops

        tflops = None
        if ms is not None:
            f = attention_flops(cfg.batch, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.head_dim, causal=cfg.causal,
                                backward=direction == "bwd")
            tflops = round(f / (ms * 1e-3) / 1e12, 3)
        return dict(self.prov, gpu=self.gpu, direction=direction, impl=impl, version=version, dtype=cfg.dtype,
                    causal=cfg.causal, head_dim=cfg.head_dim, seq_len=cfg.seq_len, batch=cfg.batch,
                    heads=cfg.heads, ms=None if ms is None else round(ms, 4), tflops=tflops,
                    ms_synced=None if synced is None else round(synced[0], 4),
                    host_us=None if synced is None else round(synced[1], 1), status=status,
                    err_over_bound=None if ratio is None else f"{ratio:.4g}", err_output=worst)

    def _sdpa(self, cfg, leaves):
        """F.scaled_dot_product_attention on (B, N, H, d) tensors, given as (B, H, N, d) views (no copies)."""
        return self.F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves), is_causal=cfg.causal)

    def _entries(self, cfg, direction, data, small):
        """{(impl, version): (gate, setup, extra)}: gate() -> (status, error/bound, worst output) on the small
        problem; setup() -> fn, the full-size call to time (raises _Missing if not there); extra = the torch
        backend."""
        torch, cupy = self.torch, self.cupy
        q, k, v, do, tq, tk, tv, tdo, o_in, lse_in = data  # ours (B, H, N, d); torch's (B, N, H, d)
        entries = {}
        for impl, version in _plan(cfg, direction):
            if impl == "torch":
                backend = self.backends[version]

                def gate(backend=backend):
                    sq, sk, sv, sdo = (_bnhd(x, torch) for x in (small.q, small.k, small.v, small.do))
                    if direction == "fwd":
                        with self.sdpa_kernel(backend), torch.no_grad():
                            outs = {"o": _to_cupy(self._sdpa(cfg, (sq, sk, sv)), cupy, torch)}
                    else:
                        leaves = [t.requires_grad_(True) for t in (sq, sk, sv)]
                        with self.sdpa_kernel(backend):
                            out = self._sdpa(cfg, leaves)
                            g = torch.autograd.grad(out, leaves, sdo.transpose(1, 2))
                        outs = {n: _to_cupy(x.transpose(1, 2), cupy, torch) for n, x in zip(small.names, g)}
                    name, err, bound = small.worst(outs)
                    status = "ok"
                    if not err <= bound:
                        status = f"torch outside the rule: {name} max error {err:.3e} > bound {bound:.3e}"
                    return status, err / bound, name

                if direction == "fwd":
                    def setup():
                        return lambda: self._sdpa(cfg, (tq, tk, tv))
                else:
                    def setup(backend=backend):
                        leaves = [t.detach().requires_grad_(True) for t in (tq, tk, tv)]  # (B, N, H, d)
                        with self.sdpa_kernel(backend):  # the graph (so its backward kernel) is fixed here, once
                            out = self._sdpa(cfg, leaves)
                        grad_out = tdo.transpose(1, 2)  # dO in torch's layout too, as out is
                        return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
                entries[(impl, version)] = (gate, setup, backend)
                continue
            if version == HOPPER[0]:
                mod, base, why = _hopper(cfg, direction)
                det = None
            elif direction == "fwd":
                mod, why = _stage("flash_v2")
                if mod is not None and not _has_version(mod, version):
                    mod, why = None, f"missing: version {version!r} not in stages.flash_v2.VERSIONS {mod.VERSIONS}"
                base, det = version, None
            else:
                mod, why = _stage("flash_v2_backward")
                base, det = next((b, d) for b, d, name in OURS_BWD[_precision(cfg.dtype)] if name == version)
                if mod is not None and not _has_version(mod, base):
                    mod, why = None, f"missing: version {base!r} not in stages.flash_v2_backward.VERSIONS"

            def gate(mod=mod, why=why, base=base, det=det):
                if mod is None:
                    raise _Missing(why)
                got = {}
                kw = dict(version=base) if det is None else dict(version=base, deterministic=det)

                def call(*a, **k):  # keeps the outputs, for the error/bound column
                    got["out"] = (mod.forward if direction == "fwd" else mod.backward)(*a, **k)
                    return got["out"]

                check = small.verify.check_forward if direction == "fwd" else small.verify.check_backward
                args = (small.q, small.k, small.v) if direction == "fwd" else (small.q, small.k, small.v, small.do)
                status = "ok"
                try:
                    check(call, *args, causal=cfg.causal, **kw)
                except AssertionError as e:
                    status = "mismatch: " + " ".join(str(e).split())
                ratio = name = None
                if "out" in got:
                    try:
                        name, err, bound = small.worst(dict(zip(small.names, got["out"])))
                        ratio = err / bound
                    except Exception:  # a wrong shape: the status says so already
                        pass
                if status == "ok" and det:  # deterministic mode: bit-identical dq, dk, dv on a second run
                    again = mod.backward(small.q, small.k, small.v, small.o_in, small.lse_in, small.do,
                                         causal=cfg.causal, version=base, deterministic=True)
                    if not all(_bit_equal(a, b) for a, b in zip(got["out"], again)):
                        status = "mismatch: deterministic mode: dq, dk, dv not bit-identical across two runs"
                return status, ratio, name

            if direction == "fwd":
                def setup(mod=mod, base=base):
                    return lambda: mod.forward(q, k, v, causal=cfg.causal, version=base)
            else:
                def setup(mod=mod, base=base, det=det):
                    kw = {} if det is None else dict(deterministic=det)
                    return lambda: mod.backward(q, k, v, o_in, lse_in, do, causal=cfg.causal, version=base, **kw)
            entries[(impl, version)] = (gate, setup, None)
        return entries

    def _context(self, key, extra, direction):
        """sdpa_kernel(backend) for torch rows, no_grad for every forward."""
        stack = contextlib.ExitStack()
        if key[0] == "torch":
            stack.enter_context(self.sdpa_kernel(extra))
        if direction == "fwd":
            stack.enter_context(self.torch.no_grad())
        return stack

    def run_config(self, cfg, directions, progress):
        """Gate (on a small problem), then time, every implementation of one config; returns CSV rows."""
        cupy = self.cupy
        rows = []
        try:
            data = self._prepare(cfg, "bwd" in directions)
        except Exception as e:  # out of memory, or a sticky CUDA error from an earlier kernel
            for direction in directions:
                for impl, version in _plan(cfg, direction):
                    rows.append(self._row(cfg, direction, impl, version, status=f"error: inputs: {_short(e)}"))
                progress.step(f"{direction} {cfg.label()}")
            self._free()
            return rows
        for direction in directions:
            progress.show(f"{direction} {cfg.label()} (check)")
            try:
                small = _Small(cfg, direction, cupy)
                entries = self._entries(cfg, direction, data, small)
            except Exception as e:
                for impl, version in _plan(cfg, direction):
                    rows.append(self._row(cfg, direction, impl, version, status=f"error: check: {_short(e)}"))
                progress.step(f"{direction} {cfg.label()}")
                self._recover()
                continue
            status, ratio, worst, notes = {}, {}, {}, []
            for key, (gate, _, extra) in entries.items():
                name = f"{key[0]}/{key[1]}"
                ratio[key] = worst[key] = None
                caught = []
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        status[key], ratio[key], worst[key] = gate()
                    r = "" if ratio[key] is None else f" {ratio[key]:.2f} ({worst[key]})"
                    notes.append(f"{name}{r}" + ("" if status[key] == "ok" else f" {status[key].split(':')[0]}"))
                except _Missing as e:
                    status[key] = str(e)
                    notes.append(f"{name} missing")
                except Exception as e:
                    why = _short(e)
                    if caught and key[0] == "torch":  # torch says in a warning why a backend was not used
                        why = " ".join(f"{why} [{caught[0].message}]".split())[:250]
                    status[key] = f"error: check: {why}"
                    notes.append(f"{name} error")
                    self._recover()
            bad = sum(s.startswith("mismatch") for s in status.values())
            outside = sum(s.startswith("torch outside") for s in status.values())
            skipped = sum(not s.startswith(("ok", "mismatch", "torch outside")) for s in status.values())
            verdict = (f"{bad} MISMATCH (not timed)" if bad else "All of ours within the rule") + \
                (f", {outside} torch outside the rule (timed)" if outside else "") + \
                (f" ({skipped} not run: missing/error)" if skipped else "") + ". Starting benchmarks."
            progress.log(f"check {direction} {cfg.label()} on {self.gpu}, B,H,N={CHECK_SHAPE}: error/bound "
                         + ", ".join(notes) + f" -> {verdict}")
            self.mismatches += bad
            self.torch_outside += outside
            # Rounds: every implementation timed in turn, --rounds times over; each column is the median over the
            # rounds, so that all of them meet the GPU's power and thermal states alike (a power-capped GPU's clock
            # drifts over a run, by more than the gap between two fast kernels).
            times = {key: [] for key in entries}  # key -> [(queued ms, synced ms, host us)], one per round
            for rnd in range(self.args.rounds):
                for key, (_, setup, extra) in entries.items():
                    if not (status[key] == "ok" or status[key].startswith("torch outside")):
                        continue
                    progress.show(f"{direction} {cfg.label()} {key[0]}/{key[1]}"
                                  + (f" round {rnd + 1}/{self.args.rounds}" if self.args.rounds > 1 else ""))
                    try:
                        with self._context(key, extra, direction), warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            fn = setup()
                            ms, host = time_call(fn, self.clocks[key[0]], cupy, target_ms=self.args.target_ms,
                                                 settle_ms=self.args.settle_ms)
                            times[key].append((ms, time_synced(fn, cupy, target_ms=self.args.target_ms / 2), host))
                        del fn
                    except Exception as e:
                        status[key] = f"error: timing: {_short(e)}"
                        self._recover()
            for key in entries:
                ms = synced = None
                if times[key] and not status[key].startswith("error"):
                    ms, synced_ms, host = (statistics.median(col) for col in zip(*times[key]))
                    synced = (synced_ms, host)
                rows.append(self._row(cfg, direction, key[0], key[1], ms=ms, synced=synced, status=status[key],
                                      ratio=ratio[key], worst=worst[key]))
            progress.step(f"{direction} {cfg.label()}")
        del data
        self._free()
        return rows

    def _prepare(self, cfg, with_grad):
        """Fresh full-size inputs: ours (CuPy, (B, H, N, d)), torch's (the same values in (B, N, H, d) memory),
        and the o, lse our backward starts from (the fp32/fp64 reference's, as the check's backward does)."""
        cupy, torch = self.cupy, self.torch
        from stages.common import bfloat16, cast
        import numpy as np

        np_dtype = {"bf16": bfloat16, "fp16": np.float16, "fp32": np.float32}[cfg.dtype]
        t_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
        ref_dtype = torch.float64 if cfg.dtype == "fp32" else torch.float32
        shape = (cfg.batch, cfg.heads, cfg.seq_len, cfg.head_dim)  # (B, H, N, d)
        rng = cupy.random.default_rng()
        q, k, v, do = (cast(rng.standard_normal(shape, dtype=np.float32), np_dtype) for _ in range(4))
        tq, tk, tv, tdo = (_bnhd(x, torch) for x in (q, k, v, do))  # (B, N, H, d) contiguous
        assert tq.dtype == t_dtype
        o_in = lse_in = None
        if with_grad:
            o, lse, *_ = attention_chunked(*(_to_torch(x, torch) for x in (q, k, v)), None, causal=cfg.causal,
                                           scale=1.0 / math.sqrt(cfg.head_dim), dtype=ref_dtype, torch=torch)
            o_in = _to_cupy(o.to(t_dtype), cupy, torch)  # (B, H, N, d), the inputs' dtype
            lse_in = _to_cupy(lse.float(), cupy, torch)  # (B, H, N) float32
            del o, lse
        torch.cuda.synchronize()
        return q, k, v, do, tq, tk, tv, tdo, o_in, lse_in

    def _recover(self):
        """After an error: wait for the device (a sticky error shows here, and then in every later row)."""
        try:
            self.cupy.cuda.Device().synchronize()
        except Exception:
            pass

    def _free(self):
        try:
            self.cupy.get_default_memory_pool().free_all_blocks()
            self.torch.cuda.empty_cache()
        except Exception:
            pass


class _Missing(Exception):
    pass


# ---------------------------------------------------------------------------------------------- progress
class Progress:
    """A plain-text progress bar on stderr (redrawn in place on a terminal, one line per step otherwise)."""

    def __init__(self, total):
        self.total, self.done, self.t0 = total, 0, time.time()
        self.tty = sys.stderr.isatty()

    def _bar(self, what):
        frac = self.done / max(1, self.total)
        el = time.time() - self.t0
        eta = f" eta {el / frac * (1 - frac):.0f}s" if self.done else ""
        return f"[{'#' * int(30 * frac):<30}] {self.done}/{self.total} {el:.0f}s{eta}  {what}"

    def show(self, what):
        if self.tty:
            sys.stderr.write("\r\033[K" + self._bar(what)[:150])
            sys.stderr.flush()

    def step(self, what):
        self.done += 1
        if self.tty:
            self.show(what)
        else:
            print(self._bar(what), file=sys.stderr, flush=True)

    def log(self, line):
        if self.tty:
            sys.stderr.write("\r\033[K")
        print(line, flush=True)

    def close(self):
        if self.tty:
            sys.stderr.write("\n")


# ---------------------------------------------------------------------------------------------- main
def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"a small subset (N {QUICK['seqs']}, bf16 + fp32 at N {QUICK['fp32_seqs']} d "
                         f"{QUICK['fp32_head_dims']}, short timing): about a minute")
    ap.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    ap.add_argument("--out", default="results", help="folder for bench.csv and the PNGs (default results/); "
                    "its bench.csv is overwritten: one CSV holds one run")
    ap.add_argument("--seqs", type=int, nargs="+", default=None, help=f"N for bf16/fp16 (default {SEQS})")
    ap.add_argument("--fp32-seqs", type=int, nargs="+", default=None, help=f"N for fp32 (default {FP32_SEQS})")
    ap.add_argument("--head-dims", type=int, nargs="+", default=None, help=f"head dims (default {HEAD_DIMS})")
    ap.add_argument("--fp32-head-dims", type=int, nargs="+", default=None, help="head dims for fp32 (default: "
                    "--head-dims)")
    ap.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None, help=f"default {DTYPES}")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--tokens", type=int, default=TOKENS, help=f"B*N, B = tokens // N (default {TOKENS})")
    ap.add_argument("--heads", type=int, default=HEADS, help=f"H (default {HEADS})")
    ap.add_argument("--target-ms", type=float, default=None, help=f"GPU time per timing (default {TARGET_MS})")
    ap.add_argument("--settle-ms", type=float, default=None,
                    help=f"untimed calls for this long before each implementation's timing (default {SETTLE_MS})")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation of a config in turn this many times; each column is the median "
                         "over the rounds (default 1)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    ap.add_argument("--markdown", metavar="CSV", default=None,
                    help="print the README results table of a bench CSV and exit (no GPU needed)")
    ap.add_argument("--min-seq", type=int, default=4096, help="--markdown: smallest N in the table (default 4096)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    quick = QUICK if args.quick else {}
    args.seqs = args.seqs or quick.get("seqs") or list(SEQS)
    args.fp32_seqs = args.fp32_seqs or quick.get("fp32_seqs") or list(FP32_SEQS)
    args.head_dims = args.head_dims or quick.get("head_dims") or list(HEAD_DIMS)
    args.fp32_head_dims = args.fp32_head_dims or quick.get("fp32_head_dims") or args.head_dims
    args.dtypes = args.dtypes or quick.get("dtypes") or list(DTYPES)
    args.target_ms = args.target_ms or quick.get("target_ms") or TARGET_MS
    args.settle_ms = args.settle_ms if args.settle_ms is not None else quick.get("settle_ms", SETTLE_MS)
    return args


def configs(args):
    out = []
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for dtype in args.dtypes:
        fp32 = dtype == "fp32"
        for d in args.fp32_head_dims if fp32 else args.head_dims:
            for causal in causals:
                for n in args.fp32_seqs if fp32 else args.seqs:
                    out.append(Config(dtype, d, causal, n, args.tokens, args.heads))
    return out


def main(argv=None):
    args = parse(argv)
    if args.markdown:
        print(report.markdown(report.read_csv(args.markdown), min_seq=args.min_seq))
        return 0
    cupy, torch = _environment()
    from stages.common import gpu_name

    gpu = gpu_name()
    if os.environ.get("ATTN_ARCH"):  # every launcher picks that architecture's configurations (stages/common/device.py)
        gpu += f" running the {os.environ['ATTN_ARCH']} configurations (ATTN_ARCH)"
    prov = provenance(cupy, torch, gpu)
    directions = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    cfgs = configs(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"== FlashAttention-2 benchmark on {gpu}: torch {prov['torch']}, CuPy {prov['cupy']}, CUDA runtime "
          f"{prov['cuda_runtime']}, driver {prov['driver']}, commit {prov['git_commit']}, {prov['date']}", flush=True)
    print(f"   {len(cfgs)} configs x {directions}; B = {args.tokens} // N, H = {args.heads}; timing: CUDA events, "
          f"{args.settle_ms:g} ms warm-up, median over {args.target_ms:g} ms of GPU time; torch fwd under no_grad, "
          "torch bwd = autograd.grad on a retained graph (no forward); FLOPs 4BHN^2d (/2 causal), bwd x2.5", flush=True)
    bench = Bench(args, cupy, torch, gpu, prov)
    progress = Progress(len(cfgs) * len(directions))
    rows, t0, bugs = [], time.time(), 0

    try:
        for cfg in cfgs:
            try:
                rows += bench.run_config(cfg, directions, progress)
            except Exception as e:  # a bug of this script: say so, keep the config's rows as errors, go on
                traceback.print_exc()
                rows += [bench._row(cfg, d, i, v, status=f"error: bench.py: {_short(e)}")
                         for d in directions for i, v in _plan(cfg, d)]
                bench._free()
                bugs += 1
            report.write_csv(out / "bench.csv", rows)  # after every config: a cut-short run keeps its rows
    except KeyboardInterrupt:
        progress.log("interrupted: writing what was measured so far")
    progress.close()
    report.write_csv(out / "bench.csv", rows)
    print(report.text(rows))
    print(f"\nwrote {out / 'bench.csv'} ({len(rows)} rows, this run only) in {time.time() - t0:.0f} s")
    if not args.no_plots:
        for p in report.plots(rows, out):
            print(f"wrote {p}")
    if bench.torch_outside:
        print(f"note: {bench.torch_outside} torch rows are outside the tolerance rule (timed; status 'torch outside "
              f"the rule' in the CSV, column err_over_bound)")
    if bench.mismatches:
        print(f"FAIL: {bench.mismatches} rows of ours are outside the tolerance rule (status 'mismatch' in the CSV; "
              "not timed)")
        return 1
    if bugs:
        print(f"FAIL: bench.py itself failed on {bugs} configs (traceback above)")
        return 1
    n_ok = sum(r["status"] == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} rows ok (others missing or error: see the status column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
