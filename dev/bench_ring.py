"""Ring attention benchmark: our ring on 1, 2, 4... GPUs beside one GPU and PyTorch's own context parallel, in one run.

One launch measures every ring size up to the number of ranks: with `mpirun -n 4` it times rings of 1, 2 and 4
GPUs (sub-communicators of the first P ranks; the others sleep meanwhile). For each ring size P and each problem
of CONFIGS (tokens per GPU T, heads H, kv heads Hkv, layout, mask) it times, with CUDA events, on the same GPUs and
the same problem, in two modes: queued (calls back to back, as a training step queues them: the host's work for
one call overlaps the GPU's work for the one before; the efficiencies use this) and synced (a wait after every
call, the median of the repeats: the host's work before the first kernel shows; PyTorch's times are synced):
  ours        the ring forward and backward on P GPUs, total length N = P T (the slowest rank sets the time), and
              with --schemes the other ways to split the sequence (stage 04's gather.py: allgather, alltoall) on the
              same problem, a row each (column scheme; a ring of one GPU is one call whatever the scheme)
  one GPU     stage 02 forward and stage 03 backward on rank 0's GPU alone at the same N
  torch CP    PyTorch's context parallel (dev/torch_cp.py) on the same P GPUs, flash and cuDNN SDPA inside (when
              torch with CUDA is there; --no-torch skips it)
and reports
  per-GPU efficiency   one GPU's time / (P x ours): fwd, bwd and fwd+bwd (1.00 = the ring costs nothing)
  exposed communication  per rank, summed over the ring's steps: time the compute stream waited on a transfer
  peak memory per GPU  the CuPy pool's peak inside one forward + backward, the shards included, against one GPU's
                       at the same N (the ring cannot reach 1/P: stage 04's README says what a rank holds)
Before timing a ring size, the same ring (backend, dtype, head dim, block versions) is checked on a small problem
for every layout, mask and head grouping of CONFIGS, by the tolerance rule against the fp64 oracle, as run.py checks
it; nothing is timed if a check fails.

    ./scripts/mpirun -n 4 python dev/bench_ring.py --out results/ring_gpus.csv      # rings of 1, 2 and 4 GPUs
    ./scripts/mpirun -n 2 python dev/bench_ring.py --configs 8k-causal --repeat 3   # quicker
    ./scripts/mpirun -n 2 python dev/bench_ring.py --schemes ring allgather alltoall --out results/ring_schemes.csv
    ./scripts/mpirun -n 2 python dev/bench_ring.py --backend numpy --tokens 64 --heads 2 --head-dim 32   # CPU smoke run
Every CSV row names the GPU, the backend, the software and the commit, so files from several machines can be put
together; dev/bench_report.py turns the CSV into the tables and the plot of stage 04's README.
"""
import argparse
import csv
import os
import pathlib
import sys
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # CPU smoke run: one core per rank
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

import stages.hopper  # noqa: E402, F401  registers stage 06's kernels: the ring's blocks on an sm_90 GPU
from stages import ring as R  # noqa: E402
from stages.common import (  # noqa: E402
    PeakMemory, attention_flops, bfloat16, cast, code_version, gpu_name, time_ms, time_queued_ms,
)
from stages.common.cli import positive_int  # noqa: E402
from stages.ring import comm as comm_mod  # noqa: E402
from stages.ring.verify_ring import check_on_ranks  # noqa: E402


class Config(NamedTuple):
    """One problem of the benchmark, per GPU: T tokens, H query heads, Hkv kv heads; target: the fwd+bwd per-GPU
    efficiency the ring should reach at P > 1 (None: shown for contrast)."""
    name: str
    tokens: int
    heads: int
    kv_heads: int
    layout: str
    causal: bool
    target: float | None


