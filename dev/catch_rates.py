"""How often the real checks catch a wrong answer, and how often they pass a right one: results/catch_rates.csv.

    python dev/catch_rates.py                          # every scale, dtype and shape, 20 draws each
    python dev/catch_rates.py --draws 200 --controls-only --shapes small   # the correct stages' pass rate

For inputs q, k, v multiplied by 1, 10 and 100 (as make_inputs(scale=...) draws them; dO stays at unit scale),
in float32, bfloat16 and float16, on a few shapes, each draw runs stages.common.verify.check_forward and
check_backward (the checks every test and run.py use) on

  wrong answers: a correct stage's outputs with one mistake, rounded to the output's dtype:
      o x 0.95, lse + 0.01 (forward);  dq x 0.9, dq = 0, dk x 0.9, dv x 0.95 (backward, started from the
      oracle's o and lse as check_backward starts every backward);
    the correct stage is the CPU tile mirror of stage 02 (forward) and stage 03 (backward) in the dtype's version
    (fp32 for float32, tc for 16 bits);
  right answers (positive controls): correct stages that are not the tolerance rule's yardstick (stage 00 in the
    inputs' dtype): the CPU tile mirrors of stage 02 (versions fp32, fp32x3 for float32; tc, pipelined for 16
    bits), of stage 03 (fp32 / tc, atomic and deterministic dQ; fp32x3, atomic, for float32) and of stage 01
    (float32).

It counts, per (scale, dtype, shape), the draws in which each mistake is caught (the check raises) and each correct
stage passes (it does not). Beside each mistake, best_possible counts the draws in which the tightest check that
passes every correct answer of the draw could catch it: some row of the wrong output is farther from the oracle
than every correct stage's and the yardstick's (both orders) are in that row. No rule that passes those correct
answers row by row catches a mistake in more draws; where best_possible is low, the mistake is below the rounding
of correct kernels on those inputs. The column worst_err_over_bound is, over the draws, the smallest error/bound of
a mistake (above 1: caught in every draw) or the largest of a correct stage (below 1: passed in every draw);
error/bound is the largest, over the outputs and their rows, of a row's error over its bound.

Draw d of (shape s, dtype t, scale c) uses make_inputs(seed=[base seed, s, t, c, d]): every number replays.
"""
import argparse
import csv
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stages import flash_v1, flash_v2, flash_v2_backward  # noqa: E402
from stages.common import bfloat16, cast, code_version, make_inputs, tolerance, verify  # noqa: E402

SCALES = (1.0, 10.0, 100.0)
DTYPES = {"float32": np.float32, "bfloat16": bfloat16, "float16": np.float16}
# (B, H, Nq, Nk, D, causal): square causal and not, ragged causal (Nq != Nk, not tile multiples), a small one, a
# longer one; each draw of each stays well under a second on one CPU core.
SHAPES = {
    "B1H2-q128k128-d64-full": (1, 2, 128, 128, 64, False),
    "B1H2-q128k128-d64-causal": (1, 2, 128, 128, 64, True),
    "B1H2-q70k130-d64-causal": (1, 2, 70, 130, 64, True),
    "B2H3-q7k7-d64-causal": (2, 3, 7, 7, 64, True),
    "B1H1-q256k256-d64-causal": (1, 1, 256, 256, 64, True),
}
SMALL = ("B2H3-q7k7-d64-causal", "B1H2-q70k130-d64-causal")


def _times(x, f):
    return cast(x.astype(np.float64) * f, x.dtype)


# name -> (direction, the wrong outputs from the right ones)
MISTAKES = {
    "o x0.95": ("forward", lambda o, lse: (_times(o, 0.95), lse)),
    "lse + 0.01": ("forward", lambda o, lse: (o, lse + lse.dtype.type(0.01))),
    "dq x0.9": ("backward", lambda dq, dk, dv: (_times(dq, 0.9), dk, dv)),
    "dq = 0": ("backward", lambda dq, dk, dv: (np.zeros_like(dq), dk, dv)),
    "dk x0.9": ("backward", lambda dq, dk, dv: (dq, _times(dk, 0.9), dv)),
    "dv x0.95": ("backward", lambda dq, dk, dv: (dq, dk, _times(dv, 0.95))),
}


