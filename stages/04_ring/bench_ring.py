"""Ring attention benchmark: the ring on 1, 2, 4... GPUs against stages 02/03 on ONE GPU, in one run.

One launch measures every ring size up to the number of ranks: with `mpirun -n 4` it times rings of 1, 2
and 4 GPUs (sub-communicators of the first P ranks; the others sleep meanwhile). For each ring size P,
tokens per GPU T, and (layout, mask) it times, with CUDA events (warm-up, median of repeats):
  the ring forward and backward on P GPUs, total length N = P*T (the slowest rank sets the time);
  stage 02 forward and stage 03 backward on one GPU (rank 0 alone) at the same N,
and reports
  per-GPU throughput  FLOPs / P / t_ring  (TFLOP/s), and its ratio to one GPU's: t_one / (P * t_ring)
  exposed communication  per rank, summed over the ring's steps: time the compute stream waited on a transfer
  peak memory per GPU  the CuPy pool's peak inside the ring call (its shards, outputs and ring buffers),
                       against one GPU's peak at the same N (target: about 1/P)
Before timing a ring size, the same ring (same backend, dtype, head dim, block versions) is checked on a
small problem for every (layout, mask), by the tolerance rule against the fp64 oracle, as run.py checks it;
nothing is timed if a check fails. Contiguous causal is shown for contrast with zigzag (its ranks wait on
each other: the imbalance zigzag removes).

    mpirun -n 2 python stages/04_ring/bench_ring.py --out results/ring_h200.csv     # rings of 1 and 2 GPUs
    mpirun -n 4 python stages/04_ring/bench_ring.py --out results/ring_h200x4.csv   # rings of 1, 2 and 4 GPUs
    mpirun -n 2 python stages/04_ring/bench_ring.py --tokens 8192 --repeat 3        # quicker
    mpirun -n 2 python stages/04_ring/bench_ring.py --backend numpy --tokens 64 --heads 2 --head-dim 32  # CPU smoke
Every CSV row names the GPU, the backend and the sizes, so files from several machines can be put together.
"""
import argparse
import csv
import os
import pathlib
import sys

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # CPU smoke run: one core per rank
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

from stages import ring as R  # noqa: E402
from stages.common import PeakMemory, attention_flops, bfloat16, cast, gpu_name, time_ms  # noqa: E402
from stages.common.cli import positive_int  # noqa: E402
from stages.ring import comm as comm_mod  # noqa: E402
from stages.ring.run import check_on_ranks  # noqa: E402

