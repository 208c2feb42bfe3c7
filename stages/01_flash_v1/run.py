"""Stage 01: FlashAttention v1 (arXiv 2205.14135, Algorithm 1 forward, Algorithm 4 backward), fp32.

1. Checks forward and backward against the fp64 oracle (stage 00 in float64) by the tolerance rule
   (stages.common.check_forward / check_backward).
2. Then prints time and peak memory beside naive attention for growing N: flash stays O(N) in memory,
   naive grows as O(N^2).

Versions:
  paper  the paper's loop order (K/V tiles j outside, Q tiles i inside, O_i, l_i, m_i re-read and written
         back every step), one thread block per (batch, head), Br = Bc = 32, scalar fp32 loops (no tensor
         cores): memory O(N) as promised, but slow on a GPU, where only B*H SMs have work. On the CPU the
         numpy tile mirror runs instead (same tiles, same loops).

    python stages/01_flash_v1/run.py                 # CPU (mirror) and, when CuPy sees a GPU, the kernels
    python stages/01_flash_v1/run.py --quick         # small sizes, for the tutorial-wide runner
    python stages/01_flash_v1/run.py --help
"""
import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

import numpy as np

from stages import flash_v1, naive
from stages.common.cli import check_head_dim, positive_int
from stages.common import (
    PeakMemory, attention_flops, check_backward, check_forward, gpu_name, run_devices, make_inputs, time_ms,
)
from stages.common.verify import errors_and_bounds

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
HEADS = 4  # H: one thread block per (batch, head), so B*H SMs work
HEAD_DIM = 64  # D: any 1..128
CHECK_SEQ = 500  # N of the correctness check (not a multiple of Br = Bc = 32: the tails are exercised)
CPU_SEQS = (256, 512, 1024)  # N of the time/memory table on the CPU (the numpy mirror is slow)
GPU_SEQS = (1024, 2048, 4096, 8192)  # N of the table on the GPU
CAUSAL = True
VERSION = "paper"


def _row(forward, backward, q, k, v, do, causal, gpu):
    """Peak memory of forward + backward, and the median time of each (ms)."""
    with PeakMemory(gpu) as mem:
        o, lse = forward(q, k, v, causal=causal)
        backward(q, k, v, o, lse, do, causal=causal)
    t_f = time_ms(lambda: forward(q, k, v, causal=causal), gpu=gpu, warmup=1, repeat=3)
    t_b = time_ms(lambda: backward(q, k, v, o, lse, do, causal=causal), gpu=gpu, warmup=1, repeat=3)
    return mem.peak, t_f, t_b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=positive_int, default=None,
                    help=f"number of heads H (default {HEADS}; 2 with --quick)")
    ap.add_argument("--head-dim", type=positive_int, default=HEAD_DIM, help="head dimension D (1..128)")
    ap.add_argument("--seq", type=positive_int, default=None,
                    help=f"sequence length of the correctness check (default {CHECK_SEQ}; 200 with --quick)")
    ap.add_argument("--seqs", type=positive_int, nargs="+", default=None,
                    help=f"sequence lengths of the time/memory table (default CPU {CPU_SEQS}, GPU {GPU_SEQS})")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--version", choices=flash_v1.VERSIONS, default=VERSION, help="kernel version")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: the CPU (numpy mirror), and the GPU (kernels) too when CuPy sees one")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    args = ap.parse_args(argv)
    check_head_dim(ap, "--head-dim", args.head_dim, None, "flash_v1")
    causal = not args.no_causal
    if args.seq is None:
        args.seq = 200 if args.quick else CHECK_SEQ
    if args.heads is None:
        args.heads = 2 if args.quick else HEADS
    devices = run_devices(args.device)
    fwd = functools.partial(flash_v1.forward, version=args.version)
    bwd = functools.partial(flash_v1.backward, version=args.version)

    ok = True
    for dev in devices:
        gpu = dev == "gpu"
        xp = np
        if gpu:
            import cupy as xp
        what = f"GPU ({gpu_name()}), CUDA kernels" if gpu else "CPU, numpy tile mirror"
        print(f"\n== stage 01 FlashAttention v1 [{args.version}] on the {what}: B={args.batch} H={args.heads} "
              f"N={args.seq} D={args.head_dim} causal={causal}, Br={flash_v1.BR} Bc={flash_v1.BC}")
        # 1. check, before any timing
        q, k, v, do = make_inputs(args.batch, args.heads, args.seq, args.seq, args.head_dim, dtype=np.float32,
                                  xp=xp, grad=True)
        try:
            errs = check_forward(fwd, q, k, v, causal=causal, with_bounds=True)
            errs.update(check_backward(bwd, q, k, v, do, causal=causal, with_bounds=True))
        except AssertionError as e:
            print(f"CHECK FAILED: {e}")
            ok = False
            continue
        print("against the fp64 oracle, error at each output's worst row (tolerance rule): " + errors_and_bounds(errs))
        print("All results match. Timing.")

        # 2. time and peak memory against naive attention
        seqs = args.seqs or ([128, 256, 512] if args.quick else list(GPU_SEQS if gpu else CPU_SEQS))
        print(f"{'N':>6} | {'flash fwd ms':>12} {'bwd ms':>9} {'fwd GFLOP/s':>11} {'peak MB':>8} | "
              f"{'naive fwd ms':>12} {'bwd ms':>9} {'peak MB':>8} | {'naive/flash mem':>15}")
        for n in seqs:
            q, k, v, do = make_inputs(args.batch, args.heads, n, n, args.head_dim, dtype=np.float32, xp=xp,
                                      grad=True)
            m_f, tf_f, tb_f = _row(fwd, bwd, q, k, v, do, causal, gpu)
            m_n, tf_n, tb_n = _row(naive.forward, naive.backward, q, k, v, do, causal, gpu)
            flops = attention_flops(args.batch, args.heads, n, n, args.head_dim, causal=causal)
            print(f"{n:>6} | {tf_f:>12.2f} {tb_f:>9.2f} {flops / tf_f / 1e6:>11.1f} {m_f / 2**20:>8.1f} | "
                  f"{tf_n:>12.2f} {tb_n:>9.2f} {m_n / 2**20:>8.1f} | {m_n / max(m_f, 1):>14.1f}x")
        print("flash's peak doubles with N (O(N): o, lse, l, m, dq, dk, dv); naive's grows 4x (the N x N S, P).")
        if gpu:
            print(f"flash v1 runs one block per (batch, head): {args.batch * args.heads} blocks on "
                  f"{xp.cuda.Device().attributes['MultiProcessorCount']} SMs. Stage 02 fixes that.")
    print(f"SUMMARY 01_flash_v1 {'PASS' if ok else 'FAIL'} {args.version} fwd+bwd vs fp64 oracle, memory O(N), "
          f"on {', '.join(devices)}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
