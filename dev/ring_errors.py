"""The ring's error against the number of ranks: results/ring_error_vs_ranks.csv.

    python dev/ring_errors.py            # CPU, a few minutes: P = 1, 2, 4, 8 simulated ranks

The same inputs (fixed seed) go through ring attention on P = 1, 2, 4, 8 simulated ranks (threads, the zigzag
layout, causal), with the stage 02/03 blocks (their numpy tile mirrors: the kernels' own roundings) in float32,
float16 and bfloat16. Each row gives every output's error against the float64 oracle and its bound under the
tolerance rule (stages/common/tolerance.py), at the output's worst row (the rule bounds each row on its own). The
blocks return float32 partials and the ring merges them in float32, so the error should not grow with P; a ring
that rounded each block's partial result to 16 bits would add one rounding per block. stages/04_ring/README.md
shows the table (dev/bench_report.py --write).
"""
import argparse
import csv
import datetime
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: `stages` imports with no install

import numpy as np  # noqa: E402

from stages import ring  # noqa: E402
from stages.common import bfloat16, code_version, make_inputs, verify  # noqa: E402

SHAPE = (1, 2, 256, 64)  # B, H, N, D
RANKS = (1, 2, 4, 8)
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": bfloat16}
NAMES = ("o", "lse", "dq", "dk", "dv")


def rows(seed=0):
    B, H, N, D = SHAPE
    commit = code_version()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    for name, dtype in DTYPES.items():
        q, k, v, do = make_inputs(B, H, N, N, D, dtype=dtype, seed=seed, grad=True)
        refs, bounds, (o_in, lse_in) = verify.rule(q, k, v, do, causal=True)
        for P in RANKS:
            kw = dict(causal=True, layout="zigzag", ranks=P, block="flash")
            outs = ring.forward(q, k, v, **kw) + ring.backward(q, k, v, o_in, lse_in, do, **kw)
            res = verify.check_outputs(outs, refs, bounds)
            yield {"dtype": name, "ranks": P, "B": B, "H": H, "N": N, "D": D, "layout": "zigzag", "causal": True,
                   **{f"err_{n}": f"{res[n][0]:.3e}" for n in NAMES},
                   **{f"bound_{n}": f"{res[n][1]:.3e}" for n in NAMES},
                   "block": "flash (stage 02/03 numpy mirrors)", "seed": seed, "git_commit": commit, "date": date}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "ring_error_vs_ranks.csv"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = list(rows(args.seed))
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)
    for r in out:
        print(r["dtype"], r["ranks"], " ".join(f"{n} {r['err_' + n]}/{r['bound_' + n]}" for n in NAMES))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
