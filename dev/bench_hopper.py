"""Time stage 06's forward (every version) beside stage 02's pipelined forward and PyTorch's SDPA
(flash and cuDNN backends), in one run on one sm_90 GPU.

    python dev/bench_hopper.py [--out results] [--seqs 4096 8192 16384] [--head-dims 64 128] [--dtype bfloat16]

As dev/bench.py: B = tokens // N (16384 tokens), 16 heads, causal and not. Before timing, each configuration of
ours is checked by the tolerance rule on a small problem (N = 1000, 2 heads) with the same head dim and dtype. Times
are queued (bench.time_call: CUDA events around every call, the host running ahead). Writes
<out>/bench_hopper.csv (one run, provenance columns) and prints the ratios.
"""
import argparse
import csv
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

import bench  # noqa: E402  (timing, provenance, DLPack helpers)

from stages import flash_v2, naive  # noqa: E402, F401  (naive: stage 00: the tolerance rule's reference, registered on import)
from stages.common import attention_flops, bfloat16, check_forward, make_inputs  # noqa: E402
from stages.hopper import flash_v3  # noqa: E402

DTYPES = {"bfloat16": bfloat16, "float16": np.float16}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results")
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--target-ms", type=float, default=300.0)
    args = ap.parse_args(argv)
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    prov = bench.provenance(cupy, torch, gpu)
    dtype = DTYPES[args.dtype]
    clock_cp, clock_t = bench._Clock("cupy", cupy), bench._Clock("torch", cupy)
    rows = []
    for D in args.head_dims:
        for causal in (False, True):
            checked = []  # a version that fails the tolerance rule is reported and not timed
            for version in flash_v3.VERSIONS:
                try:
                    check_forward(flash_v3.forward, *make_inputs(1, 2, 1000, 1000, D, dtype=dtype, xp=cupy),
                                  causal=causal, version=version)
                    checked.append(version)
                except AssertionError as e:
                    print(f"  ours {version} (d={D}, causal={causal}) fails its check, not timed: "
                          f"{bench._short(str(e))}")
            for N in args.seqs:
                B = max(1, args.tokens // N)
                q, k, v = make_inputs(B, args.heads, N, N, D, dtype=dtype, xp=cupy)
                tq, tk, tv = (bench._to_torch(x, torch) for x in (q, k, v))
                flops = attention_flops(B, args.heads, N, N, D, causal=causal)
                impls = {f"ours {ver} (stage 06)": (lambda ver=ver: flash_v3.forward(q, k, v, causal=causal,
                                                                                   version=ver), clock_cp)
                         for ver in checked}
                impls["ours pipelined (stage 02)"] = (lambda: flash_v2.forward(q, k, v, causal=causal), clock_cp)
                for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def call(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    impls[name] = (call, clock_t)
                times = {}
                for name, (fn, clock) in impls.items():
                    try:
                        times[name] = bench.time_call(fn, clock, cupy, target_ms=args.target_ms)[0]
                    except Exception as e:  # a backend this GPU or build lacks: say so in the row
                        times[name] = None
                        print(f"  {name}: {bench._short(repr(e))}")
                ours = times.get(f"ours {flash_v3.DEFAULT} (stage 06)")
                for name, ms in times.items():
                    rows.append(dict(dtype=args.dtype, head_dim=D, causal=causal, seq_len=N, batch=B,
                                     heads=args.heads, impl=name, ms=f"{ms:.4f}" if ms else "",
                                     tflops=f"{flops / ms / 1e9:.1f}" if ms else "",
                                     time_over_default=f"{ms / ours:.3f}" if ms and ours else "", **prov))
                print(f"d={D} causal={causal!s:5} N={N:5d}: " + ", ".join(
                    f"{n} {flops / ms / 1e9:.0f} TFLOP/s" if ms else f"{n} -" for n, ms in times.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_hopper.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} ({len(rows)} rows)")


if __name__ == "__main__":
    sys.exit(main())
