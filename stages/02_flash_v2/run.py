"""Stage 02: FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1), five versions, checked then timed.

1. Checks every version, in each dtype it takes, against the fp64 oracle (stage 00 in float64) by the
   tolerance rule (stages.common.check_forward).
2. Then times every version (CUDA events on the GPU), per dtype, head dim and mask, in TFLOP/s.

Versions (kernels/flash_v2_forward_<version>.cu; --version):
  fp32       loops swapped (one block per Q tile), warps split Q_i's rows, normalisation deferred, register-
             tiled FFMA, exp2, causal tiles skipped. Any head dim 1..128.
  fp32_overlap  fp32 with its loads overlapping its math: V_j by cp.async, K_{j+1} prefetched.
  tc         fp16/bf16 on tensor cores: mma.sync m16n8k16 + ldmatrix.
  pipelined  tc + cp.async double buffering, padded shared memory, tiles tuned per head dim, mask-free interior
             tiles.
  fp32x3     float32 on TF32 tensor cores by the 3xTF32 split.
On the CPU the numpy tile mirror runs instead (same tiles and loop order, tensor-core rounding emulated).
Comparisons with torch SDPA and the fp32 kernel's other tile configurations: dev/sweep_flash_v2.py.

    python stages/02_flash_v2/run.py                      # CPU mirror, and the kernels when CuPy sees a GPU
    python stages/02_flash_v2/run.py --quick              # small sizes (seconds), for scripts/run_all.py
    python stages/02_flash_v2/run.py --version fp32 --head-dims 64 128
    python stages/02_flash_v2/run.py --help
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

import numpy as np

from stages import flash_v2
from stages import naive  # noqa: F401  (stage 00: the tolerance rule's reference, registered on import)
from stages.common import (
    attention_flops, bfloat16, check_forward, device, gpu_name, make_inputs, run_devices, time_ms,
)
from stages.common.verify import errors_and_bounds
from stages.common.cli import check_head_dim, positive_int

# ---- configuration (each overridable on the command line)
CHECK_SHAPE = {"gpu": (2, 3, 500), "cpu": (1, 2, 300)}  # B, H, N of the checks (N not a tile multiple: tails)
HEAD_DIM = 64  # D of the checks
BENCH_SHAPE = {"gpu": (4, 16, 4096), "cpu": (1, 2, 512)}  # B, H, N of the timings (the mirror is slow)
BENCH_DIMS = (64, 128)  # head dims of the GPU timings (the CPU times the check's head dim)
QUICK = {"check": (1, 2, 200), "gpu": (1, 4, 1024), "cpu": (1, 2, 256)}  # --quick shapes
REPEAT = 10  # timed repeats on the GPU (median); 2 on the CPU
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": bfloat16}
VERSION_DTYPES = {"fp32": ("fp32",), "fp32_overlap": ("fp32",), "tc": ("fp16", "bf16"), "pipelined": ("fp16", "bf16"),
                  "fp32x3": ("fp32",)}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", choices=flash_v2.VERSIONS + ("all",), default="all", help="which version(s)")
    ap.add_argument("--check-shape", type=positive_int, nargs=3, default=None, metavar=("B", "H", "N"),
                    help=f"shape of the checks (default {CHECK_SHAPE}; {QUICK['check']} with --quick)")
    ap.add_argument("--head-dim", type=positive_int, default=HEAD_DIM, help="head dim of the checks")
    ap.add_argument("--no-causal", action="store_true", help="run the checks non-causal")
    ap.add_argument("--bench-shape", type=positive_int, nargs=3, default=None, metavar=("B", "H", "N"),
                    help=f"shape of the timings (default {BENCH_SHAPE})")
    ap.add_argument("--head-dims", type=positive_int, nargs="+", default=list(BENCH_DIMS),
                    help="head dims of the GPU timings")
    ap.add_argument("--repeat", type=positive_int, default=None, help=f"timed repeats (default GPU {REPEAT}, CPU 2)")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: the CPU (mirror), and the GPU (kernels) too when CuPy sees one")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    args = ap.parse_args(argv)
    args.versions = flash_v2.VERSIONS if args.version == "all" else (args.version,)
    for D in {args.head_dim, *args.head_dims}:
        if not any(D in flash_v2.head_dims(v) for v in args.versions):  # --version all: each version it fits
            check_head_dim(ap, "--head-dim" if D == args.head_dim else "--head-dims", D,
                           flash_v2.head_dims(args.versions[0]), f"version {args.versions[0]}")
    return args


def main(argv=None):
    args = parse(argv)
    causal = not args.no_causal
    devices = run_devices(args.device)
    ok, skipped = True, []
    for dev in devices:
        gpu = dev == "gpu"
        xp = __import__("cupy") if gpu else np
        where = f"GPU {gpu_name()}, CUDA kernels" if gpu else "CPU, numpy tile mirror"
        B, H, N = args.check_shape or (QUICK["check"] if args.quick else CHECK_SHAPE[dev])
        D = args.head_dim
        print(f"\n== stage 02 FlashAttention-2 forward on the {where}")
        # 1. check every version against the fp64 oracle, before any timing
        print(f"checks: B={B} H={H} N={N} D={D} causal={causal}; error against the fp64 oracle at each "
              "output's worst row (tolerance rule)")
        for version in args.versions:
            if D not in flash_v2.head_dims(version):
                dims = flash_v2.head_dims(version)
                takes = f"1..{dims[-1]}" if dims == tuple(range(1, dims[-1] + 1)) else ", ".join(map(str, dims))
                print(f"  {version:>9}: head dim {D} not supported (takes {takes}): skipped")
                continue
            for dt in VERSION_DTYPES[version]:
                q, k, v = make_inputs(B, H, N, N, D, dtype=DTYPES[dt], xp=xp)
                try:
                    br, bc = flash_v2.tiles(version, D, causal)
                    errs = check_forward(flash_v2.forward, q, k, v, causal=causal, version=version, with_bounds=True)
                    print(f"  {version:>9} {dt:>5} (Br={br}, Bc={bc}): {errors_and_bounds(errs)}")
                except device.UnsupportedDevice as e:  # a version or dtype this GPU lacks (a T4: no bfloat16)
                    print(f"  {version:>9} {dt:>5}: skipped, not on this GPU: {e}")
                    skipped.append((dev, version, dt))
                except AssertionError as e:
                    print(f"  {version:>9} {dt:>5}: CHECK FAILED: {e}")
                    ok = False
        if not ok:
            print("A check failed: no timings.")
            continue
        print("All results match. Timing.")
        # 2. time every version x dtype x head dim (x mask on the GPU) that ran its check
        shape = args.bench_shape or (QUICK[dev] if args.quick else BENCH_SHAPE[dev])
        runs = [(version, dt) for version in args.versions for dt in VERSION_DTYPES[version]
                if (dev, version, dt) not in skipped]
        bench(runs, args.head_dims if gpu else [D], shape, (False, True) if gpu else (causal,), xp, gpu,
              args.repeat or (REPEAT if gpu else 2), where)
    left_out = f"; not on this GPU: {', '.join(f'{v} {dt}' for _, v, dt in skipped)}" if skipped else ""
    print(f"SUMMARY 02_flash_v2 {'PASS' if ok else 'FAIL'} {'/'.join(args.versions)} fwd vs fp64 oracle, "
          f"on {', '.join(devices)}{left_out}")
    return ok


def bench(runs, dims, shape, causals, xp, gpu, repeat, where):
    """Print the median time and rate (TFLOP/s on a GPU, GFLOP/s on the CPU) of each (version, dtype) of runs x head
    dim x mask; a head dim the GPU lacks for a version (a T4's shared memory) is said and left out."""
    B, H, N = shape
    unit, per_ms = ("TFLOP/s", 1e9) if gpu else ("GFLOP/s", 1e6)
    print(f"\ntimings on the {where}: B={B} H={H} N={N}, median of {repeat}; "
          f"{unit} = 4 B H N^2 D / time (causal halved)")
    print(f"{'version':>9} {'dtype':>5} {'D':>4} {'causal':>6} | {'ms':>9} {unit:>8}")
    for version, dt in runs:
        for D in dims:
            if D not in flash_v2.head_dims(version):
                continue
            q, k, v = make_inputs(B, H, N, N, D, dtype=DTYPES[dt], xp=xp)
            for causal in causals:
                try:
                    ms = time_ms(lambda: flash_v2.forward(q, k, v, causal=causal, version=version), gpu=gpu,
                                 warmup=3 if gpu else 1, repeat=repeat)
                except device.UnsupportedDevice as e:
                    print(f"{version:>9} {dt:>5} {D:>4} {str(causal):>6} | not on this GPU: {e}")
                    break
                flops = attention_flops(B, H, N, N, D, causal=causal)
                print(f"{version:>9} {dt:>5} {D:>4} {str(causal):>6} | {ms:>9.3f} {flops / ms / per_ms:>8.3g}")


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
