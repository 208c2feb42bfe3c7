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
"""
import argparse
import csv
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

import bench  # noqa: E402  (environment, provenance, DLPack helpers)

from stages import flash_v2, flash_v2_backward  # noqa: E402
from stages.common import bfloat16, fast_path, make_inputs  # noqa: E402

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
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "host_time_h100.csv"))
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
