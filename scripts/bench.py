"""Benchmark: our FlashAttention-2 kernels (stage 02 forward, stage 03 backward) beside PyTorch's
scaled_dot_product_attention, side by side in one run on one GPU.

    python3 scripts/bench.py                           # the full sweep (several minutes on an H100)
    python3 scripts/bench.py --quick                   # a small subset (about a minute)
    python3 scripts/bench.py --direction fwd --dtypes bf16 --head-dims 128 --seqs 4096 8192
    python3 scripts/bench.py --markdown results/bench.csv   # the README table from a committed CSV (no GPU)

Implementations (CSV impl/version):
  ours  fp32       stages.flash_v2.forward(version="fp32") / stages.flash_v2_backward.backward(version="fp32")
  ours  fp32x3     forward version="fp32x3": fp32 on TF32 tensor cores with the 3xTF32 split (fp32 table only)
  ours  tc         version="tc": mma.sync tensor cores, bf16/fp16
  ours  pipelined  forward version="pipelined" (cp.async double buffering, padded shared memory)
  ours  tc-det     backward version="tc", deterministic=True (no atomics: a separate dQ pass)
  torch flash      F.scaled_dot_product_attention under sdpa_kernel(SDPBackend.FLASH_ATTENTION), bf16/fp16
  torch cudnn      ... SDPBackend.CUDNN_ATTENTION, bf16/fp16
  torch efficient  ... SDPBackend.EFFICIENT_ATTENTION, the fp32 comparison
A version that is not there yet, or raises, gets status "missing: ..." / "error: ..." and the sweep goes on.

Method:
  sizes     B = tokens // N (default 16384 tokens) and H = 16 heads: every N gives the GPU the same
            B*H*N rows of Q (2048 Q tiles of 128 rows), enough to fill it. q, k, v, dO ~ N(0, 1), fresh per config.
  check     before timing, every implementation's output is compared with a reference computed in higher
            precision (fp32 for bf16/fp16 inputs, fp64 for fp32) by the project's tolerance rule (docs/DESIGN.md):
            max error at most 2x the error of a naive-attention yardstick, plus 1e-5 (o, lse and dq, dk, dv).
            A row of ours that fails is "mismatch" and never enters a ratio. Torch's rows are the
            yardstick, not under test: their error/bound is printed, and only past 10x is a row a mismatch.
            tc-det must also give bit-identical dq, dk, dv on two runs.
  timing    CUDA events around each call, the host running ahead (launch overhead hidden where the GPU
            is the bottleneck), after warm-up; the median of repeats (enough for --target-ms of GPU time).
            Torch forward runs under torch.no_grad() (its inference path); torch backward is
            torch.autograd.grad(out, (q, k, v), dO, retain_graph=True) on a graph built once: the backward
            alone, no forward. Ours: backward(q, k, v, o, lse, dO) with o, lse from the reference.
  FLOPs     4*B*H*N*N*d, half when causal; backward 2.5x the forward (stages.common.attention_flops).
Outputs: a table on screen (GPU named), DIR/bench.csv (columns in scripts/bench_report.py), DIR/bench_forward.png
and DIR/bench_backward.png. Exit status 1 when any row is a mismatch (or this script fails on a config).
"""
import argparse
import contextlib
import importlib
import math
import pathlib
import statistics
import sys
import time
import traceback
import warnings

import bench_report as report  # scripts/ is on sys.path: this file runs as a script from it

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ---- configuration (each overridable on the command line)
TOKENS = 16384  # B*N: B = TOKENS // N
HEADS = 16  # H
SEQS = (1024, 2048, 4096, 8192, 16384)  # N for bf16/fp16
FP32_SEQS = (1024, 2048, 4096)  # N for fp32 (the fp32 kernels are ~10x slower)
HEAD_DIMS = (64, 128)
DTYPES = ("bf16", "fp16", "fp32")
TARGET_MS = 300.0  # GPU time spent timing each (config, implementation), after warm-up
QUICK = dict(seqs=[1024, 4096], fp32_seqs=[1024], head_dims=[64, 128], fp32_head_dims=[64], dtypes=["bf16", "fp32"],
             target_ms=40.0)