def _low(dtype):
    return np.dtype(dtype).itemsize == 2


def base_stage(direction, dtype):
    """The correct stage the mistakes are made in: stage 02's / stage 03's mirror in the dtype's version."""
    version = "tc" if _low(dtype) else "fp32"
    if direction == "forward":
        return lambda q, k, v, **kw: flash_v2.forward(q, k, v, version=version, **kw)
    return lambda *a, **kw: flash_v2_backward.backward(*a, version=version, **kw)


def controls(dtype):
    """{name: (direction, stage)}: the correct stages that must pass, for this dtype (none is the yardstick)."""
    out = {}
    for version in (("tc", "pipelined") if _low(dtype) else ("fp32", "fp32x3")):
        out[f"02 {version}"] = ("forward", lambda q, k, v, _v=version, **kw: flash_v2.forward(q, k, v, version=_v,
                                                                                            **kw))
    version = "tc" if _low(dtype) else "fp32"
    for det in (False, True):
        out[f"03 {version}{' deterministic' if det else ''}"] = (
            "backward", lambda *a, _v=version, _d=det, **kw: flash_v2_backward.backward(*a, version=_v,
                                                                                       deterministic=_d, **kw))
    if not _low(dtype):  # the 3xTF32 backward (atomic dQ only)
        out["03 fp32x3"] = ("backward", lambda *a, **kw: flash_v2_backward.backward(*a, version="fp32x3", **kw))
    if not _low(dtype):
        out["01 forward"] = ("forward", flash_v1.forward)
        out["01 backward"] = ("backward", flash_v1.backward)
    return out


def _ratio(outs, refs, bounds):
    """The largest error / bound over the outputs, each at its worst row."""
    worst = 0.0
    for x, ref, bound in zip(outs, refs, bounds):
        err, b, _ = tolerance.worst_row(x, ref, bound)
        worst = max(worst, 0.0 if err == 0 else err / b if b else float("inf"))
    return worst


def run(shapes, dtypes, scales, draws, seed, do_mistakes=True, do_controls=True, log=print):
    """Yield one row per (scale, dtype, shape, mistake or stage)."""
    commit = code_version()
    for c_i, scale in enumerate(scales):
        for t_i, (dname, dtype) in enumerate(dtypes.items()):
            for s_i, (sname, (B, H, Nq, Nk, D, causal)) in enumerate(shapes.items()):
                t0 = time.perf_counter()
                whats = {}
                if do_mistakes:
                    for name, (direction, wrong) in MISTAKES.items():
                        base = base_stage(direction, dtype)
                        whats[name] = ("mistake", direction,
                                       lambda *a, _b=base, _w=wrong, **kw: _w(*_b(*a, **kw)))
                for name, (direction, stage) in controls(dtype).items():  # the best-possible column needs them
                    whats[name] = ("stage", direction, stage)
                counts = {w: 0 for w in whats}
                best = {w: 0 for w in whats}
                worst = {w: None for w in whats}
                for d in range(draws):
                    q, k, v, do = make_inputs(B, H, Nq, Nk, D, dtype=dtype, scale=scale, grad=True,
                                              seed=[seed, s_i, t_i, c_i, d])
                    refs, bounds, start = verify.rule(q, k, v, do, causal=causal)
                    kw = dict(causal=causal, scale=None)
                    ys = {"forward": tolerance.forward_yardsticks(q, k, v, **kw),
                          "backward": tolerance.backward_yardsticks(q, k, v, *start, do, **kw)}
                    outs = {}
                    for w, (kind, direction, stage) in whats.items():
                        check = verify.check_forward if direction == "forward" else verify.check_backward
                        args = (q, k, v) if direction == "forward" else (q, k, v, do)
                        seen = []

                        def recorded(*a, _s=stage, _seen=seen, **kw_):
                            _seen.append(_s(*a, **kw_))
                            return _seen[-1]
                        try:
                            check(recorded, *args, causal=causal)
                            failed = False
                        except AssertionError:
                            failed = True
                        counts[w] += failed if kind == "mistake" else not failed
                        outs[w] = seen[-1]
                        part = slice(0, 2) if direction == "forward" else slice(2, 5)
                        r = _ratio(outs[w], refs[part], bounds[part])
                        worst[w] = r if worst[w] is None else (min if kind == "mistake" else max)(worst[w], r)
                    for w, (kind, direction, _) in whats.items():  # the tightest rule that passes every correct
                        part = slice(0, 2) if direction == "forward" else slice(2, 5)  # answer, row by row
                        corrects = [outs[c] for c, (k_, d_, _) in whats.items() if k_ == "stage" and d_ == direction]
                        corrects += ys[direction]
                        seen_out = any(
                            (tolerance.row_errors(outs[w][n], ref) >
                             np.max([tolerance.row_errors(c[n], ref) for c in corrects], axis=0)).any()
                            for n, ref in enumerate(refs[part]))
                        best[w] += seen_out if kind == "mistake" else not seen_out
                for w, (kind, _, _) in whats.items():
                    if kind == "stage" and not do_controls:
                        continue
                    yield {"scale": f"x{scale:g}", "dtype": dname, "shape": sname, "mistake_or_stage": w,
                           "kind": kind, "caught_or_passed": counts[w], "draws": draws,
                           "best_possible": best[w] if kind == "mistake" else "",
                           "worst_err_over_bound": "" if worst[w] is None else f"{worst[w]:.3g}",
                           "seed": seed, "git_commit": commit}
                log(f"  [{time.perf_counter() - t0:.1f} s] x{scale:g} {dname} {sname}", file=sys.stderr)


