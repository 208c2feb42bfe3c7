"""Stage 06's forward (version pingpong, no mask) with its two grids side by side, both with K/V tiles of 128 keys
(64 at d = 256): one block per (Q tile, head) item, and a persistent grid of one block per SM striding over the
items; beside forward() as it runs (one of the two grids: persistent_rule; at d = 128 on a block per item with K/V
tiles of WIDE_BC keys: wide_rule) and cuDNN's forward (PyTorch SDPA), for every N at the same number of tokens.

    python3 dev/forward_grids.py --out results/forward_grids_h200.csv
    python3 dev/forward_grids.py --head-dims 128 --seqs 512 16384

With B N fixed (--tokens) the grid has the same B H N / 128 items at every N, and each item's loop over K/V tiles is
as long as N. What an item does once (load Q_i, fill the pipeline, rescale and store O_i) is then a larger share of
its time at short N; the persistent grid overlaps it with the next item's loads, and the single-item instantiation
runs each tile without the counters the persistent loop carries. The rule's PERSISTENT_MAX_KEYS is where the two
meet.

Timing: each of per_item, persistent, whole and cuDNN's forward is run --reps times back to back between two CUDA
events after a warm-up, and they take turns --rounds times; a column is the median of its rounds, in microseconds
per call. Before timing, the two grids must write the same O and L bit for bit, and forward()'s too where it takes
their tiles (the script times the launches the forward makes, not others). Needs an sm_90 GPU, CuPy, cuda-bindings
and a CUDA build of PyTorch.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

PARTS = ("per_item", "persistent", "whole", "cudnn")
COLUMNS = (["gpu", "dtype", "head_dim", "seq_len", "batch", "heads", "items", "sms"] + [f"{p}_us" for p in PARTS]
           + [f"{p}_tflops" for p in PARTS] + ["persistent_by_rule", "forward_bc", "reps", "rounds",
                                                "git_commit", "driver", "cuda_runtime", "cupy", "torch", "date"])


def one_config(dtype_name, D, N, args, cupy, torch):
    """{column: value} of one (dtype, d, N)."""
    import numpy as np
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import bench
    from stages.common import attention_flops, bfloat16, device, make_inputs
    from stages.common.checks import resolve_scale
    from stages.hopper import flash_v3

    B, H = max(1, args.tokens // N), args.heads
    q, k, v = make_inputs(B, H, N, N, D, dtype={"bf16": bfloat16, "fp16": np.float16}[dtype_name], xp=cupy)
    whole = flash_v3.forward(q, k, v)
    plans = {p: flash_v3.launch_rows("pingpong", np.dtype(q.dtype), q.shape, N, (0, N), (0, N), False,
                                     resolve_scale(None, D), merge=False, persistent=p, wide=False)
             for p in (False, True)}
    by_rule = flash_v3.persistent_rule("pingpong", False, N)
    wide = flash_v3.wide_rule("pingpong", D, False, by_rule)
    o, lse = cupy.empty_like(q), cupy.empty((B, H, N), cupy.float32)
    fns = {"per_item": lambda: plans[False](q, k, v, o, lse), "persistent": lambda: plans[True](q, k, v, o, lse),
           "whole": lambda: flash_v3.forward(q, k, v)}
    fns["per_item"]()
    first = o.copy(), lse.copy()
    fns["persistent"]()
    for what, (o_ref, lse_ref) in [("the block-per-item grid's", first)] + ([] if wide else [("forward()'s", whole)]):
        if not (cupy.array_equal(o.view(np.int16), o_ref.view(np.int16))
                and cupy.array_equal(lse.view(np.int32), lse_ref.view(np.int32))):
            raise SystemExit(f"d={D} N={N}: the persistent grid does not write {what} O and L bit for bit: the script "
                             "would time another computation")

    tq, tk, tv = (bench._bnhd(x, torch).transpose(1, 2) for x in (q, k, v))  # torch's layout, (B, H, N, d)

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(tq, tk, tv)

    fns["cudnn"] = cudnn
    us = bench.take_turns_us({p: fns[p] for p in PARTS}, args.rounds, args.reps, torch)
    flops = attention_flops(B, H, N, N, D, causal=False)
    row = dict(dtype=dtype_name, head_dim=D, seq_len=N, batch=B, heads=H, items=B * H * -(-N // 128),
               sms=device.device().sm_count, **{f"{p}_us": round(us[p], 1) for p in PARTS},
               **{f"{p}_tflops": round(flops / us[p] / 1e6, 1) for p in PARTS},
               persistent_by_rule=by_rule, forward_bc=flash_v3.config("pingpong", D, wide).bc, reps=args.reps,
               rounds=args.rounds)
    print(f"{dtype_name} d={D} N={N} B={B}: " + ", ".join(f"{p} {us[p]:.1f} us" for p in PARTS)
          + f"; cudnn / per_item {us['cudnn'] / us['per_item']:.3f}, cudnn / persistent "
          f"{us['cudnn'] / us['persistent']:.3f}", flush=True)
    return row


def main():
    import bench

    ap = bench.hopper_timing_parser(__doc__, head_dims=(64, 128, 256), reps=30, rounds=5)
    args = bench.parse_timing_args(ap)

    cupy, torch, prov = bench.hopper_session("forward_grids.py")
    print(f"stage 06 forward, both grids, on {prov['gpu']} (commit {prov['git_commit']})", flush=True)
    rows = [dict(one_config(args.dtype, D, N, args, cupy, torch), **prov) for D in args.head_dims for N in args.seqs]
    if args.out:
        bench.write_rows(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