REF_BYTES = 6e9  # memory the chunked reference may use for its N x N matrices
FACTOR, SLACK = 2.0, 1e-5  # the tolerance rule (stages/common/tolerance.py)
TORCH_SANITY = 10.0  # torch's rows are the yardstick, not under test: only errors past 10x the bound flag them

OURS_FWD = {"16": ["tc", "pipelined"], "32": ["fp32", "fp32x3"]}  # version names of stage 02
OURS_BWD = {"16": [("tc", False, "tc"), ("tc", True, "tc-det")], "32": [("fp32", False, "fp32")]}  # stage 03
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
    hint = "(to turn a committed CSV into the README table without a GPU: python3 scripts/bench.py --markdown CSV)"
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


def _stage(name):
    """(module, None) or (None, status) for a stage that is not there or does not import."""
    try:
        return importlib.import_module(f"stages.{name}"), None
    except ImportError as e:
        return None, f"missing: stages.{name} does not import ({_short(e, 100)})"
    except Exception as e:
        return None, f"error: import stages.{name}: {_short(e)}"


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


def time_call(fn, clock, cupy, *, target_ms, warmup=2, min_reps=3, max_reps=200):
    """Median ms of fn(): events around every call, all recorded before one wait, so the host runs ahead."""
    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    a, b = clock.event(), clock.event()
    a.record()
    fn()
    b.record()
    b.synchronize()
    reps = int(min(max_reps, max(min_reps, target_ms / max(clock.elapsed(a, b), 1e-3))))
    starts, stops = [clock.event() for _ in range(reps)], [clock.event() for _ in range(reps)]
    for s, e in zip(starts, stops):
        s.record()
        fn()
        e.record()
    stops[-1].synchronize()
    return statistics.median(clock.elapsed(s, e) for s, e in zip(starts, stops))


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
    With dtype fp32/fp64 this is the reference; with the inputs' own dtype it is the naive same-dtype
    attention whose error sets the tolerance.
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


def _bits(t, torch):
    """The raw bits of a tensor, for a bit-for-bit comparison."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _max_err(x, ref):
    """max |x - ref| in ref's dtype; inf for NaN or a shape mismatch."""
    if tuple(x.shape) != tuple(ref.shape):
        return float("inf")
    e = (x.to(ref.dtype) - ref).abs().max().item()
    return e if math.isfinite(e) else float("inf")


