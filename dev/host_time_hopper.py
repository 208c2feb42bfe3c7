"""Stage 06's host side on one sm_90 GPU: the Python a first call of flash_v3.forward and flash_v3_backward.backward
crosses before its first launch, and the host time of a repeated call, for one or more trees in one run.

    python dev/host_time_hopper.py                                  # this checkout
    python dev/host_time_hopper.py --trees /tmp/before .            # two trees side by side (each in a subprocess)

The trace (sys.setprofile) records every Python function of the tree's own files (stages/, not CuPy's) from the
public call to its first cuLaunchKernel, in a process of its own (the compile included): how many functions, in how
many files, and their lines (each function's whole body). The problem is tiny (B = 1, H = 2, N = 128, d = 128, bf16,
causal), so the GPU finishes each call before the host has the next one ready: a repeated call's time is the host's,
the mean over 200 calls back to back (median and min over 15 rounds). Versions: forward pingpong and fp8, backward
auto (ws). Trees are measured one after the other on the same GPU; run it twice to see the spread.
"""
import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trace_first_call(fn, root):
    """(functions, files, lines) of the tree's Python that fn() runs before its first cuLaunchKernel."""
    seen, state = {}, {"done": False}

    def profile(frame, event, arg):
        if state["done"]:
            return
        if event == "c_call" and getattr(arg, "__name__", "") == "launchKernel":
            state["done"] = True
        elif event == "call" and frame.f_code.co_filename.startswith(os.path.join(root, "stages")):
            code = frame.f_code
            seen.setdefault((code.co_filename, code.co_firstlineno), code)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    lines = 0
    for code in seen.values():
        try:
            lines += len(inspect.getsourcelines(code)[0])
        except OSError:
            pass
    return len(seen), len({f for f, _ in seen}), lines


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
    return statistics.median(out), min(out)


def measure(root, what):
    """{functions, files, lines, us_median, us_min} of one call kind in the tree at root (imported from there): its
    first call in this process traced (the compile included), then its repeats timed."""
    sys.path.insert(0, root)
    import cupy

    from stages.common import bfloat16, make_inputs
    from stages.hopper import flash_v3, flash_v3_backward

    q, k, v, do = make_inputs(1, 2, 128, 128, 128, dtype=bfloat16, xp=cupy, grad=True)
    if what.startswith("backward"):
        o, lse = flash_v3.forward(q, k, v, causal=True)  # the forward's kernel is compiled first: not traced
        cupy.cuda.runtime.deviceSynchronize()
    calls = {"forward pingpong": lambda: flash_v3.forward(q, k, v, causal=True),
             "forward fp8": lambda: flash_v3.forward(q, k, v, causal=True, version="fp8"),
             "backward auto": lambda: flash_v3_backward.backward(q, k, v, o, lse, do, causal=True)}
    functions, files, lines = trace_first_call(calls[what], root)
    med, low = back_to_back(calls[what], cupy.cuda.runtime.deviceSynchronize)
    return dict(functions=functions, files=files, lines=lines, us_median=round(med, 2), us_min=round(low, 2))


CALLS = ("forward pingpong", "forward fp8", "backward auto")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[ROOT], help="repository trees to measure, each in a subprocess")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # tree, call
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(os.path.abspath(args.child[0]), args.child[1])))
        return 0
    results = {}
    for tree in args.trees:
        tree = os.path.abspath(tree)
        for what in CALLS:  # each in a process of its own: its first call is the process's first
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, what],
                                  capture_output=True, text=True, cwd=tree)
            if proc.returncode:
                raise SystemExit(f"{tree}, {what}: {proc.stderr[-3000:]}")
            results.setdefault(tree, {})[what] = json.loads(proc.stdout.splitlines()[-1])
    print("| tree | call | first call: functions | files | lines | repeated call, us (median) | min |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for tree, rows in results.items():
        for what, r in rows.items():
            print(f"| {tree} | {what} | {r['functions']} | {r['files']} | {r['lines']} | {r['us_median']} | "
                  f"{r['us_min']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