# ---- configuration (each overridable on the command line). Published zigzag rings reach about 0.9 of ideal at
# 8k tokens per GPU; with more tokens per GPU the transfers and launches are a smaller share of each step.
CONFIGS = (
    Config("8k-causal", 8192, 32, 32, "zigzag", True, 0.90),
    Config("8k-causal-gqa", 8192, 32, 8, "zigzag", True, 0.90),
    Config("8k-causal-h16", 8192, 16, 16, "zigzag", True, 0.90),
    Config("8k-full", 8192, 32, 32, "contiguous", False, 0.95),
    Config("8k-contiguous-causal", 8192, 32, 32, "contiguous", True, None),  # the imbalance zigzag removes
    Config("32k-causal-h16", 32768, 16, 16, "zigzag", True, 0.95),
    Config("32k-causal", 32768, 32, 32, "zigzag", True, 0.95),
)
BATCH, HEAD_DIM = 1, 128
CPU_TOKENS, CPU_HEADS = 128, 4  # every config's sizes on the numpy backend (a CPU run checks this script; its ranks
# share the host's cores and memory, so it shows no scaling)
CHECK_SEQ = 512  # total N of the checks that run before each ring size is timed
TORCH_BACKENDS = ("flash", "cudnn")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=comm_mod.BACKENDS, default="auto", help="nccl: one GPU per rank")
    ap.add_argument("--gpus", type=positive_int, nargs="+", default=None,
                    help="ring sizes to time (default: 1, 2, 4, ... up to the number of ranks)")
    ap.add_argument("--configs", nargs="+", default=None, choices=[c.name for c in CONFIGS],
                    help="problems to time (default: all of CONFIGS)")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help=f"tokens per GPU for every config (default: the config's; {CPU_TOKENS} on the numpy backend)")
    ap.add_argument("--heads", type=positive_int, default=None,
                    help=f"heads H (and Hkv) for every config (default: the config's; {CPU_HEADS} on the numpy "
                         "backend)")
    ap.add_argument("--head-dim", type=positive_int, default=HEAD_DIM, help="head dimension D")
    ap.add_argument("--schemes", nargs="+", choices=R.SCHEMES, default=["ring"],
                    help="ways to split the sequence to time, a row each (default: the ring)")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="input dtype")
    ap.add_argument("--repeat", type=positive_int, default=5, help="timed repeats (median)")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch's context parallel")
    ap.add_argument("--out", default=None, help="write the rows to this CSV file (rank 0), e.g. results/ring_gpus.csv")
    return ap.parse_args(argv)


def configs(args):
    """CONFIGS, filtered and resized by the command line."""
    out = [c for c in CONFIGS if args.configs is None or c.name in args.configs]
    if args.tokens or args.heads:
        out = [c._replace(tokens=args.tokens or c.tokens, heads=args.heads or c.heads,
                          kv_heads=min(args.heads or c.kv_heads, c.kv_heads) if args.heads else c.kv_heads)
               for c in out]
    return out


def main(argv=None):
    args = parse(argv)
    world = comm_mod.world()
    rank, size = world.Get_rank(), world.Get_size()
    backend, reason = comm_mod.select(args.backend)  # every rank agrees; this rank's GPU is now current
    gpu = backend in ("nccl", "mpi")  # numpy: the same benchmark on the CPU with stage 00 blocks (a smoke test)
    sizes = args.gpus or [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= size]
    if max(sizes) > size:
        raise SystemExit(f"--gpus {max(sizes)} needs at least that many ranks; started with {size}")
    dtype = {"bfloat16": bfloat16, "float16": np.float16, "float32": np.float32}[args.dtype]
    if not gpu:  # the sizes of this device
        args.tokens, args.heads = args.tokens or CPU_TOKENS, args.heads or CPU_HEADS
    todo = configs(args)
    vf, vb = (R.flash_version(dtype), "auto") if gpu else (None, None)
    name = gpu_name() if gpu else "CPU"
    torch_ok = _torch(world, gpu and backend == "nccl" and not args.no_torch and args.dtype != "float32")
    if rank == 0:
        print(f"== ring attention benchmark on {size} x {name}: backend {backend} ({reason}); rings of {sizes} GPUs; "
              f"{args.dtype} B={BATCH} D={args.head_dim}; stage 02 {vf} (stage 06 on sm_90), stage 03 {vb} "
              "(stage 06 ws on sm_90 at d = 64, 128); "
              f"PyTorch context parallel: "
              f"{'yes' if torch_ok is True else torch_ok}", flush=True)
        if backend != "nccl":
            print(f"   ({backend} backend: ranks share {'GPUs' if gpu else 'CPU cores'}, so these numbers show the "
                  "ring's overhead, not its scaling)")
    block = "flash" if gpu else "naive"
    one = _one_gpu_kernels(gpu)
    rows = []
    for P in sizes:
        sub = world.Split(0 if rank < P else 1, rank)  # the first P ranks form this ring
        ring = comm_mod.RINGS[backend](sub) if rank < P else None
        schemes = ["ring"] if P == 1 else args.schemes  # one GPU: one call, whatever the scheme
        if not all(_checked(world, sub, ring, P, todo, args, dtype, block, (vf, vb), gpu, s) for s in schemes):
            return False
        for cfg in todo:
            n = P * cfg.tokens
            one_gpu = _one_gpu(args, cfg, n, dtype, one, (vf, vb), gpu) if rank == 0 else None
            comm_mod.quiet_barrier(world)  # the other ranks sleep while rank 0 times one GPU alone
            torch_rows = {}
            if torch_ok is True and not (cfg.causal and cfg.layout == "contiguous"):  # (PyTorch balances causal)
                for kernel in TORCH_BACKENDS:
                    torch_rows[kernel] = _time_torch(world, P, args, cfg, kernel)
            for scheme in schemes:
                if scheme == "alltoall" and (cfg.heads % P or cfg.kv_heads % P):
                    continue  # (the all-to-all needs P | H and P | Hkv)
                got = _time_ring(ring, args, cfg, n, dtype, (vf, vb), block, gpu, scheme) if ring else None
                got = world.gather(got, root=0)
                if rank == 0:
                    rows.append(_row(name, backend, args, P, cfg, n, got[:P], one_gpu, torch_rows, scheme))
                    _print(rows[-1])
                if gpu:
                    __import__("cupy").get_default_memory_pool().free_all_blocks()
        sub.Free()
    if rank == 0 and args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {len(rows)} rows to {path}")
    elif rank == 0:
        print("(pass --out FILE.csv to keep these rows)")
    return True


