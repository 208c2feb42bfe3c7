"""Stage 03: FlashAttention-2 backward (Dao, arXiv 2307.08691, Algorithm 2), checked then timed.

    D_i = rowsum(dO_i * O_i)                              preprocess kernel
    per K/V tile j (one block): for each Q tile i:        P_ij recomputed from the saved L_i
        dV_j += P_ij^T dO_i;  dS_ij = P_ij * (dO_i V_j^T - D_i);  dK_j += dS_ij^T Q_i
        dQ_i += dS_ij K_j  (fp32 atomicAdd; or deterministic: a separate dQ pass, no atomics)

1. Checks every version and dQ mode against the fp64 oracle (stage 00 in float64) by the tolerance rule
   (stages.common.check_backward: the backward starts from the oracle's o and lse).
2. Then times each version and mode (CUDA events on the GPU).

Versions (--version; both dQ modes unless --deterministic):
    fp32    float32 on CUDA cores, S in double for the exponent; the readable one. Head dims 32, 64, 128.
    tc      float16/bfloat16 on tensor cores (mma.sync, ldmatrix, cp.async double buffers). Head dims 64, 128, 256.
    fp32x3  float32 on TF32 tensor cores by the 3xTF32 split (sm_80 and newer), atomic dQ only. Head dims 32, 64,
            128.
With --version all, the versions that take --head-dim run.
On the CPU the numpy tile mirror runs instead (same tiles and loop order).
Comparisons with torch SDPA's backward, per-launch times and the tc kernel's other tiles: dev/sweep_backward.py.

    python stages/03_flash_v2_backward/run.py                      # CPU mirror (and GPU kernels if any)
    python stages/03_flash_v2_backward/run.py --quick              # small, for scripts/run_all.py
    python stages/03_flash_v2_backward/run.py --version tc --dtype bf16 --deterministic
    python stages/03_flash_v2_backward/run.py --help
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout: `stages` imports with no install

import numpy as np

from stages import flash_v2_backward as fb
from stages import naive
from stages.common import bfloat16, check_backward, device, gpu_name, make_inputs, run_devices, time_ms
from stages.common.verify import errors_and_bounds
from stages.common.cli import check_head_dim, positive_int

# ---- configuration (each overridable on the command line)
BATCH = 1  # B
HEADS = 4  # H (2 with --quick)
HEAD_DIM = 64  # D (fp32: 32, 64, 128; tc: 64, 128, 256; fp32x3: 32, 64, 128)
SEQ = {"cpu": 300, "gpu": 2048}  # N of the check and the timing (128 with --quick); numpy is slow: small on the CPU
REPEAT = {"cpu": 3, "gpu": 10}  # timed repeats (median)
DTYPES = {"fp16": np.float16, "bf16": bfloat16}  # the tc version's dtypes (fp32 and fp32x3 run float32)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", choices=["all", *fb.VERSIONS], default="all",
                    help="which kernel version: fp32 or fp32x3 (float32), tc (fp16/bf16); all: each that takes "
                         "--head-dim")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of the tc version (default bf16; fp16 on a GPU without bfloat16, a T4)")
    ap.add_argument("--deterministic", action="store_true",
                    help="only the deterministic mode (dQ from a separate pass, no atomics); default: both modes")
    ap.add_argument("--batch", type=positive_int, default=BATCH, help="batch size B")
    ap.add_argument("--heads", type=positive_int, default=None, help=f"heads H (default {HEADS}; 2 with --quick)")
    ap.add_argument("--head-dim", type=positive_int, default=HEAD_DIM, help="head dimension D")
    ap.add_argument("--seq", type=positive_int, default=None, help=f"sequence length (default {SEQ}; 128 with --quick)")
    ap.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    ap.add_argument("--repeat", type=positive_int, default=None, help=f"timed repeats (default {REPEAT})")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: the CPU mirror, and the GPU kernels too when CuPy sees a GPU")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    args = ap.parse_args(argv)
    args.versions = fb.VERSIONS if args.version == "all" else (args.version,)
    takers = tuple(v for v in args.versions if args.head_dim in fb.HEAD_DIMS[v])  # --version all: those that fit
    if not takers:
        check_head_dim(ap, "--head-dim", args.head_dim, fb.HEAD_DIMS[args.versions[0]], f"version {args.versions[0]}")
    args.versions = takers
    if args.deterministic and args.versions == ("fp32x3",):
        ap.error("version fp32x3 adds dQ with atomics only: --deterministic runs in version fp32")
    return args


def main(argv=None):
    args = parse(argv)
    causal = not args.no_causal
    devices = run_devices(args.device)
    modes = (True,) if args.deterministic else (False, True)
    ok, skipped = True, []
    for dev in devices:
        gpu = dev == "gpu"
        xp = __import__("cupy") if gpu else np
        B, D = args.batch, args.head_dim
        H = args.heads if args.heads is not None else (2 if args.quick else HEADS)
        n = args.seq if args.seq is not None else (128 if args.quick else SEQ[dev])
        repeat = args.repeat or REPEAT[dev]
        where = f"GPU {gpu_name()}" if gpu else "CPU (numpy tile mirror)"
        print(f"\n== stage 03 FlashAttention-2 backward on the {where}: B={B} H={H} N={n} D={D} causal={causal}")
        tc_dtype = args.dtype or ("fp16" if gpu and not device.device().arch.bf16 else "bf16")
        if "tc" in args.versions and tc_dtype != (args.dtype or "bf16"):
            print(f"  version tc in {tc_dtype}: this GPU has no bfloat16 tensor cores")
        runs = [(version, np.float32 if version != "tc" else DTYPES[tc_dtype], det)
                for version in args.versions for det in modes if not (det and version == "fp32x3")]
        # 1. check every version and mode against the fp64 oracle, before any timing
        print("error against the fp64 oracle at each output's worst row (tolerance rule):")
        for version, dtype, det in runs:
            q, k, v, do = make_inputs(B, H, n, n, D, dtype=dtype, xp=xp, grad=True)
            label = f"{version:>6} {np.dtype(dtype).name:>8} {'deterministic' if det else 'atomic dQ':>13}"
            try:
                errs = check_backward(fb.backward, q, k, v, do, causal=causal, version=version, deterministic=det,
                                      with_bounds=True)
                print(f"  {label}: {errors_and_bounds(errs)}")
            except device.UnsupportedDevice as e:  # what this GPU lacks (a T4: TF32 tensor cores, bfloat16)
                print(f"  {label}: skipped, not on this GPU: {e}")
                skipped.append((dev, version, dtype, det))
            except AssertionError as e:
                print(f"  {label}: CHECK FAILED: {e}")
                ok = False
        if not ok:
            print("A check failed: no timings.")
            continue
        print("All results match. Timing.")
        # 2. time each version and mode (o, lse from stage 00: the backward's inputs, not what is timed)
        flops = fb.backward_flops(B, H, n, n, D, causal)
        print(f"timings on the {where}, median of {repeat}:")
        unit, per_ms = ("TFLOP/s", 1e9) if gpu else ("GFLOP/s", 1e6)
        print(f"  {'ver':>6} {'dtype':>8} {'dQ mode':>13} | {'ms':>9} {unit:>9}")
        for version, dtype, det in runs:
            if (dev, version, dtype, det) in skipped:
                continue
            q, k, v, do = make_inputs(B, H, n, n, D, dtype=dtype, xp=xp, grad=True)
            o, lse = naive.forward(q, k, v, causal=causal)
            t = time_ms(lambda: fb.backward(q, k, v, o, lse, do, causal=causal, version=version, deterministic=det),
                        gpu=gpu, warmup=1, repeat=repeat)
            print(f"  {version:>6} {np.dtype(dtype).name:>8} {'deterministic' if det else 'atomic dQ':>13} | "
                  f"{t:>9.3f} {flops / t / per_ms:>9.3g}")
    left_out = sorted({f"{v} {np.dtype(dt).name}" for _, v, dt, _ in skipped})
    print(f"SUMMARY 03_flash_v2_backward {'PASS' if ok else 'FAIL'} {'+'.join(args.versions)} dq/dk/dv vs fp64 "
          f"oracle, {'deterministic' if args.deterministic else 'atomic+deterministic'}, on {', '.join(devices)}"
          + (f"; not on this GPU: {', '.join(left_out)}" if left_out else ""))
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
