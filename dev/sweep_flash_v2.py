"""Tuning sweep of stage 02's forward on a GPU: the CUDA-core kernels' tile configurations, and every version beside
torch SDPA in the same run. Each configuration is checked against the fp64 oracle (tolerance rule, on a small
problem) before it is timed; a configuration that fails is reported and not timed.

    python dev/sweep_flash_v2.py                                   # default configs, d=64 and 128
    python dev/sweep_flash_v2.py --configs 8,4,1,1 4,8,0,0 --head-dims 64
    python dev/sweep_flash_v2.py --torch --versions fp32 pipelined  # ours beside torch SDPA

A config is TM,NWARPS[,ASYNC_V[,PREFETCH_K]] (Br = 4 * NWARPS * TM): PREFETCH_K 1 (the default) is version
fp32_overlap with config (TM, NWARPS, ASYNC_V), PREFETCH_K 0 version fp32 (the paper's loop, ASYNC_V 0) with config
(TM, NWARPS) (flash_v2.forward's config=). TM = 8 spills registers above d = 64. torch: fp32 against its
EFFICIENT_ATTENTION backend, fp16/bf16 against FLASH_ATTENTION.
"""
import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout: `stages` imports with no install

import numpy as np

from stages import flash_v2
from stages import naive  # noqa: F401  (stage 00: the tolerance rule's reference, registered on import)
from stages.common import attention_flops, bfloat16, check_forward, gpu_name, has_gpu, make_inputs, time_ms
from stages.common.cli import positive_int

CONFIGS = ("8,4,1,1", "8,4,0,1", "8,4,0,0", "4,8,1,1", "4,8,0,0", "4,4,1,1")  # TM,NWARPS,ASYNC_V,PREFETCH_K
SHAPE = (4, 16, 4096)  # B, H, N timed
CHECK_SHAPE = (1, 2, 500)  # B, H, N of each configuration's check
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": bfloat16}
VERSION_DTYPES = {"fp32": ("fp32",), "fp32_overlap": ("fp32",), "tc": ("fp16", "bf16"), "pipelined": ("fp16", "bf16"),
                  "fp32x3": ("fp32",)}


def config_type(text):
    try:
        cfg = tuple(int(x) for x in text.split(","))
    except ValueError:
        cfg = ()
    if not 2 <= len(cfg) <= 4 or cfg[0] not in (4, 8) or cfg[1] not in (4, 8) or any(x not in (0, 1) for x in cfg[2:]):
        raise argparse.ArgumentTypeError(f"expected TM,NWARPS[,ASYNC_V[,PREFETCH_K]] with TM and NWARPS in 4, 8 and "
                                         f"the flags 0 or 1, got {text!r}")
    if cfg[2:] == (1, 0):
        raise argparse.ArgumentTypeError(f"{text!r}: ASYNC_V is version fp32_overlap's (PREFETCH_K 1); version fp32 "
                                         "(PREFETCH_K 0) loads V_j synchronously")
    return cfg


def version_and_config(cfg):
    """(version, config) of a TM,NWARPS[,ASYNC_V[,PREFETCH_K]] tuple: PREFETCH_K (default 1) is fp32_overlap."""
    tm, nwarps, async_v, prefetch_k = (*cfg, 1, 1)[:4]
    return ("fp32_overlap", (tm, nwarps, async_v)) if prefetch_k else ("fp32", (tm, nwarps))


def torch_ms(dt, B, H, N, D, causal, repeat):
    """(median ms, backend name) of torch SDPA on random inputs, timed with torch's CUDA events."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt]
    backend = SDPBackend.EFFICIENT_ATTENTION if dt == "fp32" else SDPBackend.FLASH_ATTENTION
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=tdt) for _ in range(3))
    times = []
    with sdpa_kernel(backend):
        for i in range(3 + repeat):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b))
    return statistics.median(times), backend.name.lower()


def checked_ms(fwd_kw, dt, D, shape, causal, repeat):
    """Check flash_v2.forward(**fwd_kw) against the oracle on CHECK_SHAPE, then its median ms at `shape`."""
    import cupy

    q, k, v = make_inputs(*CHECK_SHAPE, CHECK_SHAPE[2], D, dtype=DTYPES[dt], xp=cupy)
    check_forward(flash_v2.forward, q, k, v, causal=causal, **fwd_kw)
    B, H, N = shape
    q, k, v = make_inputs(B, H, N, N, D, dtype=DTYPES[dt], xp=cupy)
    return time_ms(lambda: flash_v2.forward(q, k, v, causal=causal, **fwd_kw), gpu=True, repeat=repeat)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", type=config_type, nargs="*", default=[config_type(c) for c in CONFIGS],
                    help="fp32 kernel configurations TM,NWARPS[,ASYNC_V[,PREFETCH_K]] (none: skip the fp32 sweep)")
    ap.add_argument("--versions", nargs="*", choices=flash_v2.VERSIONS, default=[],
                    help="versions timed at their defaults (beside torch with --torch)")
    ap.add_argument("--torch", action="store_true", help="time torch SDPA beside every row")
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=[64, 128])
    ap.add_argument("--shape", type=positive_int, nargs=3, default=SHAPE, metavar=("B", "H", "N"))
    ap.add_argument("--repeat", type=positive_int, default=10, help="timed repeats (median)")
    args = ap.parse_args(argv)
    if not has_gpu():
        raise SystemExit("sweep_flash_v2.py times CUDA kernels: no GPU found (CuPy sees no device)")
    B, H, N = args.shape
    rows = [(ver, "fp32", dict(version=ver, config=c2), f"config {','.join(map(str, c))}")
            for c in args.configs for ver, c2 in [version_and_config(c)]]
    rows += [(v, dt, dict(version=v), "default") for v in args.versions for dt in VERSION_DTYPES[v]]
    print(f"== stage 02 forward sweep on {gpu_name()}: B={B} H={H} N={N}, median of {args.repeat}")
    print(f"{'version':>9} {'dtype':>5} {'what':>16} {'D':>4} {'causal':>6} | {'ms':>8} {'TFLOP/s':>8}"
          + (f" | {'torch backend':>20} {'ms':>8} {'TFLOP/s':>8} {'torch/ours':>10}" if args.torch else ""))
    ok = True
    for version, dt, kw, what in rows:
        for D in args.head_dims:
            if D not in flash_v2.head_dims(version):
                continue
            for causal in (False, True):
                flops = attention_flops(B, H, N, N, D, causal=causal)
                line = f"{version:>9} {dt:>5} {what:>16} {D:>4} {str(causal):>6} | "
                try:
                    ms = checked_ms(kw, dt, D, args.shape, causal, args.repeat)
                except AssertionError as e:
                    print(line + f"CHECK FAILED, not timed: {e}")
                    ok = False
                    continue
                line += f"{ms:>8.3f} {flops / ms / 1e9:>8.1f}"
                if args.torch:
                    tms, name = torch_ms(dt, B, H, N, D, causal, args.repeat)
                    line += f" | {name:>20} {tms:>8.3f} {flops / tms / 1e9:>8.1f} {tms / ms:>9.2f}x"
                print(line, flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