# ---------------------------------------------------------------------------------------------- one config
class Config:
    def __init__(self, dtype, head_dim, causal, seq_len, tokens, heads):
        self.dtype, self.head_dim, self.causal, self.seq_len = dtype, head_dim, causal, seq_len
        self.batch, self.heads = max(1, tokens // seq_len), heads

    def label(self):
        return (f"{self.dtype} d={self.head_dim} {'causal' if self.causal else 'full'} N={self.seq_len} "
                f"(B={self.batch} H={self.heads})")


def _plan(cfg, direction):
    """[(impl, version)] to run for one config and direction, in table order."""
    p = _precision(cfg.dtype)
    ours = OURS_FWD[p] if direction == "fwd" else [name for _, _, name in OURS_BWD[p]]
    return [("ours", v) for v in ours] + [("torch", v) for v in TORCH_VERSIONS[p]]


class Bench:
    def __init__(self, args, cupy, torch, gpu):
        self.args, self.cupy, self.torch, self.gpu = args, cupy, torch, gpu
        self.clocks = {"ours": _Clock("cupy", cupy), "torch": _Clock("torch", cupy)}
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.sdpa_kernel = sdpa_kernel
        self.backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION}
        self.mismatches = 0

    def _row(self, cfg, direction, impl, version, ms=None, status="ok"):
        from stages.common import attention_flops

        tflops = None
        if ms is not None:
            f = attention_flops(cfg.batch, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.head_dim, causal=cfg.causal,
                                backward=direction == "bwd")
            tflops = round(f / (ms * 1e-3) / 1e12, 3)
        return dict(gpu=self.gpu, direction=direction, impl=impl, version=version, dtype=cfg.dtype,
                    causal=cfg.causal, head_dim=cfg.head_dim, seq_len=cfg.seq_len, batch=cfg.batch,
                    heads=cfg.heads, ms=None if ms is None else round(ms, 4), tflops=tflops, status=status)

    def _entries(self, cfg, direction, data):
        """{(impl, version): (setup, outputs, extra)}: setup() -> fn (raises _Missing if not there),
        outputs(fn()) -> {tensor name: torch tensor}, extra = the torch backend, or "det" for tc-det."""
        import torch.nn.functional as F

        torch = self.torch
        q, k, v, do, tq, tk, tv, tdo, o_in, lse_in = data
        grads = ("dq", "dk", "dv")
        entries = {}
        for impl, version in _plan(cfg, direction):
            if impl == "torch" and direction == "fwd":
                def setup():
                    return lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=cfg.causal)
                entries[(impl, version)] = (setup, lambda out: {"o": out}, self.backends[version])
            elif impl == "torch":
                def setup(backend=self.backends[version]):
                    leaves = [t.detach().requires_grad_(True) for t in (tq, tk, tv)]
                    with self.sdpa_kernel(backend):  # the graph (so its backward kernel) is fixed here, once
                        out = F.scaled_dot_product_attention(*leaves, is_causal=cfg.causal)
                    return lambda: torch.autograd.grad(out, leaves, tdo, retain_graph=True)
                entries[(impl, version)] = (setup, lambda g: dict(zip(grads, g)), self.backends[version])
            elif direction == "fwd":
                mod, why = _stage("flash_v2")
                if mod is not None and not _has_version(mod, version):
                    mod, why = None, f"missing: version {version!r} not in stages.flash_v2.VERSIONS {mod.VERSIONS}"

                def setup(mod=mod, why=why, version=version):
                    if mod is None:
                        raise _Missing(why)
                    return lambda: mod.forward(q, k, v, causal=cfg.causal, version=version)
                entries[(impl, version)] = (
                    setup, lambda r: {"o": _to_torch(r[0], torch), "lse": _to_torch(r[1], torch)}, None)
            else:
                mod, why = _stage("flash_v2_backward")
                base, det = next((b, d) for b, d, name in OURS_BWD[_precision(cfg.dtype)] if name == version)
                if mod is not None and not _has_version(mod, base):
                    mod, why = None, f"missing: version {base!r} not in stages.flash_v2_backward.VERSIONS"

                def setup(mod=mod, why=why, base=base, det=det):
                    if mod is None:
                        raise _Missing(why)
                    return lambda: mod.backward(q, k, v, o_in, lse_in, do, causal=cfg.causal, version=base,
                                                deterministic=det)
                entries[(impl, version)] = (
                    setup, lambda g: {n: _to_torch(x, torch) for n, x in zip(grads, g)}, "det" if det else None)
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
        """Check, then time, every implementation of one config; returns CSV rows."""
        cupy, torch = self.cupy, self.torch
        rows = []
        try:
            data, ref, naive = self._prepare(cfg, "bwd" in directions)
        except Exception as e:  # out of memory, or a sticky CUDA error from an earlier kernel
            for direction in directions:
                for impl, version in _plan(cfg, direction):
                    rows.append(self._row(cfg, direction, impl, version, status=f"error: reference: {_short(e)}"))
                progress.step(f"{direction} {cfg.label()}")
            self._free()
            return rows
        for direction in directions:
            progress.show(f"{direction} {cfg.label()} (check)")
            names = ("o", "lse") if direction == "fwd" else ("dq", "dk", "dv")
            bound = {n: FACTOR * _max_err(naive[n], ref[n]) + SLACK for n in names}
            entries = self._entries(cfg, direction, data)
            status, fns, notes = {}, {}, []
            for key, (setup, outputs, extra) in entries.items():
                name = f"{key[0]}/{key[1]}"
                caught = []
                try:
                    with warnings.catch_warnings(record=True) as caught, self._context(key, extra, direction):
                        warnings.simplefilter("always")
                        fn = setup()
                        res = outputs(fn())
                        errs = {n: _max_err(res[n], ref[n]) for n in names if n in res or key[0] == "ours"}
                        same = True
                        if extra == "det":  # deterministic mode: bit-identical dq, dk, dv on a second run
                            again = outputs(fn())
                            same = all(torch.equal(_bits(res[n], torch), _bits(again[n], torch)) for n in names)
                            del again
                        del res
                    worst = max(errs, key=lambda n: errs[n] / bound[n])
                    frac = errs[worst] / bound[worst]  # error over the 2x-naive bound
                    if frac > (1.0 if key[0] == "ours" else TORCH_SANITY):
                        status[key] = f"mismatch: {worst} max error {errs[worst]:.2e} > bound {bound[worst]:.2e}"
                        notes.append(f"{name} MISMATCH ({worst} {errs[worst]:.2e} > {bound[worst]:.2e})")
                    elif not same:
                        status[key] = "mismatch: not bit-identical across two runs"
                        notes.append(f"{name} MISMATCH (deterministic mode differs between runs)")
                    else:
                        status[key] = "ok"
                        notes.append(f"{name} {frac:.2f}")
                    fns[key] = fn
                except _Missing as e:
                    status[key] = str(e)
                    notes.append(f"{name} missing")
                except Exception as e:
                    why = _short(e)
                    if caught and key[0] == "torch":  # torch says in a warning why a backend was not used
                        why = " ".join(f"{why} [{caught[0].message}]".split())[:250]
                    status[key] = f"error: {why}"
                    notes.append(f"{name} error")
                    self._recover()
            bad = sum("MISMATCH" in n for n in notes)
            skipped = sum(not s.startswith(("ok", "mismatch")) for s in status.values())
            verdict = (f"{bad} MISMATCH (timed, but left out of ratios)" if bad else "All results match") + \
                (f" ({skipped} not run: missing/error)" if skipped else "") + ". Starting benchmarks."
            progress.log(f"check {direction} {cfg.label()}: error/bound " + ", ".join(notes) + f" -> {verdict}")
            self.mismatches += sum(s.startswith("mismatch") for s in status.values())
            for key in entries:
                ms = None
                if key in fns:
                    progress.show(f"{direction} {cfg.label()} {key[0]}/{key[1]}")
                    try:
                        with self._context(key, entries[key][2], direction), warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            ms = time_call(fns[key], self.clocks[key[0]], cupy, target_ms=self.args.target_ms)
                    except Exception as e:
                        status[key] = f"error: timing: {_short(e)}"
                        self._recover()
                rows.append(self._row(cfg, direction, key[0], key[1], ms=ms, status=status[key]))
            fns.clear()
            progress.step(f"{direction} {cfg.label()}")
        del data, ref, naive
        self._free()
        return rows

    def _prepare(self, cfg, with_grad):
        """Fresh inputs (CuPy, shared with torch), the reference and the naive same-dtype results."""
        cupy, torch = self.cupy, self.torch
        from stages.common import bfloat16, cast
        import numpy as np

        np_dtype = {"bf16": bfloat16, "fp16": np.float16, "fp32": np.float32}[cfg.dtype]
        t_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.dtype]
        ref_dtype = torch.float64 if cfg.dtype == "fp32" else torch.float32
        shape = (cfg.batch, cfg.heads, cfg.seq_len, cfg.head_dim)  # (B, H, N, d)
        rng = cupy.random.default_rng()
        q, k, v, do = (cast(rng.standard_normal(shape, dtype=np.float32), np_dtype) for _ in range(4))
        tq, tk, tv, tdo = (_to_torch(x, torch) for x in (q, k, v, do))
        assert tq.dtype == t_dtype
        scale = 1.0 / math.sqrt(cfg.head_dim)
        kw = dict(causal=cfg.causal, scale=scale, torch=torch)
        grad_in = tdo if with_grad else None
        ref = dict(zip(("o", "lse", "dq", "dk", "dv"), attention_chunked(tq, tk, tv, grad_in, dtype=ref_dtype, **kw)))
        naive = dict(zip(("o", "lse", "dq", "dk", "dv"), attention_chunked(tq, tk, tv, grad_in, dtype=t_dtype, **kw)))
        o_in = lse_in = None
        if with_grad:  # our backward's o and lse: the reference's, in the inputs' dtype and fp32
            o_in = _to_cupy(ref["o"].to(t_dtype), cupy, torch)  # (B, H, N, d)
            lse_in = _to_cupy(ref["lse"].float(), cupy, torch)  # (B, H, N)
        torch.cuda.synchronize()
        return (q, k, v, do, tq, tk, tv, tdo, o_in, lse_in), ref, naive

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
    ap.add_argument("--out", default="results", help="folder for bench.csv and the PNGs (default results/)")
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
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in DIR/bench.csv (a sweep split over several runs); a config measured "
                         "again replaces its old row")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    ap.add_argument("--markdown", metavar="CSV", default=None,
                    help="print the README results table of a bench CSV and exit (no GPU needed)")
    ap.add_argument("--min-seq", type=int, default=4096, help="--markdown: smallest N in the table (default 4096)")
    args = ap.parse_args(argv)
    quick = QUICK if args.quick else {}
    args.seqs = args.seqs or quick.get("seqs") or list(SEQS)
    args.fp32_seqs = args.fp32_seqs or quick.get("fp32_seqs") or list(FP32_SEQS)
    args.head_dims = args.head_dims or quick.get("head_dims") or list(HEAD_DIMS)
    args.fp32_head_dims = args.fp32_head_dims or quick.get("fp32_head_dims") or args.head_dims
    args.dtypes = args.dtypes or quick.get("dtypes") or list(DTYPES)
    args.target_ms = args.target_ms or quick.get("target_ms") or TARGET_MS
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


