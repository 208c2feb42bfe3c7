"""Tuning sweep of stage 03's tensor-core backward on a GPU, beside torch SDPA's flash and cuDNN backward in the
same run. Every configuration of ours is checked against the fp64 oracle (tolerance rule, on a small problem)
before it is timed; one that fails is reported and not timed.

For each dtype, head dim and mask: ours in both dQ modes (atomic, deterministic) with the time of each launch,
the tc kernel with other tiles (--tiles D:BR:BC), the other order of its atomic dQ (--defer-dq), the other
block order (--j-fast), dQ converted by the kernel or by a launch of its own (--fuse-dq), and torch's backends.
Configurations are passed to flash_v2_backward.backward(tc_config=...); nothing is patched.

    python dev/sweep_backward.py                                  # B=4 H=16 N=4096, d=64 and 128
    python dev/sweep_backward.py --tiles 64:64:64 128:64:128:1 --defer-dq false
    python dev/sweep_backward.py --shape 16 16 1024 --j-fast true false   # the two block orders
    python dev/sweep_backward.py --shape 1 16 16384 --fuse-dq true false  # who converts dQ
    python dev/sweep_backward.py --csv results/bwd.csv            # rows in results/bench.csv's format
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: `stages` imports with no install

import numpy as np

from stages import flash_v2_backward as fb
from stages import naive
from stages.common import bfloat16, check_backward, gpu_name, has_gpu, make_inputs, time_ms
from stages.common.cli import positive_int

SHAPE = (4, 16, 4096)  # B, H, N timed
CHECK_SHAPE = (1, 2, 500)  # B, H, N of each configuration's check
DTYPES = {"fp16": np.float16, "bf16": bfloat16}


def tiles_type(text):
    try:
        parts = [int(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"expected D:BR:BC or D:BR:BC:WQ, e.g. 64:64:64 or 128:64:128:2, got "
                                         f"{text!r}")
    D, br, bc, wq = parts + [1] * (4 - len(parts))  # WQ 1 unless given
    why = "" if D in fb.HEAD_DIMS["tc"] else f"D must be one of {fb.HEAD_DIMS['tc']}"
    why = why or fb.tiles_error(D, br, bc, wq)
    if why:
        raise argparse.ArgumentTypeError(f"D:BR:BC[:WQ] {text!r}: {why}")
    return D, br, bc, wq


def bool_type(text):
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def checked_ms(dtype, D, shape, causal, repeat, **kw):
    """Check fb.backward(**kw) against the oracle on CHECK_SHAPE, then its median ms at `shape`."""
    import cupy

    q, k, v, do = make_inputs(*CHECK_SHAPE, CHECK_SHAPE[2], D, dtype=dtype, xp=cupy, grad=True)
    check_backward(fb.backward, q, k, v, do, causal=causal, version="tc", **kw)
    B, H, N = shape
    q, k, v, do = make_inputs(B, H, N, N, D, dtype=dtype, xp=cupy, grad=True)
    o, lse = naive.forward(q, k, v, causal=causal)  # the backward's inputs
    profile = []
    fb.backward(q, k, v, o, lse, do, causal=causal, version="tc", profile=profile, **kw)
    profile[-1][1].synchronize()
    launches = ", ".join(f"{b[0]} {cupy.cuda.get_elapsed_time(a[1], b[1]):.3f}" for a, b in zip(profile, profile[1:]))
    ms = time_ms(lambda: fb.backward(q, k, v, o, lse, do, causal=causal, version="tc", **kw), gpu=True, repeat=repeat)
    return ms, launches


def torch_ms(dname, shape, D, causal, repeat):
    """{backend: median ms or NaN} of torch SDPA's flash and cuDNN backward on random inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, N = shape
    tdt = torch.bfloat16 if dname == "bf16" else torch.float16
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=tdt, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=tdt)
    out = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            out[name] = time_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), gpu=True,
                                repeat=repeat)  # torch runs on CuPy's current (default) stream
        except Exception as e:  # a backend this torch build lacks
            print(f"note: torch {name} backward unavailable: {type(e).__name__}: {e}")
            out[name] = float("nan")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=positive_int, nargs=3, default=SHAPE, metavar=("B", "H", "N"))
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=list(fb.HEAD_DIMS["tc"]),
                    choices=fb.HEAD_DIMS["tc"])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES))
    ap.add_argument("--tiles", type=tiles_type, nargs="*", default=[], metavar="D:BR:BC[:WQ]",
                    help="also time the tc kernel with these tiles and warp layout (TcTiles; WQ 1 unless given), "
                         "e.g. 64:64:64 128:64:128:1")
    ap.add_argument("--defer-dq", type=bool_type, nargs="*", default=[], metavar="true|false",
                    help="also time the tc kernel with this order of its atomic dQ")
    ap.add_argument("--j-fast", type=bool_type, nargs="*", default=[], metavar="true|false",
                    help="also time the tc kernel with this block order (K/V tiles fastest or not: j_fast_order)")
    ap.add_argument("--fuse-dq", type=bool_type, nargs="*", default=[], metavar="true|false",
                    help="also time the tc kernel with dQ converted by its own blocks or by a third launch "
                         "(fuse_dq_rule)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch SDPA")
    ap.add_argument("--repeat", type=positive_int, default=20, help="timed repeats (median)")
    ap.add_argument("--csv", default=None, help="write the rows to this CSV (results/bench.csv's columns)")
    args = ap.parse_args(argv)
    if not has_gpu():
        raise SystemExit("sweep_backward.py times CUDA kernels: no GPU found (CuPy sees no device)")
    B, H, N = args.shape
    gpu = gpu_name()
    print(f"== stage 03 backward sweep on {gpu}: B={B} H={H} N={N}, median of {args.repeat}; "
          "FLOPs = 2.5 x forward (causal halved)")
    rows, ok = [], True
    for dname in args.dtypes:
        for D in args.head_dims:
            configs = [("tc", {}, False), ("tc-det", {}, True)]
            configs += [(f"tc Br={br} Bc={bc} wq={wq}", {"br": br, "bc": bc, "wq": wq}, False)
                        for d, br, bc, wq in args.tiles if d == D]
            configs += [(f"tc defer_dq={x}", {"defer_dq": x}, False) for x in args.defer_dq]
            configs += [(f"tc j_fast={x}", {"j_fast": x}, False) for x in args.j_fast]
            configs += [(f"tc fuse_dq={x}", {"fuse_dq": x}, False) for x in args.fuse_dq]
            for causal in (False, True):
                flops = fb.backward_flops(B, H, N, N, D, causal)
                times = {}
                for name, cfg, det in configs:
                    line = f"{dname:>5} d={D:<4} causal={str(causal):<5} {name:>22}: "
                    try:
                        ms, launches = checked_ms(DTYPES[dname], D, args.shape, causal, args.repeat,
                                                  deterministic=det, tc_config=cfg or None)
                    except AssertionError as e:
                        print(line + f"CHECK FAILED, not timed: {e}")
                        ok = False
                        continue
                    times[("ours", name)] = ms
                    print(line + f"{ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  ({launches} ms)", flush=True)
                if not args.no_torch:
                    for name, ms in torch_ms(dname, args.shape, D, causal, args.repeat).items():
                        times[("torch", name)] = ms
                        print(f"{dname:>5} d={D:<4} causal={str(causal):<5} {'torch ' + name:>22}: {ms:8.3f} ms "
                              f"{flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
                rows += [(impl, name, dname, causal, D, ms, flops) for (impl, name), ms in times.items()]
    if args.csv:
        import cupy

        import bench  # provenance columns

        torch = None
        if not args.no_torch:
            import torch
        prov = bench.provenance(cupy, torch, gpu)
        del prov["gpu"]
        with open(args.csv, "w") as f:
            f.write("gpu,direction,impl,version,dtype,causal,head_dim,seq_len,batch,heads,ms,tflops,status,"
                    + ",".join(prov) + "\n")
            for impl, name, dname, causal, D, ms, flops in rows:
                good = ms == ms  # NaN: that torch backend is unavailable
                f.write(f"{gpu},bwd,{impl},{name.replace(' ', '_')},{dname},{causal},{D},{N},{B},{H},{ms:.4f},"
                        f"{flops / ms / 1e9 if good else float('nan'):.1f},{'ok' if good else 'unavailable'},"
                        + ",".join(prov.values()) + "\n")
        print(f"wrote {args.csv}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
