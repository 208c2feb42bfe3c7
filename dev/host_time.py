"""Where the host's time in one call goes: the launchers' whole calls beside PyTorch's, and the pieces they are made
of, on one GPU, in one run.

    python dev/host_time.py [--out results/host_time_h100.csv]

The problem is tiny (B = 1, H = 2, N = 128, d = 128, bf16, causal), so the GPU finishes each call's kernels before
the host has the next call ready: what is timed is the host. A whole call is timed as the mean over 200 calls back
to back (median and min over 15 rounds); so are the pieces, except cuLaunchKernel alone, which is timed one launch
at a time: after a wait for the GPU (idle), and behind about 10 ms of queued matrix products (busy: the driver's
cost of a launch while the GPU works, as in dev/bench.py's queued mode and in a training step).

Rows: the whole calls (forward: one launch and two outputs; backward: two launches, three outputs and the scratch;
deterministic backward: three launches), PyTorch's scaled_dot_product_attention (flash) and its backward on the same
inputs, then fast_path.call_key, a pool allocation, one array object over pool memory, one kernels.Launch, and
cuLaunchKernel alone. dev/bench_report.py puts the table in results/README.md.

    python dev/host_time.py --before PATH [--out host_time_before_after.csv]

times, in one run on one GPU, the host's time per call of this tree and of the tree at PATH (an older checkout,
e.g. `git worktree add PATH 403905d`): each tree in processes of its own that import that tree's `stages`, taking
turns (--turns, two each by default). The calls are those both trees take: a repeated plain forward (its kept plan),
a forward whose plan is not kept (the launcher's whole path), a repeated forward with a window, one with ALiBi slopes
as an array (never kept), a packed batch, the ring's block call (tc.merge_into), a repeated backward, plain and
deterministic. It prints each call's time in both trees and their ratio, and writes one row per tree and call.
"""
import argparse
import csv
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

FIELDS = ["step", "what", "us_median", "us_min", "samples", "problem"]
PROBLEM = dict(B=1, H=2, N=128, D=128)


def back_to_back(fn, sync, calls=200, rounds=15):
    """(median, min) over rounds of the mean host time of `calls` calls of fn back to back, in us."""
    fn()
    sync()
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return statistics.median(out), min(out), f"{rounds} x {calls}"