def _key(r):
    return tuple(str(r[c]) for c in ("gpu", "direction", "impl", "version", "dtype", "causal", "head_dim", "seq_len"))


def main(argv=None):
    args = parse(argv)
    if args.markdown:
        print(report.markdown(report.read_csv(args.markdown), min_seq=args.min_seq))
        return 0
    cupy, torch = _environment()
    from stages.common import gpu_name

    gpu = gpu_name()
    directions = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    cfgs = configs(args)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"== FlashAttention-2 benchmark on {gpu}: torch {torch.__version__}, CuPy {cupy.__version__}, "
          f"CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}", flush=True)
    print(f"   {len(cfgs)} configs x {directions}; B = {args.tokens} // N, H = {args.heads}; timing: CUDA events, "
          f"warm-up, median over {args.target_ms:g} ms of GPU time; torch fwd under no_grad, torch bwd = "
          "autograd.grad on a retained graph (no forward); FLOPs 4BHN^2d (/2 causal), bwd x2.5", flush=True)
    bench = Bench(args, cupy, torch, gpu)
    progress = Progress(len(cfgs) * len(directions))
    old = report.read_csv(out / "bench.csv") if args.append and (out / "bench.csv").exists() else []
    rows, t0, bugs = [], time.time(), 0

    def merged():  # old rows not measured again in this run, then this run's rows
        new = {_key(r) for r in rows}
        return [r for r in old if _key(r) not in new] + rows

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
            report.write_csv(out / "bench.csv", merged())  # after every config: a cut-short run keeps its rows
    except KeyboardInterrupt:
        progress.log("interrupted: writing what was measured so far")
    progress.close()
    report.write_csv(out / "bench.csv", merged())
    print(report.text(merged()))
    print(f"\nwrote {out / 'bench.csv'} ({len(rows)} rows measured now, {len(merged())} in all) in "
          f"{time.time() - t0:.0f} s")
    if not args.no_plots:
        for p in report.plots(merged(), out):
            print(f"wrote {p}")
    if bench.mismatches:
        print(f"FAIL: {bench.mismatches} rows did not match the reference (status 'mismatch' in the CSV)")
        return 1
    if bugs:
        print(f"FAIL: bench.py itself failed on {bugs} configs (traceback above)")
        return 1
    n_ok = sum(r["status"] == "ok" for r in rows)
    print(f"{n_ok}/{len(rows)} rows ok (others missing or error: see the status column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
