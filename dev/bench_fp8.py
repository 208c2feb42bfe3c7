"""Stage 06's version fp8 of the forward beside the 16-bit version pingpong (forward() as it runs) and cuDNN's forward
(PyTorch SDPA) on the same bfloat16 inputs, d = 128, B N = --tokens, H = --heads, causal and not; fp8 end to end
(pre-pass and attention kernel), and its two parts alone.

    python3 dev/bench_fp8.py --out results/fp8_h200.csv
    python3 dev/bench_fp8.py --seqs 4096 --rounds 1

Timing: each implementation runs --reps times back to back between two CUDA events after a warm-up, and they take
turns --rounds times; a column is the median of its rounds, in microseconds per call. TFLOP/s count the attention's
4 B H Nq Nk d (halved under the causal mask), the same for every column. Before timing, version fp8 is checked by the
tolerance rule with its own yardstick (fp8.check) on a small problem of each mask, and on the timed problem its o is
compared with the 16-bit forward's (the largest difference is in the CSV: e4m3's error, not a check). Needs an sm_90
GPU, CuPy, cuda-bindings and a CUDA build of PyTorch.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

PARTS = ("fp8", "fp8_kernel", "fp8_prepass", "pingpong", "cudnn")
COLUMNS = (["gpu", "dtype", "head_dim", "causal", "seq_len", "batch", "heads"] + [f"{p}_us" for p in PARTS]
           + [f"{p}_tflops" for p in PARTS if p != "fp8_prepass"] + ["max_diff_vs_pingpong", "reps", "rounds",
                                                                     "git_commit", "driver", "cuda_runtime", "cupy",
                                                                     "torch", "date"])


def one_config(N, causal, args, cupy, torch):
    """{column: value} of one (N, mask)."""
    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bench
    from stages.common import attention_flops, bfloat16, kernels, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3, fp8

    D, B, H = 128, max(1, args.tokens // N), args.heads
    q, k, v = make_inputs(B, H, N, N, D, dtype=bfloat16, xp=cupy)
    tq, tk, tv = (bench._to_torch(x, torch) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    plan = fp8.launches(np.dtype(q.dtype), q.shape, N, causal, resolve_scale(None, D))
    buffers = plan.buffers(q.shape, N)
    amax, q8, k8, vt8 = buffers

    def prepass():  # what fp8.forward launches before its kernel
        plan.prepass(q, k, v, buffers)

    prepass()
    o8, _ = flash_v3.forward(q, k, v, causal=causal, version="fp8")
    o_kernel, _ = kernels.run_forward(plan.attention, q8, k8, vt8, np.dtype(q.dtype), amax)
    if not cupy.array_equal(o8.view(np.int16), o_kernel.view(np.int16)):
        raise SystemExit("the timed kernel and pre-pass do not compute what flash_v3.forward(version='fp8') does")
    o16, _ = flash_v3.forward(q, k, v, causal=causal)
    diff = float(cupy.abs(o8.astype(cupy.float32) - o16.astype(cupy.float32)).max())
    fns = {"fp8": lambda: flash_v3.forward(q, k, v, causal=causal, version="fp8"),
           "fp8_kernel": lambda: kernels.run_forward(plan.attention, q8, k8, vt8, np.dtype(q.dtype), amax),
           "fp8_prepass": prepass, "pingpong": lambda: flash_v3.forward(q, k, v, causal=causal), "cudnn": cudnn}
    us = bench.take_turns_us(fns, args.rounds, args.reps, torch)
    flops = attention_flops(B, H, N, N, D, causal=causal)
    row = {"dtype": "bfloat16", "head_dim": D, "causal": causal, "seq_len": N, "batch": B, "heads": H,
           "max_diff_vs_pingpong": f"{diff:.3g}", "reps": args.reps, "rounds": args.rounds}
    for p in PARTS:
        row[f"{p}_us"] = round(us[p], 1)
        if p != "fp8_prepass":
            row[f"{p}_tflops"] = round(flops / us[p] / 1e6, 1)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384, help="B x N (default 16384)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="CSV to write (default: print only)")
    args = ap.parse_args(argv)

    import bench
    from stages.common import bfloat16, make_inputs
    from stages import naive  # noqa: F401  (stage 00: the tolerance rule's reference, registered on import)
    from stages.hopper import fp8

    cupy, torch, prov = bench.hopper_session("dev/bench_fp8.py")
    for causal in (False, True):  # the rule on a small problem of each mask, before any timing
        fp8.check(*make_inputs(2, 3, 300, 333, 128, dtype=bfloat16, xp=cupy), causal=causal)
    print(f"stage 06 version fp8 on {prov['gpu']} (commit {prov['git_commit']}); checked by the rule", flush=True)
    rows = []
    for N in args.seqs:
        for causal in (False, True):
            row = {**one_config(N, causal, args, cupy, torch), **prov}
            rows.append(row)
            print({c: row[c] for c in COLUMNS if c.endswith("_tflops") or c in ("seq_len", "causal", "fp8_prepass_us")},
                  flush=True)
    if args.out:
        bench.write_rows(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
