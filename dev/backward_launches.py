"""Where stage 06's backward spends its time: each of its three launches timed alone, beside the whole call, the
call with the dQ conversion fused into the main kernel and cuDNN's whole backward (PyTorch SDPA), for every N at the
same number of tokens.

    python3 dev/backward_launches.py --out results/backward_launches_h200.csv
    python3 dev/backward_launches.py --head-dims 128 --seqs 512 16384 --causal yes

The backward (stages/06_hopper/flash_v3_backward.py) is three launches:
  pre      stage 03's preprocess: D_i = rowsum(dO_i o O_i) and L_i, and the float32 dQ accumulator zeroed. It reads
           O and dO and writes the accumulator: memory traffic in proportion to B H N d, no matrix product.
  main     the FlashAttention-3 kernel (version ws at d = 64, 128): the five GEMMs of every (Q tile, K/V tile) pair,
           4 B H N^2 d x 2.5 FLOPs (half when causal): work in proportion to B H N^2 d.
  convert  the accumulator read and written again as dQ in the inputs' dtype: traffic in proportion to B H N d.
With B N fixed (--tokens), pre and convert cost the same at every N while the main kernel's work grows with N: the
shorter the sequence, the larger their share of the call. So version ws can do the conversion itself (the last block
of each head to finish converts it): the backward is then two launches. Which of the two the backward uses is its
fuse_dq_rule; this script times both whole, whatever the rule says:
  unfused  pre, main, convert (the plan with fuse_dq=False)
  fused    pre, main converting dQ in its last block per head (fuse_dq=True)
  whole    flash_v3_backward.backward, one of the two

Timing: each of pre, main, convert, unfused, fused, whole and cuDNN's backward (torch.autograd.grad on a graph built
once, as dev/bench.py does) is run --reps times back to back between two CUDA events after a warm-up, and they take
turns --rounds times; a column is the median of its rounds, in microseconds per call. Before timing, the three
launches run by hand and both plans must give the whole call's dK and dV bit for bit and its dQ up to the order of
its float32 sums (the script times the launches the backward makes, not others). Needs an sm_90 GPU, CuPy,
cuda-bindings and a CUDA build of PyTorch.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

PARTS = ("pre", "main", "convert", "unfused", "fused", "whole", "cudnn")
COLUMNS = (["gpu", "dtype", "head_dim", "causal", "seq_len", "batch", "heads"] + [f"{p}_us" for p in PARTS]
           + ["main_tflops", "whole_tflops", "cudnn_tflops", "fused_by_rule", "reps", "rounds",
              "git_commit", "driver", "cuda_runtime", "cupy", "torch", "date"])


def one_config(dtype_name, D, causal, N, args, cupy, torch):
    """{column: value} of one (dtype, d, causal, N)."""
    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bench
    from stages.common import attention_flops, bfloat16, fast_path, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3, flash_v3_backward as fb

    B, H = max(1, args.tokens // N), args.heads
    q, k, v, do = make_inputs(B, H, N, N, D, dtype={"bf16": bfloat16, "fp16": np.float16}[dtype_name], xp=cupy,
                              grad=True)
    o, lse = flash_v3.forward(q, k, v, causal=causal)
    whole = [x.copy() for x in fb.backward(q, k, v, o, lse, do, causal=causal)]

    # The launches of the unfused plan, run by hand on arrays of their own; the two plans whole
    version, scale = fb.resolve_version("auto", D), resolve_scale(None, D)
    plans = {f: fb.launches(version, np.dtype(q.dtype), q.shape, N, causal, scale, fuse_dq=f) for f in (False, True)}
    plan = plans[False]
    delta, lse_pad, dq_acc = fast_path.empties(*plan.scratch)
    dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
    pieces = {"pre": lambda: plan.pre(o, do, lse, delta, lse_pad, dq_acc, 0),
              "main": lambda: plan.main(q, k, v, do, dq_acc, dq_acc, dk, dv, lse_pad, delta, 0, 0),
              "convert": lambda: plan.convert(dq_acc, dq),
              "unfused": lambda: plans[False](q, k, v, o, lse, do),
              "fused": lambda: plans[True](q, k, v, o, lse, do)}
    for name in ("pre", "main", "convert"):
        pieces[name]()
    # dK, dV: each block owns its keys, so they are the same bits; dQ is summed over the K/V blocks in the order they
    # finish (float32 additions in another order round otherwise), so it may differ in its last bits
    for name, (gq, gk, gv) in (("by hand", (dq, dk, dv)), ("unfused", pieces["unfused"]()),
                               ("fused", pieces["fused"]())):
        same_kv = all(cupy.array_equal(a.view(np.int16), b.view(np.int16)) for a, b in zip((gk, gv), whole[1:]))
        dq_err = float(cupy.max(cupy.abs(gq.astype(cupy.float32) - whole[0].astype(cupy.float32))))
        if not same_kv or not dq_err <= 2 ** -6 * float(cupy.max(cupy.abs(whole[0].astype(cupy.float32)))):
            raise SystemExit(f"d={D} N={N}: the launches {name} do not give backward()'s gradients (dk, dv the same "
                             f"bits: {same_kv}; dq off by {dq_err:.3g}): the script would time other launches")

    tq, tk, tv, tdo = (bench._bnhd(x, torch).transpose(1, 2) for x in (q, k, v, do))  # torch's layout, (B, H, N, d)
    leaves = [t.detach().requires_grad_(True) for t in (tq, tk, tv)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    fns = dict(pieces, whole=lambda: fb.backward(q, k, v, o, lse, do, causal=causal),
               cudnn=lambda: torch.autograd.grad(out, leaves, tdo, retain_graph=True))
    us = bench.take_turns_us({p: fns[p] for p in PARTS}, args.rounds, args.reps, torch)
    flops = attention_flops(B, H, N, N, D, causal=causal, backward=True)
    row = dict(dtype=dtype_name, head_dim=D, causal=causal, seq_len=N, batch=B, heads=H,
               **{f"{p}_us": round(us[p], 1) for p in PARTS},
               **{f"{p}_tflops": round(flops / us[p] / 1e6, 1) for p in ("main", "whole", "cudnn")},
               fused_by_rule=fb.fuse_dq_rule(version, N, D),
               reps=args.reps, rounds=args.rounds)
    print(f"{dtype_name} d={D} {'causal' if causal else 'full'} N={N} B={B}: "
          + ", ".join(f"{p} {us[p]:.1f} us" for p in PARTS), flush=True)
    return row


def main():
    import bench

    ap = bench.hopper_timing_parser(__doc__, head_dims=(64, 128), reps=50, rounds=3)
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    args = bench.parse_timing_args(ap)

    cupy, torch, prov = bench.hopper_session("backward_launches.py")
    print(f"stage 06 backward, launch by launch, on {prov['gpu']} (commit {prov['git_commit']})", flush=True)
    rows = [dict(one_config(args.dtype, D, causal, N, args, cupy, torch), **prov)
            for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
            for D in args.head_dims for N in args.seqs]
    if args.out:
        bench.write_rows(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