# ---- configuration (each overridable on the command line)
TOKENS = (16384, 32768)  # tokens per GPU
BATCH, HEADS, HEAD_DIM = 1, 16, 128
CONFIGS = (("contiguous", False, 0.90), ("zigzag", True, 0.85), ("contiguous", True, None))  # layout, causal, target
BWD_TARGET = 0.85
CHECK_SEQ = 512  # total N of the check that runs before each ring size is timed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=comm_mod.BACKENDS, default="auto", help="nccl: one GPU per rank")
    ap.add_argument("--gpus", type=positive_int, nargs="+", default=None,
                    help="ring sizes to time (default: 1, 2, 4, ... up to the number of ranks)")
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=list(TOKENS), help="tokens per GPU")
    ap.add_argument("--batch", type=positive_int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=positive_int, default=HEADS, help="heads H")
    ap.add_argument("--head-dim", type=positive_int, default=HEAD_DIM, help="head dimension D")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="input dtype")
    ap.add_argument("--fwd-version", default=None, help="stage 02 version (default: pipelined, fp32 for float32)")
    ap.add_argument("--bwd-version", default="auto", help="stage 03 version")
    ap.add_argument("--repeat", type=positive_int, default=5, help="timed repeats (median)")
    ap.add_argument("--out", default=None, help="write the rows to this CSV file (rank 0), e.g. results/ring_h200.csv")
    args = ap.parse_args(argv)
    world = comm_mod.world()
    rank, size = world.Get_rank(), world.Get_size()
    backend, reason = comm_mod.select(args.backend)  # every rank agrees; this rank's GPU is now current
    gpu = backend in ("nccl", "mpi")  # numpy: the same benchmark on the CPU with stage 00 blocks (a smoke test)
    sizes = args.gpus or [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= size]
    if max(sizes) > size:
        raise SystemExit(f"--gpus {max(sizes)} needs at least that many ranks; started with {size}")
    dtype = {"bfloat16": bfloat16, "float16": np.float16, "float32": np.float32}[args.dtype]
    B, H, D = args.batch, args.heads, args.head_dim
    vf, vb = (R.flash_version(dtype, args.fwd_version), args.bwd_version) if gpu else (None, None)
    name = gpu_name() if gpu else "CPU"
    if rank == 0:
        print(f"== ring attention benchmark on {name}: {size} ranks, backend {backend} ({reason}); rings of "
              f"{sizes} GPUs; {args.dtype} B={B} H={H} D={D}; stage 02 {vf}, stage 03 {vb}", flush=True)
        if backend != "nccl":
            print(f"   ({backend} backend: ranks share {'GPUs' if gpu else 'CPU cores'}, so these numbers show the "
                  "ring's overhead, not its scaling)")
    block = "flash" if gpu else "naive"
    if gpu:  # one device: stage 02 forward, stage 03 backward (the ring's blocks return float32 partials)
        from stages import flash_v2, flash_v2_backward

        fwd1, bwd1 = flash_v2.forward, flash_v2_backward.backward
    else:  # the numpy smoke run: stage 00 (it has no versions)
        from stages import naive

        fwd1, bwd1 = (lambda *a, version=None, **kw: naive.forward(*a, **kw),
                      lambda *a, version=None, **kw: naive.backward(*a, **kw))
    rows, one_cache = [], {}
    for P in sizes:
        sub = world.Split(0 if rank < P else 1, rank)  # the first P ranks form this ring
        ring = comm_mod.RINGS[backend](sub) if rank < P else None
        failed = None
        for layout, causal, _ in CONFIGS:  # check this ring before timing it
            try:
                if ring is not None:
                    check_on_ranks(sub, ring, B=1, H=2, n=CHECK_SEQ, D=D, dtype=dtype, causal=causal, layout=layout,
                                   block=block, versions=(vf, vb), xp=__import__("cupy") if gpu else np)
            except AssertionError as e:
                failed = f"ring of {P}, {layout}, causal={causal}: {e}"
            failed = world.bcast(failed, root=0)
            if failed:
                if rank == 0:
                    print(f"CHECK FAILED: {failed}\nThe ring is out of tolerance: nothing timed.", flush=True)
                return False
        if rank == 0:
            print(f"ring of {P}: checked (N={CHECK_SEQ}, every layout and mask) within tolerance. Timing.", flush=True)
        for T in args.tokens:
            n = P * T
            for layout, causal, target in CONFIGS:
                got = _time_ring(ring, sub, args, n, layout, causal, dtype, vf, vb, block, gpu) if ring else None
                got = world.gather(got, root=0)
                if rank == 0:
                    if (n, causal) not in one_cache:
                        one_cache[(n, causal)] = _one_gpu(B, H, n, D, dtype, causal, fwd1, bwd1, vf, vb, args.repeat,
                                                          gpu)
                    rows.append(_row(name, backend, args, P, T, n, layout, causal, target, got[:P],
                                     one_cache[(n, causal)]))
                    _print(rows[-1])
                comm_mod.quiet_barrier(world)  # ranks outside this ring (and rank 0's one-GPU run) sleep here
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


def _random(shape, dtype, gpu):
    rng = __import__("cupy").random.default_rng() if gpu else np.random.default_rng()
    return cast(rng.standard_normal(shape, dtype=np.float32), dtype)


def _time_ring(ring, sub, args, n, layout, causal, dtype, vf, vb, block, gpu):
    """This rank's ring forward/backward times, exposed communication and peak memory at total length n."""
    kw = dict(ring=ring, nq=n, nk=n, causal=causal, layout=layout, block=block)
    L = R.shard_len(n, ring.size, layout)
    q, k, v, do = (_random((args.batch, args.heads, L, args.head_dim), dtype, gpu) for _ in range(4))  # (B, H, L, D)
    with PeakMemory(gpu) as mem:  # the shards are the caller's; the ring's outputs, buffers and gradients count
        o, lse = R.ring_forward(q, k, v, version=vf, **kw)
        R.ring_backward(q, k, v, o, lse, do, version=vb, **kw)
    shards = 4 * q.nbytes  # q, k, v, do: the activations a rank holds anyway
    sub.Barrier()
    t_f = time_ms(lambda: R.ring_forward(q, k, v, version=vf, **kw), gpu=gpu, warmup=2, repeat=args.repeat)
    t_b = time_ms(lambda: R.ring_backward(q, k, v, o, lse, do, version=vb, **kw), gpu=gpu, warmup=2,
                  repeat=args.repeat)
    tl_f, tl_b = [], []
    R.ring_forward(q, k, v, version=vf, timeline=tl_f, **kw)
    R.ring_backward(q, k, v, o, lse, do, version=vb, timeline=tl_b, **kw)
    return dict(fwd=t_f, bwd=t_b, peak=mem.peak + shards, exposed_f=sum(t["exposed_ms"] for t in tl_f),
                exposed_b=sum(t["exposed_ms"] for t in tl_b), compute_f=sum(t["compute_ms"] for t in tl_f),
                compute_b=sum(t["compute_ms"] for t in tl_b))


