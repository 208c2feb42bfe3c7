"""Stage 00: naive attention, forward + backward, checked against the fp64 oracle.

    S = scale * Q K^T,  P = softmax(S),  O = P V        the (B, H, Nq, Nk) matrices S and P are materialised
    backward: dV = P^T dO, dP = dO V^T, dS = P * (dP - D), D = rowsum(dO * O)

Versions: one (the formula). On the CPU it runs on numpy; on a GPU the very same code runs on CuPy.
What it shows: errors against float64, time, and the N x N score matrix's memory growing as N^2.

    python stages/00_naive/run.py                # default sizes, CPU (and GPU when there is one)
    python stages/00_naive/run.py --quick        # small, for the tutorial-wide runner
    python stages/00_naive/run.py --help
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

import numpy as np

from stages import naive
from stages.common.cli import positive_int
from stages.common import (
    PeakMemory, attention_flops, check_backward, check_forward, gpu_name, run_devices, make_inputs, time_ms,
)
from stages.common.verify import errors_and_bounds

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
HEADS = 4  # H
HEAD_DIM = 64  # D
CHECK_SEQ = 500  # N used for the correctness check
MEMORY_SEQS = (256, 512, 1024, 2048)  # N for the memory table (CPU); the GPU adds 4096 and 8192
CAUSAL = True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=positive_int, default=None,
                    help=f"number of heads H (default {HEADS}; 2 with --quick)")
    ap.add_argument("--head-dim", type=positive_int, default=HEAD_DIM, help="head dimension D")
    ap.add_argument("--seq", type=positive_int, default=None,
                    help=f"sequence length of the correctness check (default {CHECK_SEQ}; 200 with --quick)")
    ap.add_argument("--seqs", type=positive_int, nargs="+", default=None,
                    help="sequence lengths of the memory table")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: the CPU, and the GPU too when CuPy sees one")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    args = ap.parse_args(argv)
    causal = not args.no_causal
    if args.seq is None:
        args.seq = 200 if args.quick else CHECK_SEQ
    if args.heads is None:
        args.heads = 2 if args.quick else HEADS
    devices = run_devices(args.device)

    ok = True
    for dev in devices:
        gpu = dev == "gpu"
        xp = np
        if gpu:
            import cupy as xp
        where = f"GPU ({gpu_name()})" if gpu else "CPU"
        print(f"\n== stage 00 naive attention on the {where}: B={args.batch} H={args.heads} "
              f"N={args.seq} D={args.head_dim} causal={causal}")
        # 1. check, before any timing: float32 against the float64 oracle by the tolerance rule
        q, k, v, do = make_inputs(args.batch, args.heads, args.seq, args.seq, args.head_dim,
                                  dtype=np.float32, xp=xp, grad=True)
        try:
            errs = check_forward(naive.forward, q, k, v, causal=causal, with_bounds=True)
            errs.update(check_backward(naive.backward, q, k, v, do, causal=causal, with_bounds=True))
        except AssertionError as e:
            print(f"CHECK FAILED: {e}")
            ok = False
            continue
        print("float32 against the float64 oracle, error at each output's worst row (tolerance rule): "
              + errors_and_bounds(errs))
        print("All results match. Timing.")

        # 2. time and memory: S and P are (B, H, N, N), so memory grows as N^2
        seqs = args.seqs or ([128, 256, 512] if args.quick else list(MEMORY_SEQS) + ([4096, 8192] if gpu else []))
        print(f"{'N':>6} {'S matrix':>10} {'peak fwd+bwd':>13} {'fwd ms':>9} {'bwd ms':>9} {'fwd GFLOP/s':>12}")
        for n in seqs:
            q, k, v, do = make_inputs(args.batch, args.heads, n, n, args.head_dim, dtype=np.float32, xp=xp,
                                      grad=True)
            with PeakMemory(gpu) as mem:
                o, lse = naive.forward(q, k, v, causal=causal)
                naive.backward(q, k, v, o, lse, do, causal=causal)
            t_f = time_ms(lambda: naive.forward(q, k, v, causal=causal), gpu=gpu, warmup=1, repeat=3)
            t_b = time_ms(lambda: naive.backward(q, k, v, o, lse, do, causal=causal), gpu=gpu, warmup=1, repeat=3)
            flops = attention_flops(args.batch, args.heads, n, n, args.head_dim, causal=causal)
            s_bytes = naive.score_matrix_bytes(args.batch, args.heads, n, n)
            print(f"{n:>6} {s_bytes / 2**20:>8.1f}MB {mem.peak / 2**20:>11.1f}MB {t_f:>9.2f} {t_b:>9.2f} "
                  f"{flops / t_f / 1e6:>12.1f}")
        print("Each doubling of N multiplies the score matrix (and the peak) by about 4: memory is O(N^2).")
    print(f"SUMMARY 00_naive {'PASS' if ok else 'FAIL'} fp32 vs fp64 oracle, fwd+bwd, on {', '.join(devices)}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
