"""The Python a public call runs before its kernel launch: every function of stages/ it enters, in order, with its file
and length, from the first call of a fresh process. What a reader of the call follows through the code.

    python dev/trace_calls.py                           # every entry, this tree (a GPU: CuPy fp16 inputs, causal)
    python dev/trace_calls.py --before /tmp/before      # the same in an older checkout beside it
    python dev/trace_calls.py --entries flash_v2.forward --list     # the functions themselves, in call order
    python dev/trace_calls.py --xp numpy                # no GPU: the numpy path (the mirrors), to try the script

Entries: flash_v2.forward, flash_v2_backward.backward, flash_v3.forward (an sm_90 GPU) and ring.forward with
block="flash" (two simulated ranks, zigzag), each on (B, H, N, D) = (1, 2, 256, 64) float16, causal. Each runs in a
process of its own that imports the tree's `stages`, so every cache inside the process is cold: the call is a first
call (the kernels may come from CuPy's compile cache on disk, which is no code of the tree's). sys.setprofile and
threading.setprofile see every Python function entered, in every thread (the ring's ranks are threads); a function
counts when its file is under the tree's stages/. "to the launch" stops at the first cuLaunchKernel of the
launchers' Launch (CuPy's driver.launchKernel); "whole call" runs to the return. Functions: named functions and
methods (lambdas and comprehensions are listed, not counted); lines: each counted function's first to last line.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRIES = ("flash_v2.forward", "flash_v2_backward.backward", "flash_v3.forward", "ring.forward")
SHAPE = (1, 2, 256, 64)  # B, H, N, D


def _inputs(xp, dtype):
    from stages.common import make_inputs

    B, H, N, D = SHAPE
    return make_inputs(B, H, N, N, D, dtype=dtype, xp=xp, grad=True)


def _call(entry, xp):
    """(fn, why-not): the public call of entry, ready to run, or None and the reason it cannot run here."""
    import numpy as np

    dtype = np.float16
    q, k, v, do = _inputs(xp, dtype)
    if entry == "flash_v2.forward":
        from stages import flash_v2

        return (lambda: flash_v2.forward(q, k, v, causal=True)), ""
    if entry == "flash_v2_backward.backward":
        from stages import flash_v2, flash_v2_backward

        o, lse = flash_v2.forward.__wrapped__(q, k, v, causal=True) if hasattr(flash_v2.forward, "__wrapped__") \
            else flash_v2.forward(q, k, v, causal=True)
        return (lambda: flash_v2_backward.backward(q, k, v, o, lse, do, causal=True)), ""
    if entry == "flash_v3.forward":
        if xp is np:
            return None, "stage 06 runs on an sm_90 GPU only"
        from stages.hopper import flash_v3

        if not flash_v3.takes(dtype, SHAPE[3]):
            return None, "stage 06 does not run on this GPU (sm_90 needed)"
        return (lambda: flash_v3.forward(q, k, v, causal=True)), ""
    if entry == "ring.forward":
        from stages import ring

        return (lambda: ring.forward(q, k, v, causal=True, block="flash", ranks=2)), ""
    raise SystemExit(f"unknown entry {entry!r}; choose from {ENTRIES}")


def trace(root, entry, xp_name):
    """The worker: trace one entry's first call with the tree at root; print one JSON object."""
    import threading

    sys.path.insert(0, root)
    import stages

    assert os.path.dirname(os.path.dirname(os.path.abspath(stages.__file__))) == root, stages.__file__
    xp = __import__("cupy" if xp_name == "cupy" else "numpy")
    fn, why = _call(entry, xp)
    if fn is None:
        print(json.dumps({"entry": entry, "skipped": why}))
        return 0
    stages_dir = os.path.join(root, "stages") + os.sep
    seen, order, state = {}, [], {"launch": None, "calls": 0}
    lock = threading.Lock()

    def profile(frame, event, arg):
        if event == "call":
            co = frame.f_code
            if co.co_filename.startswith(stages_dir):
                with lock:
                    state["calls"] += 1
                    key = (co.co_filename, co.co_firstlineno, co.co_qualname)
                    if key not in seen:
                        last = max((line for _, _, line in co.co_lines() if line), default=co.co_firstlineno)
                        seen[key] = len(order)
                        order.append([os.path.relpath(co.co_filename, root), co.co_firstlineno, co.co_qualname,
                                      last - co.co_firstlineno + 1, state["calls"]])
        elif event == "c_call" and state["launch"] is None and getattr(arg, "__name__", "") == "launchKernel":
            with lock:
                state["launch"] = (len(order), state["calls"])

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(json.dumps({"entry": entry, "functions": order, "launch": state["launch"], "calls": state["calls"]}))
    return 0


def summary(functions):
    """(named functions, files, lines) of a list of [file, line, name, lines, ...]."""
    named = [f for f in functions if not f[2].split(".")[-1].startswith("<")]
    return len(named), len({f[0] for f in functions}), sum(f[3] for f in named)


def run(root, entry, xp_name):
    """The worker's JSON for one entry in the tree at root (a process of its own)."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", root, "--entries", entry,
                           "--xp", xp_name], capture_output=True, text=True, cwd=root)
    if proc.returncode:
        return {"entry": entry, "skipped": "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(tree, got, listing):
    if "skipped" in got:
        print(f"  {tree:>6}: skipped ({got['skipped']})")
        return
    functions = got["functions"]
    upto = functions[:got["launch"][0]] if got["launch"] else functions
    n, files, lines = summary(upto)
    wn, wfiles, wlines = summary(functions)
    where = "to the launch" if got["launch"] else "no launch (whole call)"
    print(f"  {tree:>6}: {where}: {n} functions in {files} files, {lines} lines; whole call: {wn} functions in "
          f"{wfiles} files, {wlines} lines, {got['calls']} calls")
    if listing:
        for path, line, name, length, _ in upto:
            print(f"          {path}:{line} {name} ({length} lines)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", nargs="+", default=list(ENTRIES), choices=ENTRIES)
    ap.add_argument("--before", help="an older checkout, traced beside this tree")
    ap.add_argument("--root", default=ROOT, help="the tree traced (default: this checkout)")
    ap.add_argument("--xp", choices=("cupy", "numpy"), default="cupy", help="numpy: the CPU path, to try the script")
    ap.add_argument("--list", action="store_true", help="print the functions up to the launch, in call order")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return trace(os.path.abspath(args.worker), args.entries[0], args.xp)
    trees = [("after", os.path.abspath(args.root))]
    if args.before:
        trees.append(("before", os.path.abspath(args.before)))
    B, H, N, D = SHAPE
    print(f"first call of each entry: (B, H, N, D) = ({B}, {H}, {N}, {D}) float16, causal, {args.xp} arrays")
    for entry in args.entries:
        print(entry)
        for tree, root in trees:
            report(tree, run(root, entry, args.xp), args.list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
