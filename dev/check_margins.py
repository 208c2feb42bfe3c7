"""How close the correct GPU kernels come to the tolerance rule's bounds: the largest error / bound per kernel.

    python dev/check_margins.py --out results/margins_h100.csv         # on a GPU; every version it can run
    python dev/check_margins.py --draws 1 --scales 100 --out /tmp/m.csv   # a quick look

The rule (stages/common/tolerance.py) must pass every correct kernel, and catch what it can: the tighter its bounds,
the more mistakes it sees, until a correct kernel's rounding reaches them. This runs every GPU kernel version of
stages 01, 02, 03 and 06 (06 on an sm_90 GPU only) in every dtype it takes, on random inputs at x1, x10 and x100
(q, k, v scaled; dO at unit scale), head dims 64, 128 and 256 where the version takes them, causal and not, a
problem off tile multiples with Nq != Nk, and records, per (kernel, dtype, head dim, input scale), the largest error
/ bound over the draws and outputs (at the worst row; below 1 passes) and the draw's seed. The rule is computed once
per inputs and shared by the kernels (verify.forward_rule / backward_rule): its CPU time is most of the run.

Exits 1 if any kernel reaches its bound (error / bound >= 1) or fails to run; the CSV says which and where.
"""
import argparse
import csv
import math
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stages import flash_v1, flash_v2, flash_v2_backward, naive  # noqa: E402, F401  (naive: the rule's reference)
from stages.common import bfloat16, code_version, device, gpu_name, make_inputs, tolerance, verify  # noqa: E402

SCALES = (1.0, 10.0, 100.0)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": bfloat16}
HEAD_DIMS = (64, 128, 256)
SHAPE = (2, 2, 300, 333)  # B, H, Nq, Nk: off tile multiples, Nq != Nk, a few hundred rows per draw


def kernels(hopper):
    """[(stage, name, direction, dtypes, head dims, fn)]: every correct GPU kernel version; fn has the stage API."""
    f32, b16 = ("float32",), ("float16", "bfloat16")
    v2, v3 = flash_v2.forward, flash_v2_backward.backward
    out = [("01", "forward", "forward", f32, (64, 128), flash_v1.forward),
           ("01", "backward", "backward", f32, (64, 128), flash_v1.backward)]
    for ver, dts, dims in (("fp32", f32, (64, 128)), ("fp32_overlap", f32, (64, 128)), ("fp32x3", f32, (64, 128)),
                           ("tc", b16, (64, 128)), ("pipelined", b16, (64, 128, 256))):
        out.append(("02", ver, "forward", dts, dims, lambda *a, _v=ver, **kw: v2(*a, version=_v, **kw)))
    for ver, dts, dims in (("fp32", f32, (64, 128)), ("fp32x3", f32, (64, 128)), ("tc", b16, (64, 128, 256))):
        for det in (False, True) if ver != "fp32x3" else (False,):
            out.append(("03", ver + (" deterministic" if det else ""), "backward", dts, dims,
                        lambda *a, _v=ver, _d=det, **kw: v3(*a, version=_v, deterministic=_d, **kw)))
    if hopper:
        from stages.hopper import flash_v3, flash_v3_backward, fp8

        for ver in flash_v3.VERSIONS:
            out.append(("06", ver, "forward", b16, flash_v3.HEAD_DIMS,
                        lambda *a, _v=ver, **kw: flash_v3.forward(*a, version=_v, **kw)))
        out.append(("06", flash_v3.FP32, "forward", f32, (64, 128),
                    lambda *a, **kw: flash_v3.forward(*a, version=flash_v3.FP32, **kw)))
        out.append(("06", flash_v3.FP8, "forward", b16, fp8.HEAD_DIMS,
                    lambda *a, **kw: flash_v3.forward(*a, version=flash_v3.FP8, **kw)))
        for ver in flash_v3_backward.VERSIONS:
            out.append(("06", ver, "backward", b16, flash_v3_backward.VERSION_HEAD_DIMS[ver],
                        lambda *a, _v=ver, **kw: flash_v3_backward.backward(*a, version=_v, **kw)))
    return out


def _ratio(outs, refs, bounds):
    """(largest error / bound, the output's index) over the outputs, each at its worst row."""
    worst, at = -1.0, 0
    for n, (x, ref, bound) in enumerate(zip(outs, refs, bounds)):
        err, b, _ = tolerance.worst_row(x, ref, bound)
        r = 0.0 if err == 0 else err / b if b else math.inf
        if r > worst:
            worst, at = r, n
    return worst, at