def _cell(r):
    """caught (or passed) / draws, and for a mistake the best possible count in brackets."""
    if r is None:
        return "-"
    best = f" [{r['best_possible']}]" if r["best_possible"] != "" else ""
    return f"{r['caught_or_passed']}/{r['draws']}{best}"


def print_table(rows):
    """Two tables, mistakes then correct stages: caught / passed of draws per (scale, dtype, shape), and under each
    line the worst error/bound over the draws."""
    keys = list(dict.fromkeys((r["scale"], r["dtype"], r["shape"]) for r in rows))
    at = {(r["scale"], r["dtype"], r["shape"], r["mistake_or_stage"]): r for r in rows}
    lead = max(len(" ".join(k)) for k in keys) + 1
    for kind, title in (("mistake", "mistakes caught"), ("stage", "correct stages passed")):
        cols = list(dict.fromkeys(r["mistake_or_stage"] for r in rows if r["kind"] == kind))
        if not cols:
            continue
        w = [max(len(c), 12) for c in cols]
        print(f"\n{title} (of the draws; [best possible]; second line: worst error/bound)")
        print(" " * lead + " ".join(f"{c:>{n}}" for c, n in zip(cols, w)))
        for key in keys:
            got = [at.get(key + (c,)) for c in cols]
            if not any(got):
                continue
            print(f"{' '.join(key):<{lead}}" + " ".join(f"{_cell(r):>{n}}" for r, n in zip(got, w)))
            if any(r and r["worst_err_over_bound"] for r in got):
                print(" " * lead + " ".join(f"{'' if r is None else r['worst_err_over_bound']:>{n}}"
                                            for r, n in zip(got, w)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="base seed of every draw")
    ap.add_argument("--scales", type=float, nargs="+", default=list(SCALES))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES),
                    help=f"shape names ({', '.join(SHAPES)}), or 'small' for {', '.join(SMALL)}")
    ap.add_argument("--controls-only", action="store_true", help="only the correct stages (the pass rate)")
    ap.add_argument("--mistakes-only", action="store_true", help="only the wrong answers (the catch rate)")
    ap.add_argument("--out", default=None, help="CSV to write (results/catch_rates.csv for the committed table)")
    args = ap.parse_args(argv)
    names = [s for n in args.shapes for s in (SMALL if n == "small" else (n,))]
    unknown = set(names) - set(SHAPES)
    if unknown:
        ap.error(f"unknown shapes {sorted(unknown)}; choose from {', '.join(SHAPES)} or 'small'")
    rows = list(run({n: SHAPES[n] for n in names}, {n: DTYPES[n] for n in args.dtypes}, args.scales, args.draws,
                    args.seed, do_mistakes=not args.controls_only, do_controls=not args.mistakes_only))
    print_table(rows)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