def _one_gpu(B, H, n, D, dtype, causal, fwd, bwd, vf, vb, repeat, gpu):
    """Stage 02 forward and stage 03 backward on the whole sequence, on rank 0's GPU alone."""
    q, k, v, do = (_random((B, H, n, D), dtype, gpu) for _ in range(4))  # (B, H, n, D)
    with PeakMemory(gpu) as mem:
        o, lse = fwd(q, k, v, causal=causal, scale=None, version=vf)
        bwd(q, k, v, o, lse, do, causal=causal, scale=None, version=vb)
    t_f = time_ms(lambda: fwd(q, k, v, causal=causal, scale=None, version=vf), gpu=gpu, warmup=2, repeat=repeat)
    t_b = time_ms(lambda: bwd(q, k, v, o, lse, do, causal=causal, scale=None, version=vb), gpu=gpu, warmup=2,
                  repeat=repeat)
    return dict(fwd=t_f, bwd=t_b, peak=mem.peak + 4 * q.nbytes)


def r4(x):
    return round(float(x), 4)


def _row(name, backend, args, P, T, n, layout, causal, target, got, one):
    t_f, t_b = max(g["fwd"] for g in got), max(g["bwd"] for g in got)  # the slowest rank sets the pace
    flops = attention_flops(args.batch, args.heads, n, n, args.head_dim, causal=causal)
    bflops = attention_flops(args.batch, args.heads, n, n, args.head_dim, causal=causal, backward=True)
    peak = max(g["peak"] for g in got)
    return dict(
        gpu=name, backend=backend, gpus=P, dtype=args.dtype, batch=args.batch, heads=args.heads,
        head_dim=args.head_dim, tokens_per_gpu=T, total_tokens=n, layout=layout, causal=causal,
        ring_fwd_ms=r4(t_f), ring_bwd_ms=r4(t_b), one_gpu_fwd_ms=r4(one["fwd"]), one_gpu_bwd_ms=r4(one["bwd"]),
        ring_fwd_tflops_per_gpu=r4(flops / P / t_f / 1e9), ring_bwd_tflops_per_gpu=r4(bflops / P / t_b / 1e9),
        one_gpu_fwd_tflops=r4(flops / one["fwd"] / 1e9), one_gpu_bwd_tflops=r4(bflops / one["bwd"] / 1e9),
        fwd_ratio=r4(one["fwd"] / (P * t_f)), bwd_ratio=r4(one["bwd"] / (P * t_b)),
        fwd_target=target if target else "", bwd_target=BWD_TARGET if (layout == "zigzag" or not causal) else "",
        fwd_compute_ms_max_rank=r4(max(g["compute_f"] for g in got)),
        fwd_exposed_comm_ms_max_rank=r4(max(g["exposed_f"] for g in got)),
        bwd_compute_ms_max_rank=r4(max(g["compute_b"] for g in got)),
        bwd_exposed_comm_ms_max_rank=r4(max(g["exposed_b"] for g in got)),
        peak_mb_per_gpu=r4(peak / 2**20), one_gpu_peak_mb=r4(one["peak"] / 2**20),
        mem_ratio=r4(peak / one["peak"]), mem_target=r4(1 / P),
    )


def _print(r):
    def verdict(x, t):
        return "" if t == "" else (" meets" if x >= t else " MISSES") + f" {t}"

    mask = "causal" if r["causal"] else "full"
    print(f"P={r['gpus']} T={r['tokens_per_gpu']:>6}/GPU N={r['total_tokens']:>7} {r['layout']:>10} {mask:>6} | "
          f"fwd {r['ring_fwd_ms']:8.2f} ms {r['ring_fwd_tflops_per_gpu']:6.1f} TF/GPU, one GPU "
          f"{r['one_gpu_fwd_tflops']:6.1f} -> {r['fwd_ratio']:.3f}{verdict(r['fwd_ratio'], r['fwd_target'])} | "
          f"bwd {r['ring_bwd_ms']:8.2f} ms {r['ring_bwd_tflops_per_gpu']:6.1f} TF/GPU, one GPU "
          f"{r['one_gpu_bwd_tflops']:6.1f} -> {r['bwd_ratio']:.3f}{verdict(r['bwd_ratio'], r['bwd_target'])} | "
          f"exposed comm fwd {r['fwd_exposed_comm_ms_max_rank']:.2f} / bwd {r['bwd_exposed_comm_ms_max_rank']:.2f} ms"
          f" | peak/GPU {r['peak_mb_per_gpu']:.0f} MB = {r['mem_ratio']:.2f} of one GPU's (1/P = "
          f"{r['mem_target']:.2f})", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(0 if main() else 1)
    except SystemExit:
        raise
    except BaseException as e:  # one rank's error ends the job (never a hang)
        import traceback

        comm_mod.abort(e, trace=traceback.format_exc())
    sys.exit(1)
