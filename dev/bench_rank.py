"""One rank of the ring on one GPU: what a rank's own schedule costs, before any network is involved.

A rank of a ring of P does more than one P-th of one device's work: its steps are smaller problems, it fills and casts
float32 accumulators, copies its block into the travelling halves, waits, merges, launches many calls. All of that
happens on one GPU whatever the network, so it is measured here on one GPU, rank by rank: stage 04's loopback
communicator (comm.LoopbackRing) runs rank r of P alone, its exact schedule, its transfers device copies on the
transfer stream (--mode copy) or none at all (--mode none). For each problem of CONFIGS (tokens per GPU T, heads H,
kv heads Hkv, layout, mask), each ring size P and each variant (stage 04's candidates, --variants) it times
  one GPU    the whole problem, N = P T tokens (ring.one_device_forward / one_device_backward: stage 06 on sm_90)
  rank r     ring_forward / ring_backward of rank r alone, every r (calls queued back to back, CUDA events)
and reports the per-GPU compute efficiency = one GPU's time / (P x the slowest rank's time), forward and backward
(1.00: a rank wastes nothing; what it loses here, it loses on any network too). Each rank's per-step compute goes to
the CSV (what dev/ring_links.py turns into the tokens per GPU at which a link's transfer hides behind a step). For
one rank of each (problem, P, variant) a timeline of every phase of its calls (stage 04's marks.tracing: CUDA events
around the fills, the copies into the travelling halves, each step's wait, calls and transfer posts, the casts, with
the host's time of each) goes to --timeline, and its sum by phase is printed.

Check before timing: for every (layout, mask, head grouping) of the problems, every P and every variant, a small ring
is simulated on this device (threads) and recorded; each of its ranks then runs alone on a loopback that replays what
the rank received (mode replay), and the ranks' gathered outputs are held to the tolerance rule against the fp64
oracle. Nothing is timed if a check fails.

    python dev/bench_rank.py --out results/ring_rank_h100.csv --timeline results/ring_rank_timeline_h100.csv
    python dev/bench_rank.py --head-dims 64 --ranks 1 2 --variants base --append --out results/ring_rank_h100.csv
    python dev/bench_rank.py --quick                              # about a minute on a GPU
    python dev/bench_rank.py --quick --cpu                        # numpy, tiny: a smoke test of this script
The default run (5 problems, P = 1, 2, 4, 8, 5 variants) takes about 5 minutes on one H100. Every CSV row names the
GPU, the variant, the repeats and the commit.
"""
import argparse
import csv
import datetime
import pathlib
import statistics
import sys
import time
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import stages.hopper  # noqa: E402, F401  registers stage 06's kernels: the ring's blocks on an sm_90 GPU
from stages import naive, ring  # noqa: E402
from stages.common import bfloat16, cast, code_version, gpu_name, verify  # noqa: E402
from stages.common.cli import positive_int  # noqa: E402
from stages.ring import candidates, marks  # noqa: E402


class Config(NamedTuple):
    """One problem per GPU: T tokens, H query heads, Hkv kv heads; target: the per-GPU efficiency issue 70 asks of
    a rank at P > 1 (forward and backward each)."""
    name: str
    tokens: int
    heads: int
    kv_heads: int
    layout: str
    causal: bool
    target: float