def _torch(world, wanted):
    """True when PyTorch's context parallel runs here (dev/torch_cp.py), else why not (every rank agrees)."""
    if not wanted:
        return "skipped"
    try:
        sys.path.insert(0, str(ROOT / "dev"))
        import torch_cp

        ok = torch_cp.init(world)
    except Exception as e:  # noqa: BLE001 - the benchmark runs without it
        ok = f"{type(e).__name__}: {e}"
    every = world.allgather(ok)
    return True if all(x is True for x in every) else next(x for x in every if x is not True)


def _checked(world, sub, ring, P, todo, args, dtype, block, versions, gpu, scheme="ring"):
    """Check the ring (or scheme) of the first P ranks on a small problem for every (layout, mask, grouping) of
    todo."""
    failed = None
    kinds = sorted({(c.layout, c.causal, c.heads // c.kv_heads) for c in todo})
    for layout, causal, group in kinds:
        try:
            if ring is not None:
                check_on_ranks(sub, ring, B=1, H=P * group, n=CHECK_SEQ, D=args.head_dim, dtype=dtype, causal=causal,
                               layout=layout, block=block, versions=versions, xp=__import__("cupy") if gpu else np,
                               Hkv=P, scheme=scheme)
        except AssertionError as e:
            failed = f"{scheme} of {P}, {layout}, causal={causal}, H/Hkv={group}: {e}"
        failed = world.bcast(failed, root=0)
        if failed:
            if world.Get_rank() == 0:
                print(f"CHECK FAILED: {failed}\nThe ring is out of tolerance: nothing timed.", flush=True)
            return False
    if world.Get_rank() == 0:
        print(f"{scheme} of {P}: checked (N={CHECK_SEQ}, every layout, mask and grouping) within tolerance.",
              flush=True)
    return True


def _random(shape, dtype, gpu):
    rng = __import__("cupy").random.default_rng() if gpu else np.random.default_rng()
    return cast(rng.standard_normal(shape, dtype=np.float32), dtype)


def _inputs(args, cfg, L, dtype, gpu):
    """q, do (B, H, L, D) and k, v (B, Hkv, L, D), fresh random."""
    qs, ks = (BATCH, cfg.heads, L, args.head_dim), (BATCH, cfg.kv_heads, L, args.head_dim)
    return _random(qs, dtype, gpu), _random(ks, dtype, gpu), _random(ks, dtype, gpu), _random(qs, dtype, gpu)


def _time_ring(ring, args, cfg, n, dtype, versions, block, gpu, scheme="ring"):
    """This rank's ring (or scheme) forward/backward times, exposed communication and peak memory at total length n."""
    kw = dict(ring=ring, nq=n, nk=n, causal=cfg.causal, layout=cfg.layout, block=block, scheme=scheme)
    q, k, v, do = _inputs(args, cfg, R.shard_len(n, ring.size, cfg.layout), dtype, gpu)
    shards = q.nbytes + k.nbytes + v.nbytes + do.nbytes  # the activations a rank holds anyway
    with PeakMemory(gpu) as mem:  # the shards are the caller's; the ring's outputs, buffers and gradients count
        o, lse = R.ring_forward(q, k, v, version=versions[0], **kw)
        R.ring_backward(q, k, v, o, lse, do, version=versions[1], **kw)
    out = _times(lambda: R.ring_forward(q, k, v, version=versions[0], **kw),
                 lambda: R.ring_backward(q, k, v, o, lse, do, version=versions[1], **kw), args, gpu,
                 cfg.tokens * ring.size)
    tl_f, tl_b = [], []
    R.ring_forward(q, k, v, version=versions[0], timeline=tl_f, **kw)
    R.ring_backward(q, k, v, o, lse, do, version=versions[1], timeline=tl_b, **kw)
    return dict(out, peak=mem.peak + shards, exposed_f=sum(t["exposed_ms"] for t in tl_f),
                exposed_b=sum(t["exposed_ms"] for t in tl_b))


def _times(fwd, bwd, args, gpu, n):
    """{fwd, bwd}: queued times; {fwd_synced, bwd_synced}: synced (median). Fewer warm-up calls for long problems."""
    warm = 1 if n >= 65536 else 2
    return dict(fwd=time_queued_ms(fwd, gpu=gpu, warmup=warm, repeat=args.repeat),
                bwd=time_queued_ms(bwd, gpu=gpu, warmup=warm, repeat=args.repeat),
                fwd_synced=time_ms(fwd, gpu=gpu, warmup=0, repeat=args.repeat),
                bwd_synced=time_ms(bwd, gpu=gpu, warmup=0, repeat=args.repeat))


def _one_gpu_kernels(gpu):
    """forward, backward of one device: on a GPU the attention the ring's blocks run (ring.one_device_forward,
    ring.one_device_backward: stage 06's on an sm_90 GPU where it takes the problem, else stages 02 and 03); stage 00
    on the CPU (the smoke run)."""
    if gpu:
        return R.one_device_forward, R.one_device_backward
    from stages import naive

    return (lambda *a, version=None, **kw: naive.forward(*a, **kw),
            lambda *a, version=None, **kw: naive.backward(*a, **kw))


def _one_gpu(args, cfg, n, dtype, kernels, versions, gpu):
    """Stage 02 forward and stage 03 backward on the whole sequence, on rank 0's GPU alone."""
    fwd, bwd = kernels
    q, k, v, do = _inputs(args, cfg, n, dtype, gpu)
    shards = q.nbytes + k.nbytes + v.nbytes + do.nbytes
    kw = dict(causal=cfg.causal, scale=None)
    with PeakMemory(gpu) as mem:
        o, lse = fwd(q, k, v, version=versions[0], **kw)
        bwd(q, k, v, o, lse, do, version=versions[1], **kw)
    out = _times(lambda: fwd(q, k, v, version=versions[0], **kw),
                 lambda: bwd(q, k, v, o, lse, do, version=versions[1], **kw), args, gpu, n)
    return dict(out, peak=mem.peak + shards)


def _time_torch(world, P, args, cfg, kernel):
    """PyTorch's context parallel on the first P ranks (dev/torch_cp.py), or {"error": why} when it fails."""
    import torch_cp

    try:
        got = torch_cp.time_context_parallel(world, P, batch=BATCH, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                             tokens_per_gpu=cfg.tokens, head_dim=args.head_dim, dtype=args.dtype,
                                             causal=cfg.causal, backend=kernel, repeat=args.repeat,
                                             warmup=1 if cfg.tokens * P >= 65536 else 2)
    except RuntimeError as e:
        got = {"error": str(e)}
    return got


def r4(x):
    return round(float(x), 4)


def _provenance():
    """Software and code of this run: the columns that say where a row comes from."""
    out = {}
    try:
        import cupy

        out["cupy"] = cupy.__version__
        from cupy.cuda import nccl

        code = nccl.get_version()  # major * 10000 + minor * 100 + patch
        out["nccl"] = f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    except Exception:  # noqa: BLE001 - the CPU smoke run
        out.setdefault("cupy", "")
        out.setdefault("nccl", "")
    try:
        import torch

        out["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        out["torch"] = ""
    out["commit"] = code_version()
    return out


def _row(name, backend, args, P, cfg, n, got, one, torch_rows, scheme="ring"):
    t_f, t_b = max(g["fwd"] for g in got), max(g["bwd"] for g in got)  # the slowest rank sets the pace
    s_f, s_b = max(g["fwd_synced"] for g in got), max(g["bwd_synced"] for g in got)
    D = args.head_dim
    flops = attention_flops(BATCH, cfg.heads, n, n, D, causal=cfg.causal)
    bflops = attention_flops(BATCH, cfg.heads, n, n, D, causal=cfg.causal, backward=True)
    peak = max(g["peak"] for g in got)
    row = dict(
        gpu=name, backend=backend, gpus=P, config=cfg.name, scheme=scheme, dtype=args.dtype, batch=BATCH,
        heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=D, tokens_per_gpu=cfg.tokens, total_tokens=n,
        layout=cfg.layout, causal=cfg.causal,
        ring_fwd_ms=r4(t_f), ring_bwd_ms=r4(t_b), one_gpu_fwd_ms=r4(one["fwd"]), one_gpu_bwd_ms=r4(one["bwd"]),
        ring_fwd_ms_synced=r4(s_f), ring_bwd_ms_synced=r4(s_b), one_gpu_fwd_ms_synced=r4(one["fwd_synced"]),
        one_gpu_bwd_ms_synced=r4(one["bwd_synced"]),
        ring_fwd_tflops_per_gpu=r4(flops / P / t_f / 1e9), ring_bwd_tflops_per_gpu=r4(bflops / P / t_b / 1e9),
        fwd_efficiency=r4(one["fwd"] / (P * t_f)), bwd_efficiency=r4(one["bwd"] / (P * t_b)),
        efficiency=r4((one["fwd"] + one["bwd"]) / (P * (t_f + t_b))),
        efficiency_synced=r4((one["fwd_synced"] + one["bwd_synced"]) / (P * (s_f + s_b))),
        efficiency_target=cfg.target if cfg.target and P > 1 else "",
        fwd_exposed_comm_ms_max_rank=r4(max(g["exposed_f"] for g in got)),
        bwd_exposed_comm_ms_max_rank=r4(max(g["exposed_b"] for g in got)),
        peak_mb_per_gpu=r4(peak / 2**20), one_gpu_peak_mb=r4(one["peak"] / 2**20),
        mem_ratio=r4(peak / one["peak"]), one_over_p=r4(1 / P),
    )
    for kernel in TORCH_BACKENDS:
        got_t = torch_rows.get(kernel) or {}
        ok = "fwd_ms" in got_t
        row[f"torch_cp_{kernel}_fwd_ms"] = r4(got_t["fwd_ms"]) if ok else ""
        row[f"torch_cp_{kernel}_bwd_ms"] = r4(got_t["bwd_ms"]) if ok else ""
        row[f"torch_cp_{kernel}_peak_mb"] = r4(got_t["peak_bytes"] / 2**20) if ok else ""
        row[f"torch_cp_{kernel}_note"] = got_t.get("error", got_t.get("note", ""))[:200]
        if ok:
            row["torch_cp_rotate_method"] = got_t.get("rotate_method", "")
    row.setdefault("torch_cp_rotate_method", "")
    row.update(_provenance())
    return row


def _print(r):
    target = r["efficiency_target"]
    verdict = "" if target == "" else (" meets" if r["efficiency"] >= target else " MISSES") + f" {target}"
    mask = "causal" if r["causal"] else "full"
    line = (f"P={r['gpus']} {r['config']:>20} {r['scheme']:>9} T={r['tokens_per_gpu']:>6}/GPU "
            f"H={r['heads']}/{r['kv_heads']} "
            f"{r['layout']:>10} {mask:>6} | ours fwd {r['ring_fwd_ms']:8.2f} bwd {r['ring_bwd_ms']:8.2f} ms (synced "
            f"{r['ring_fwd_ms_synced']:.2f} {r['ring_bwd_ms_synced']:.2f}) | "
            f"efficiency fwd {r['fwd_efficiency']:.3f} bwd {r['bwd_efficiency']:.3f} fwd+bwd {r['efficiency']:.3f}"
            f"{verdict} | exposed fwd {r['fwd_exposed_comm_ms_max_rank']:.2f} bwd "
            f"{r['bwd_exposed_comm_ms_max_rank']:.2f} ms | peak/GPU {r['peak_mb_per_gpu']:.0f} MB = "
            f"{r['mem_ratio']:.2f} of one GPU's (1/P = {r['one_over_p']:.2f})")
    for kernel in TORCH_BACKENDS:
        if r[f"torch_cp_{kernel}_fwd_ms"] != "":
            line += (f" | torch CP {kernel} fwd {r[f'torch_cp_{kernel}_fwd_ms']:.2f} bwd "
                     f"{r[f'torch_cp_{kernel}_bwd_ms']:.2f} ms")
        elif r[f"torch_cp_{kernel}_note"]:
            line += f" | torch CP {kernel}: {r[f'torch_cp_{kernel}_note']}"
    print(line, flush=True)


if __name__ == "__main__":
    comm_mod.run_main(lambda: 0 if main() else 1)  # one rank's error ends every rank (never a hang)