def one_at_a_time(fn, before, sync, samples=100):
    """(median, min) of the host time of one call of fn, each after before(), in us."""
    fn()
    out = []
    for _ in range(samples):
        before()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(out), min(out), str(samples)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="the CSV written (default: results/host_time_h100.csv; with "
                    "--before: host_time_before_after.csv)")
    ap.add_argument("--before", help="another tree (an older checkout): time both, in one run")
    ap.add_argument("--turns", type=int, default=2, help="with --before: processes per tree, taking turns")
    ap.add_argument("--time-tree", help=argparse.SUPPRESS)  # a worker: time the calls of the tree at this root
    args = ap.parse_args(argv)
    if args.time_tree:
        return time_tree(args.time_tree)
    if args.before:
        return compare_trees(os.path.abspath(args.before), args.out or "host_time_before_after.csv", args.turns)
    args.out = args.out or os.path.join(ROOT, "results", "host_time_h100.csv")
    import bench  # environment, provenance, DLPack helpers

    from stages import flash_v2, flash_v2_backward
    from stages.common import bfloat16, fast_path, make_inputs

    cupy, torch = bench._environment()
    from cupy_backends.cuda.api import driver

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    prov = bench.provenance(cupy, torch, gpu)
    sync = cupy.cuda.Device().synchronize
    B, H, N, D = PROBLEM.values()
    problem = f"B={B} H={H} N={N} d={D} bf16 causal"
    q, k, v = make_inputs(B, H, N, N, D, dtype=bfloat16, xp=cupy)
    do = make_inputs(B, H, N, N, D, dtype=bfloat16, xp=cupy)[0]
    o, lse = flash_v2.forward(q, k, v, causal=True)
    rows = []

    def add(step, what, timing):
        med, best, samples = timing
        rows.append(dict(step=step, what=what, us_median=f"{med:.2f}", us_min=f"{best:.2f}", samples=samples,
                         problem=problem, **prov))
        print(f"{step:>28}: median {med:7.2f} us   min {best:7.2f} us   ({what})", flush=True)

    bwd = flash_v2_backward.backward
    add("forward", "flash_v2.forward, a repeated plain call: its key, o and lse, one launch",
        back_to_back(lambda: flash_v2.forward(q, k, v, causal=True), sync))
    add("backward", "flash_v2_backward.backward, a repeated plain call: its key, dq, dk, dv, the scratch, two "
        "launches", back_to_back(lambda: bwd(q, k, v, o, lse, do, causal=True), sync))
    add("backward, deterministic", "the same with deterministic=True: three launches",
        back_to_back(lambda: bwd(q, k, v, o, lse, do, causal=True, deterministic=True), sync))

    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv, tdo = (bench._to_torch(x, torch) for x in (q, k, v, do))  # (B, H, N, D), the same memory
    for t in (tq, tk, tv):
        t.requires_grad_(True)

    def torch_forward():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    out = torch_forward()
    add("torch forward", "scaled_dot_product_attention, flash backend, same inputs", back_to_back(torch_forward, sync))
    add("torch backward", "torch.autograd.grad through it (its flash backward)",
        back_to_back(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True), sync))

    args6 = (q, k, v, o, lse, do)
    add("call_key", "fast_path.call_key of the backward's six arrays and options",
        back_to_back(lambda: fast_path.call_key(args6, {"causal": True}), sync))
    add("pool allocation", "cupy.cuda.alloc from CuPy's memory pool (4 KB)",
        back_to_back(lambda: cupy.cuda.alloc(4096), sync))
    mem = cupy.cuda.alloc(1 << 20)
    add("array object", "cupy.ndarray over pool memory: one per output array",
        back_to_back(lambda: cupy.ndarray((B, H, N, D), bfloat16, memptr=mem), sync))
    plan = next(iter(flash_v2_backward.backward.plans.values()))  # the plain backward's kept plan (calls above)
    ptrs = [mem.ptr] * 7
    add("Launch", "kernels.Launch of the backward's preprocess: seven device addresses packed, then cuLaunchKernel",
        back_to_back(lambda: plan.pre(*ptrs), sync))
    values, _, params, pack = plan.pre._slots_for(7)
    pack(values, 0, *ptrs)
    fn, stream = plan.pre.fn.kernel.ptr, cupy.cuda.get_current_stream().ptr
    launch = lambda: driver.launchKernel(fn, *plan.pre.dims, stream, params, 0)  # noqa: E731
    add("cuLaunchKernel, GPU idle", "the driver's launch alone, after a wait for the GPU",
        one_at_a_time(launch, sync, sync))
    x = cupy.ones((4096, 4096), cupy.float32)

    def busy():
        sync()
        for _ in range(3):
            x @ x

    add("cuLaunchKernel, GPU busy", "the driver's launch alone, behind about 10 ms of queued matrix products",
        one_at_a_time(launch, busy, sync))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS + list(prov))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}", flush=True)


# ---- this tree beside another: the calls both trees take, timed in processes of their own

TREE_FIELDS = ["tree", "turn", "step", "what", "us_median", "us_min", "samples", "problem"]