def run(draws, scales, head_dims, base_seed, cpu=False, log=print):
    """The CSV's rows. cpu: numpy inputs, so every stage runs its CPU mirror (a dry run of this script)."""
    if cpu:
        xp, hopper = np, False
    else:
        import cupy as xp

        hopper = True
        try:
            from stages.hopper import blocks

            blocks.require_hopper()
        except device.UnsupportedDevice as e:
            hopper = False
            log(f"stage 06 not run: {e}")
    ks = kernels(hopper)
    stats = {}  # (stage, name, direction, dtype, D, scale) -> [ratio, output, seed, checks, status]
    for t_i, (dname, dtype) in enumerate(DTYPES.items()):
        for D in head_dims:
            todo = [k for k in ks if dname in k[3] and D in k[4]]
            if not todo:
                continue
            for c_i, scale_in in enumerate(scales):
                t0 = time.perf_counter()
                for d in range(draws):
                    for causal in (False, True):
                        seed = [base_seed, t_i, D, SCALES.index(scale_in), d, int(causal)]
                        q, k, v, do = make_inputs(*SHAPE, D, dtype=dtype, xp=xp, scale=scale_in, grad=True,
                                                  seed=seed)
                        for stage, name, direction, _, _, fn in todo:
                            key = (stage, name, direction, dname, D, scale_in)
                            st = stats.setdefault(key, [-1.0, "", "", 0, "ok"])
                            try:
                                if direction == "forward":
                                    if name == "fp8":  # its own yardstick (fp8.yardstick), as fp8.check uses
                                        from stages.hopper import fp8

                                        refs, bounds = verify.forward_rule(q, k, v, causal, None, {}, fp8.yardstick)
                                    else:
                                        refs, bounds = verify.forward_rule(q, k, v, causal, None, {})
                                    outs = fn(q, k, v, causal=causal)
                                else:
                                    refs, bounds, start = verify.backward_rule(q, k, v, do, causal, None, {})
                                    outs = fn(q, k, v, *start, do, causal=causal)
                                r, n = _ratio(outs, refs, bounds)
                            except Exception as e:  # a kernel that does not run is a finding, not a crash
                                st[4] = f"error: {type(e).__name__}: {str(e)[:200]}"
                                continue
                            st[3] += 1
                            if r > st[0]:
                                names = tolerance.NAMES_FORWARD if direction == "forward" else tolerance.NAMES_BACKWARD
                                st[:3] = [r, names[n], "-".join(map(str, seed))]
                log(f"[{time.perf_counter() - t0:.0f} s] {dname} d={D} x{scale_in:g}: {len(todo)} kernels x "
                    f"{2 * draws} draws")
    commit, gpu = code_version(), "CPU (the stages' numpy mirrors)" if cpu else gpu_name()
    return [{"stage": key[0], "kernel": key[1], "direction": key[2], "dtype": key[3], "head_dim": key[4],
             "scale": f"x{key[5]:g}", "checks": st[3], "worst_err_over_bound": f"{st[0]:.3g}", "worst_output": st[1],
             "worst_seed": st[2], "status": st[4] if st[4] != "ok" or st[0] < 1 else "bound reached", "gpu": gpu,
             "git_commit": commit} for key, st in stats.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=2, help="draws per (dtype, head dim, scale), causal and not each")
    ap.add_argument("--scales", type=float, nargs="+", default=list(SCALES), choices=SCALES)
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS), choices=HEAD_DIMS)
    ap.add_argument("--seed", type=int, default=0, help="base seed of every draw")
    ap.add_argument("--out", required=True, help="the CSV to write")
    ap.add_argument("--cpu", action="store_true", help="numpy inputs: the CPU mirrors (a dry run of this script)")
    args = ap.parse_args(argv)
    rows = run(args.draws, args.scales, args.head_dims, args.seed, cpu=args.cpu,
               log=lambda s: print(s, file=sys.stderr, flush=True))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    worst = {}
    for r in rows:
        key = f"{r['stage']} {r['kernel']} ({r['direction']})"
        if key not in worst or float(r["worst_err_over_bound"]) > float(worst[key]["worst_err_over_bound"]):
            worst[key] = r
    print(f"largest error / bound per kernel on {rows[0]['gpu']} (commit {rows[0]['git_commit']}):")
    for key, r in worst.items():
        print(f"  {key:32s} {float(r['worst_err_over_bound']):.3f}  ({r['dtype']} d={r['head_dim']} {r['scale']}, "
              f"{r['worst_output']}, seed {r['worst_seed']})")
    bad = [r for r in rows if r["status"] != "ok"]
    for r in bad:
        print(f"NOT OK: {r['stage']} {r['kernel']} {r['dtype']} d={r['head_dim']} {r['scale']}: {r['status']}")
    print(f"wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