# ---- configuration (each overridable on the command line)
CONFIGS = (
    Config("8k-causal", 8192, 32, 32, "zigzag", True, 0.90),
    Config("8k-causal-h16", 8192, 16, 16, "zigzag", True, 0.90),
    Config("8k-causal-gqa", 8192, 32, 8, "zigzag", True, 0.90),
    Config("8k-full", 8192, 32, 32, "contiguous", False, 0.95),
    Config("32k-causal-h16", 32768, 16, 16, "zigzag", True, 0.95),
)
QUICK = ("8k-causal", "8k-full")  # --quick: these problems, P = 1, 2, 4, 2 repeats
RANKS = (1, 2, 4, 8)
VARIANTS = ("base", "fold", "serial-fwd", "serial-bwd", "fold+serial-fwd+serial-bwd")
BATCH, HEAD_DIM, REPEAT = 1, 128, 3
CHECK_TOKENS = {"gpu": 128, "cpu": 16}  # tokens per rank of the checks
CPU = dict(tokens=32, heads=2, head_dim=16)  # --cpu: every problem at these sizes (numpy, stage 00 blocks)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=[c.name for c in CONFIGS], default=None,
                    help="problems (default: all; --quick: " + ", ".join(QUICK) + ")")
    ap.add_argument("--ranks", type=positive_int, nargs="+", default=None, help=f"ring sizes P (default {RANKS})")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                    help="base, or candidates of stages/04_ring/candidates.py joined by '+' "
                         f"({', '.join(candidates.CANDIDATES)})")
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[HEAD_DIM], help="head dims d")
    ap.add_argument("--mode", choices=("copy", "none"), default="copy",
                    help="the loopback's transfers: device copies on the transfer stream, or no bytes moved")
    ap.add_argument("--repeat", type=positive_int, default=None, help=f"timed calls (default {REPEAT}; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="two problems, P = 1, 2, 4, two repeats")
    ap.add_argument("--cpu", action="store_true", help="numpy on the CPU at tiny sizes (a smoke test)")
    ap.add_argument("--out", default=None, help="CSV of one row per (problem, P, variant), e.g. "
                                                "results/ring_rank_h100.csv")
    ap.add_argument("--append", action="store_true", help="add the rows to --out instead of replacing it")
    ap.add_argument("--timeline", default=None, help="CSV of every traced phase of one rank per row")
    args = ap.parse_args(argv)
    try:
        args.variants = [(v, candidates.check(v.split("+"))) for v in args.variants]
    except ValueError as e:
        ap.error(f"--variants: {e}")
    return args


def problems(args):
    """(configs, ring sizes, repeat) of this run."""
    names = args.configs or (QUICK if args.quick else [c.name for c in CONFIGS])
    todo = [c for c in CONFIGS if c.name in names]
    if args.cpu:  # the same layouts, masks and head groupings at tiny sizes
        todo = [c._replace(tokens=CPU["tokens"], heads=CPU["heads"] * (c.heads // c.kv_heads), kv_heads=CPU["heads"])
                for c in todo]
    sizes = args.ranks or ((1, 2) if args.cpu else (1, 2, 4) if args.quick else RANKS)
    return todo, sizes, args.repeat or (1 if args.cpu else 2 if args.quick else REPEAT)


class Device(NamedTuple):
    xp: object
    gpu: bool
    dtype: object
    block: str
    name: str


def _random(dev, shape):
    rng = dev.xp.random.default_rng()
    return cast(rng.standard_normal(shape, dtype=np.float32), dev.dtype)


def _calls(fn, dev, warmup, repeat):
    """(GPU ms, host ms) per call of fn, queued back to back after warm-up (the host's time to queue a call)."""
    for _ in range(warmup):
        fn()
    if not dev.gpu:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / repeat
        return ms, ms
    start, stop = dev.xp.cuda.Event(), dev.xp.cuda.Event()
    dev.xp.cuda.get_current_stream().synchronize()
    start.record()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / repeat
    stop.record()
    stop.synchronize()
    return dev.xp.cuda.get_elapsed_time(start, stop) / repeat, host


def one_gpu(cfg, P, D, dev, repeat):
    """{fwd, bwd}: one device's forward and backward on the whole problem, N = P T."""
    n = P * cfg.tokens
    q, do = (_random(dev, (BATCH, cfg.heads, n, D)) for _ in range(2))
    k, v = (_random(dev, (BATCH, cfg.kv_heads, n, D)) for _ in range(2))
    fwd, bwd = ((ring.one_device_forward, ring.one_device_backward) if dev.block == "flash" else
                (naive.forward, naive.backward))
    o, lse = fwd(q, k, v, causal=cfg.causal)
    f, _ = _calls(lambda: fwd(q, k, v, causal=cfg.causal), dev, 1, repeat)
    b, _ = _calls(lambda: bwd(q, k, v, o, lse, do, causal=cfg.causal), dev, 1, repeat)
    return {"fwd": f, "bwd": b}


def one_rank(cfg, P, r, D, dev, repeat, mode, trace=None):
    """Rank r of P alone (LoopbackRing): {fwd, bwd, fwd_host, bwd_host, steps_f, steps_b}; with trace (a list), the
    phases of one more forward and backward are appended to it."""
    n, lb = P * cfg.tokens, ring.LoopbackRing(r, P, mode)
    L = ring.shard_len(n, P, cfg.layout)
    q, do = (_random(dev, (BATCH, cfg.heads, L, D)) for _ in range(2))
    k, v = (_random(dev, (BATCH, cfg.kv_heads, L, D)) for _ in range(2))
    kw = dict(ring=lb, nq=n, nk=n, causal=cfg.causal, layout=cfg.layout, block=dev.block)
    with np.errstate(all="ignore"):  # (mode none: the received blocks are whatever their buffers held)
        tl_f, tl_b = [], []  # the first calls (a warm-up) take the per-step timeline
        o, lse = ring.ring_forward(q, k, v, timeline=tl_f, **kw)
        ring.ring_backward(q, k, v, o, lse, do, timeline=tl_b, **kw)
        f, f_host = _calls(lambda: ring.ring_forward(q, k, v, **kw), dev, 0, repeat)
        b, b_host = _calls(lambda: ring.ring_backward(q, k, v, o, lse, do, **kw), dev, 0, repeat)
        if trace is not None:
            with marks.tracing() as phases:
                ring.ring_forward(q, k, v, **kw)
                ring.ring_backward(q, k, v, o, lse, do, **kw)
            trace.extend(phases)
    return dict(fwd=f, bwd=b, fwd_host=f_host, bwd_host=b_host, steps_f=[t["compute_ms"] for t in tl_f],
                steps_b=[t["compute_ms"] for t in tl_b])


def check(todo, sizes, variants, D, dev):
    """For every (layout, mask, grouping) of todo, ring size P >= 2 and variant: a small ring simulated and recorded,
    then each rank alone on a replaying loopback; the gathered outputs against the fp64 oracle by the tolerance rule.
    Returns the first failure, or None."""
    kinds = sorted({(c.layout, c.causal, c.heads // c.kv_heads) for c in todo})
    T = CHECK_TOKENS["gpu" if dev.gpu else "cpu"]
    for (layout, causal, group), P in ((kind, P) for kind in kinds for P in sizes if P > 1):
        n, Hkv = P * T, 2
        q, k, v, do = (dev.xp.asarray(x) for x in verify_inputs(Hkv * group, Hkv, n, D, dev.dtype))
        refs, bounds, (o_in, lse_in) = verify.rule(q, k, v, do, causal=causal)  # once for every variant
        kw = dict(nq=n, nk=n, causal=causal, layout=layout, block=dev.block)

        def rank_fn(rg):
            cut = [ring.shard(x, rg.rank, P, layout) for x in (q, k, v, o_in, lse_in, do)]
            return (*ring.ring_forward(*cut[:3], ring=rg, **kw), *ring.ring_backward(*cut, ring=rg, **kw))

        for variant, names in variants:
            with candidates.trying(*names):
                _, received = ring.recorded(rank_fn, P)
                outs = [rank_fn(ring.LoopbackRing(r, P, "replay", received[r])) for r in range(P)]
            got = [ring.unshard([dev.xp.asnumpy(o[i]) if dev.gpu else o[i] for o in outs], n, layout)
                   for i in range(5)]
            try:
                verify.check_outputs(got, refs, bounds)
            except AssertionError as e:
                return f"{variant}, P={P}, {layout}, causal={causal}, H/Hkv={group}: {e}"
    return None


def verify_inputs(H, Hkv, n, D, dtype):
    from stages.common import make_inputs

    q, k, v, do = make_inputs(BATCH, H, n, n, D, dtype=dtype, grad=True)
    return q, k[:, :Hkv], v[:, :Hkv], do


def row(dev, cfg, P, D, variant, mode, repeat, one, ranks):
    """One CSV row: the problem, the variant, efficiency, the slowest rank's times, its step times, provenance."""
    worst_f = max(range(P), key=lambda r: ranks[r]["fwd"])
    worst_b = max(range(P), key=lambda r: ranks[r]["bwd"])
    t_f, t_b = ranks[worst_f]["fwd"], ranks[worst_b]["bwd"]
    e = np.dtype(dev.dtype).itemsize
    L = ring.shard_len(P * cfg.tokens, P, cfg.layout)
    return dict(
        gpu=dev.name, gpus=P, config=cfg.name, tokens_per_gpu=cfg.tokens, heads=cfg.heads, kv_heads=cfg.kv_heads,
        head_dim=D, layout=cfg.layout, causal=cfg.causal, dtype=np.dtype(dev.dtype).name, batch=BATCH,
        variant=variant, mode=mode, fwd_efficiency=round(one["fwd"] / (P * t_f), 4),
        bwd_efficiency=round(one["bwd"] / (P * t_b), 4),
        efficiency=round((one["fwd"] + one["bwd"]) / (P * (t_f + t_b)), 4), target=cfg.target if P > 1 else "",
        one_gpu_fwd_ms=round(one["fwd"], 4), one_gpu_bwd_ms=round(one["bwd"], 4), rank_fwd_ms=round(t_f, 4),
        rank_bwd_ms=round(t_b, 4), slowest_fwd_rank=worst_f, slowest_bwd_rank=worst_b,
        rank_fwd_ms_all=";".join(f"{x['fwd']:.4f}" for x in ranks),
        rank_bwd_ms_all=";".join(f"{x['bwd']:.4f}" for x in ranks),
        fwd_host_ms=round(ranks[worst_f]["fwd_host"], 4), bwd_host_ms=round(ranks[worst_b]["bwd_host"], 4),
        fwd_step_ms=_median(ranks[worst_f]["steps_f"]), bwd_step_ms=_median(ranks[worst_b]["steps_b"]),
        fwd_steps=len(ranks[worst_f]["steps_f"]),
        fwd_outside_ms=round(t_f - sum(ranks[worst_f]["steps_f"]), 4),
        bwd_outside_ms=round(t_b - sum(ranks[worst_b]["steps_b"]), 4),
        kv_bytes_per_hop=2 * BATCH * cfg.kv_heads * L * D * e,
        dkv_bytes_per_half=BATCH * cfg.kv_heads * L * D * (e + 4),  # a half's K, V and float32 dK, dV: L/2 rows
        repeats=repeat, commit=code_version(), cupy=_cupy_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _median(xs):
    return round(statistics.median(xs), 4) if xs else ""


def _cupy_version():
    try:
        import cupy

        return cupy.__version__
    except ImportError:
        return ""


def summary(phases):
    """The traced phases of one rank summed by (call, phase): GPU ms, host ms, count; and what lies outside the
    steps (the call's span minus its steps' compute and waits)."""
    out = {}
    for p in phases:
        key = (p["call"], p["phase"])
        got = out.setdefault(key, [0.0, 0.0, 0])
        got[0] += p["gpu_ms"]
        got[1] += p["host_ms"]
        got[2] += 1
    lines = []
    for call in ("forward", "backward"):
        span = out.get((call, "call"), [0.0])[0]
        inside = sum(out.get((call, name), [0.0])[0] for name in ("compute", "wait"))
        parts = ", ".join(f"{name} {g:.3f} ms ({n}x, host {h:.3f})" for (c, name), (g, h, n) in out.items()
                          if c == call and name != "call")
        lines.append(f"    {call}: span {span:.3f} ms, outside the steps {span - inside:.3f} ms; {parts}")
    return "\n".join(lines)


def write(path, rows, append=False):
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = list(csv.DictReader(open(path, newline=""))) if append and path.exists() else []
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(old + rows)


def main(argv=None):
    args = parse(argv)
    todo, sizes, repeat = problems(args)
    if args.cpu:
        dev = Device(np, False, np.float32, "naive", "CPU")
        dims = [CPU["head_dim"]]
    else:
        import cupy

        dev = Device(cupy, True, bfloat16, "flash", gpu_name())
        dims = args.head_dims
    kernels = ring.compute.registered_for(dev.dtype, dims[0], H=todo[0].heads, Hkv=todo[0].heads, B=BATCH) \
        if dev.gpu else None
    print(f"== one rank of the ring on one {dev.name}: {np.dtype(dev.dtype).name}, B={BATCH}, d={dims}, blocks "
          f"{dev.block} ({kernels.name if kernels else 'stages 02/03' if dev.gpu else 'stage 00'}), loopback mode "
          f"{args.mode}, rings of {list(sizes)}, variants {[v for v, _ in args.variants]}, {repeat} repeats",
          flush=True)
    for D in dims:
        failed = check(todo, sizes, args.variants, D, dev)
        if failed:
            print(f"CHECK FAILED: {failed}\nNothing timed.", flush=True)
            return False
    print("checked: every rank alone (loopback, replayed) gives the ring's result within tolerance. Timing.",
          flush=True)
    rows, trace_rows = [], []
    for D in dims:
        for cfg in todo:
            for P in sizes:
                one = one_gpu(cfg, P, D, dev, repeat)
                for variant, names in args.variants:
                    trace, r_traced = [], min(1, P - 1)
                    with candidates.trying(*names):
                        ranks = [one_rank(cfg, P, r, D, dev, repeat, args.mode,
                                          trace if r == r_traced else None) for r in range(P)]
                    rows.append(row(dev, cfg, P, D, variant, args.mode, repeat, one, ranks))
                    _print(rows[-1], summary(trace), r_traced)
                    trace_rows += [dict(gpu=dev.name, gpus=P, config=cfg.name, head_dim=D, variant=variant,
                                        rank=r_traced, **{key: round(x, 4) if isinstance(x, float) else x
                                                          for key, x in p.items()}, commit=rows[-1]["commit"])
                                   for p in trace]
                if dev.gpu:
                    dev.xp.get_default_memory_pool().free_all_blocks()
    if args.out:
        write(args.out, rows, args.append)
        print(f"wrote {len(rows)} rows to {args.out}")
    if args.timeline and trace_rows:
        write(args.timeline, trace_rows, args.append)
        print(f"wrote {len(trace_rows)} phases to {args.timeline}")
    return True


def _print(r, phases, rank):
    mask = "causal" if r["causal"] else "full"
    verdict = "" if r["target"] == "" else (" meets" if min(r["fwd_efficiency"], r["bwd_efficiency"]) >= r["target"]
                                            else " MISSES") + f" {r['target']}"
    print(f"P={r['gpus']} {r['config']:>15} d={r['head_dim']} {r['variant']:>26} | one GPU fwd "
          f"{r['one_gpu_fwd_ms']:.3f} bwd {r['one_gpu_bwd_ms']:.3f} ms | slowest rank fwd {r['rank_fwd_ms']:.3f} "
          f"bwd {r['rank_bwd_ms']:.3f} ms (host {r['fwd_host_ms']:.3f}, {r['bwd_host_ms']:.3f}) | efficiency fwd "
          f"{r['fwd_efficiency']:.3f} bwd {r['bwd_efficiency']:.3f}{verdict} | {r['layout']} {mask} "
          f"H={r['heads']}/{r['kv_heads']}", flush=True)
    print(f"  rank {rank}'s phases:\n{phases}", flush=True)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