def tree_calls(cupy):
    """[(step, what, fn)]: the calls timed in each tree, with the API both trees share."""
    from stages import flash_v2, flash_v2_backward
    from stages.common import bfloat16, make_inputs

    B, H, N, D = PROBLEM.values()
    q, k, v = make_inputs(B, H, N, N, D, dtype=bfloat16, xp=cupy)
    do = make_inputs(B, H, N, N, D, dtype=bfloat16, xp=cupy)[0]
    q32, k32, v32 = make_inputs(B, H, N, N, D, dtype=np.float32, xp=cupy)
    o, lse = flash_v2.forward(q, k, v, causal=True)
    slopes = cupy.asarray([0.5, 0.25][:H], dtype=cupy.float32)
    qp, kp, vp = (x[0].transpose(1, 0, 2).copy() for x in (q, k, v))  # packed (N, H, D): batch 0's rows
    cu = cupy.asarray([0, N - 16, N], dtype=cupy.int32)  # two sequences, of N - 16 and 16 tokens
    o_run = cupy.zeros((B, H, N, D), cupy.float32)
    lse_run = cupy.full((B, H, N), -np.inf, cupy.float32)
    fwd, bwd = flash_v2.forward, flash_v2_backward.backward

    def unkept():
        fwd.plans.clear()  # the plain path: checks, configuration, compile lookup, launch
        return fwd(q, k, v, causal=True)

    return [
        ("forward", "flash_v2.forward, a repeated plain call (bf16, causal): its kept plan",
         lambda: fwd(q, k, v, causal=True)),
        ("forward, not kept", "the same call with no kept plan: the launcher's whole path", unkept),
        ("forward fp32", "flash_v2.forward, a repeated float32 call (auto)", lambda: fwd(q32, k32, v32, causal=True)),
        ("forward, window", "flash_v2.forward, a repeated call with window=(45, 0)",
         lambda: fwd(q, k, v, causal=True, window=(45, 0))),
        ("forward, ALiBi array", "flash_v2.forward with alibi_slopes a CuPy array (never kept)",
         lambda: fwd(q, k, v, causal=True, alibi_slopes=slopes)),
        ("forward_varlen", "flash_v2.forward_varlen, two sequences packed (never kept)",
         lambda: flash_v2.forward_varlen(qp, kp, vp, cu, cu, causal=True)),
        ("merge_into", "the ring's block call: tc.merge_into on rows 0:64 x keys 0:128, into float32 O, L",
         lambda: flash_v2.tc.merge_into(q, k, v, o_run, lse_run, (0, 64), (0, 128), causal=True, scale=0.125)),
        ("backward", "flash_v2_backward.backward, a repeated plain call: its kept plan",
         lambda: bwd(q, k, v, o, lse, do, causal=True)),
        ("backward, deterministic", "the same with deterministic=True",
         lambda: bwd(q, k, v, o, lse, do, causal=True, deterministic=True)),
    ]


def time_tree(root):
    """The worker: time tree_calls with the `stages` of the tree at root; one JSON line per call on stdout."""
    import json

    sys.path.insert(0, os.path.abspath(root))
    import cupy

    import stages

    assert os.path.dirname(os.path.dirname(os.path.abspath(stages.__file__))) == os.path.abspath(root), stages.__file__
    sync = cupy.cuda.Device().synchronize
    for step, what, fn in tree_calls(cupy):
        med, best, samples = back_to_back(fn, sync)
        print(json.dumps(dict(step=step, what=what, us_median=med, us_min=best, samples=samples)), flush=True)
    return 0


def compare_trees(before, out, turns):
    """Time this tree and the tree at `before` in turns (before, this, before, this, ...), each turn a process of its
    own; print each call's median over turns in both trees and the ratio, and write every turn's rows to out."""
    import json
    import subprocess

    import cupy

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    B, H, N, D = PROBLEM.values()
    problem = f"B={B} H={H} N={N} d={D} bf16 causal"
    rows, by = [], {}
    for turn in range(turns):
        for tree, root in (("before", before), ("after", ROOT)):
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--time-tree", root],
                                 capture_output=True, text=True, cwd=root)
            if run.returncode:
                raise SystemExit(f"timing the tree at {root} failed:\n{run.stdout}{run.stderr[-4000:]}")
            for line in run.stdout.splitlines():
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                rows.append(dict(tree=tree, turn=turn, problem=problem, **{k: r[k] for k in TREE_FIELDS[2:-1]}))
                by.setdefault(r["step"], {}).setdefault(tree, []).append(r["us_median"])
    print(f"host time per call on {gpu}, {problem}: median over {turns} turns of each tree's median (us)")
    print(f"{'call':>26} {'before':>9} {'after':>9} {'after/before':>13}")
    for step, t in by.items():
        b, a = statistics.median(t["before"]), statistics.median(t["after"])
        print(f"{step:>26} {b:>9.2f} {a:>9.2f} {a / b:>13.3f}")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TREE_FIELDS + ["gpu"])
        w.writeheader()
        for r in rows:
            w.writerow({**r, "us_median": f"{r['us_median']:.2f}", "us_min": f"{r['us_min']:.2f}", "gpu": gpu})
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
