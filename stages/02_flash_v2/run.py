"""Stage 02: FlashAttention-2 forward (arXiv 2307.08691, Algorithm 1), four versions, checked then timed.

Checks each version against the one before it and against the fp64 oracle (the tolerance rule):
    fp32       against stage 01 (FlashAttention v1, fp32) on the same float32 inputs
    tc         against the fp32 version on the same 16-bit values (float16 and bfloat16)
    pipelined  against tc
    fp32x3     against the fp32 version (float32)
then times every version (GPU: TFLOP/s beside torch SDPA in the same run when torch is there: the fp32
version against the EFFICIENT_ATTENTION backend in fp32, the tensor-core versions against FLASH_ATTENTION).

Versions (kernels/flash_v2_forward_<version>.cu). MEASURED on an H100 80GB HBM3 by scripts/bench.py (results/bench.csv),
B=4 H=16 N=4096, non-causal, ratio to torch SDPA in the same run (all rows: the top-level README):
  fp32       loops swapped (one block per Q tile), warps split Q_i's rows, normalisation deferred, register-
             tiled FFMA (each lane a TM x 8 block of S_ij), exp2, causal tiles skipped, V_j by cp.async and K_{j+1}
             prefetched during P~ V. Any head dim 1..128. d=64: 38.4 TFLOP/s, 1.12x torch fp32 efficient;
             d=128: 33.8 TFLOP/s, 0.73x (torch's fp32 backend is 3xTF32 on tensor cores; ours is CUDA-core FFMA).
  tc         fp16/bf16, mma.sync m16n8k16 tensor cores + ldmatrix. bf16: 52-55 TFLOP/s, 0.15-0.19x flash.
  pipelined  tc + cp.async double buffering, padded shared memory, tiles tuned per head dim, mask-free interior
             tiles. bf16: d=64 311 TFLOP/s (1.04x torch flash), d=128 336 TFLOP/s (0.99x).
  fp32x3     float32 on TF32 tensor cores by the 3xTF32 split: d=64 39.5 TFLOP/s (1.15x), d=128 33.1 (0.71x).
On the CPU the numpy tile mirror runs instead (same tiles and loop order, tensor-core rounding emulated).

    python stages/02_flash_v2/run.py                      # CPU mirror; with a GPU: kernels + timings vs torch
    python stages/02_flash_v2/run.py --quick              # small sizes (seconds), for scripts/run_all.py
    python stages/02_flash_v2/run.py --version fp32 --head-dims 64 128 --no-check
    python stages/02_flash_v2/run.py --sweep              # GPU: also the fp32 kernel's other configurations
    python stages/02_flash_v2/run.py --help
"""
import argparse
import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from stages import flash_v1, flash_v2, naive  # noqa: E402
from stages.common import (  # noqa: E402
    attention_flops, bfloat16, cast, gpu_name, run_devices, make_inputs, max_error, time_ms, to_numpy,
)

# ---- configuration (each overridable on the command line)
CHECK_SHAPE = (2, 3, 500)  # B, H, N of the correctness checks (N not a multiple of any tile: tails exercised)
CPU_CHECK_SHAPE = (1, 2, 300)  # the numpy mirror is slow: smaller on the CPU
HEAD_DIM = 64  # D of the checks
CAUSAL = True  # the checks run causal (the timings run both)
BENCH_SHAPE = (4, 16, 4096)  # B, H, N of the GPU timings: the targets are measured here
BENCH_DIMS = (64, 128)  # head dims of the timings
CPU_BENCH_SHAPE = (1, 2, 512)  # the mirror's timing on the CPU
DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": bfloat16}
VERSION_DTYPES = {"fp32": ("fp32",), "tc": ("fp16", "bf16"), "pipelined": ("fp16", "bf16"), "fp32x3": ("fp32",)}
PREVIOUS = {"fp32": "stage 01", "tc": "fp32", "pipelined": "tc", "fp32x3": "fp32"}
# (TM, NWARPS, ASYNC_V, PREFETCH_K) of the fp32 kernel tried by --sweep (TM = 8 only at d <= 64: it spills above)
SWEEP = ((8, 4, 1, 1), (8, 4, 1, 0), (8, 4, 0, 0), (4, 8, 1, 1), (4, 8, 1, 0), (4, 4, 1, 1))


def _previous(version, q, k, v, causal):
    """The version before `version` on the same values (stage 01 before fp32; fp32 on the upcast 16-bit values)."""
    if version == "fp32":
        return flash_v1.forward(q, k, v, causal=causal)
    if version in ("tc", "fp32x3"):
        return flash_v2.forward(*(cast(x, np.float32) for x in (q, k, v)), causal=causal, version="fp32")
    return flash_v2.forward(q, k, v, causal=causal, version="tc")


def check(version, dt, xp, B, H, N, D, causal):
    """The version against the fp64 oracle by the tolerance rule (2x the naive same-dtype error + 1e-5), and against
    the previous version within twice that. Returns a printable line; raises AssertionError on a failure."""
    q, k, v = make_inputs(B, H, N, N, D, dtype=DTYPES[dt], xp=xp)
    o, lse = flash_v2.forward(q, k, v, causal=causal, version=version)
    qh, kh, vh = (to_numpy(x) for x in (q, k, v))
    o64, lse64 = naive.forward(*(cast(x, np.float64) for x in (qh, kh, vh)), causal=causal)  # the oracle
    o_low, lse_low = naive.forward(qh, kh, vh, causal=causal)  # naive attention in the same dtype: the yardstick
    o_p, lse_p = _previous(version, q, k, v, causal)
    bound = {"o": 2 * max_error(o_low, o64) + 1e-5, "lse": 2 * max_error(lse_low, lse64) + 1e-5}
    parts = []
    # the oracle by the tolerance rule; then the previous version in the oracle's place, where both versions'
    # errors may add up (triangle inequality): twice the bound
    for what, ref_o, ref_l, times in (("oracle", o64, lse64, 1), (PREVIOUS[version], o_p, lse_p, 2)):
        for name, x, ref in (("o", o, ref_o), ("lse", lse, ref_l)):
            err = max_error(x, ref)
            if not err <= times * bound[name]:
                raise AssertionError(f"{version} {dt}: {name} against {what}: {err:.2e} > bound "
                                     f"{times * bound[name]:.2e}")
            parts.append(f"{name} vs {what} {err:.1e}")
    return ", ".join(parts) + f" (bounds o {bound['o']:.1e}, lse {bound['lse']:.1e})"


def _torch_sdpa(dt, B, H, N, D, causal):
    """A timed closure of torch SDPA (fp32: EFFICIENT_ATTENTION; fp16/bf16: FLASH_ATTENTION) and its name, or None."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tdt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dt]
    backend = SDPBackend.EFFICIENT_ATTENTION if dt == "fp32" else SDPBackend.FLASH_ATTENTION
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=tdt) for _ in range(3))

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn, f"torch {backend.name.lower()}", (q, k, v)


def _torch_ms(fn, warmup=3, repeat=10):
    """Median ms of fn() with torch CUDA events (torch work runs on torch's current stream)."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def bench(versions, dims, shape, gpu, xp, causals=(False, True), config=None):
    """Time each version x dtype x head dim x causal; on the GPU beside torch SDPA. Returns the rows."""
    B, H, N = shape
    rows = []
    where = f"GPU {gpu_name()}" if gpu else "CPU (numpy mirror)"
    print(f"\n== timings on the {where}: B={B} H={H} N={N}; TFLOP/s = 4 B H N^2 D / time (causal halved)")
    print(f"{'version':>9} {'dtype':>5} {'D':>4} {'causal':>6} | {'ms':>8} {'TFLOP/s':>8} | "
          f"{'torch backend':>26} {'ms':>8} {'TFLOP/s':>8} | {'ours/torch':>10} {'max|o-torch|':>12}")
    for version in versions:
        for dt in VERSION_DTYPES[version]:
            for D in dims:
                if D not in flash_v2.head_dims(version):
                    continue
                for causal in causals:
                    flops = attention_flops(B, H, N, N, D, causal=causal)
                    q, k, v = make_inputs(B, H, N, N, D, dtype=DTYPES[dt], xp=xp)
                    if version == "fp32" and gpu and config:
                        fwd = functools.partial(flash_v2.flash_v2._fp32_forward, causal=causal,
                                                scale=1 / np.sqrt(D), config=config)
                    else:
                        fwd = functools.partial(flash_v2.forward, causal=causal, version=version)
                    ms = time_ms(lambda: fwd(q, k, v), gpu=gpu, warmup=3 if gpu else 1, repeat=10 if gpu else 2)
                    line = f"{version:>9} {dt:>5} {D:>4} {str(causal):>6} | {ms:>8.3f} {flops / ms / 1e9:>8.3g} | "
                    t = _torch_sdpa(dt, B, H, N, D, causal) if gpu else None
                    row = dict(version=version, dtype=dt, head_dim=D, causal=causal, ms=ms,
                               tflops=flops / ms / 1e9)
                    if t is not None:
                        fn, name, (tq, tk, tv) = t
                        tms = _torch_ms(fn)
                        # same inputs through ours, to check that both compute the same thing before comparing
                        try:
                            o, _ = fwd(*(xp.from_dlpack(x.detach()) for x in (tq, tk, tv)))
                            diff = max_error(cast(o, np.float32), xp.from_dlpack(fn().float().contiguous()))
                        except Exception as e:  # e.g. a dtype DLPack cannot carry: report, keep timing
                            print(f"  (could not compare with torch's output: {type(e).__name__}: {e})")
                            diff = float("nan")
                        line += (f"{name:>26} {tms:>8.3f} {flops / tms / 1e9:>8.1f} | {tms / ms:>9.2f}x "
                                 f"{diff:>12.1e}")
                        row.update(torch_backend=name, torch_ms=tms, ratio=tms / ms, diff=diff)
                    else:
                        line += f"{'(no torch)' if gpu else '':>26} {'':>8} {'':>8} |"
                    print(line)
                    rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", choices=flash_v2.VERSIONS + ("all",), default="all", help="which version(s)")
    ap.add_argument("--check-shape", type=int, nargs=3, default=None, metavar=("B", "H", "N"),
                    help=f"shape of the checks (default GPU {CHECK_SHAPE}, CPU {CPU_CHECK_SHAPE})")
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM, help="head dim of the checks")
    ap.add_argument("--no-causal", action="store_true", help="run the checks non-causal")
    ap.add_argument("--bench-shape", type=int, nargs=3, default=None, metavar=("B", "H", "N"),
                    help=f"shape of the timings (default GPU {BENCH_SHAPE}, CPU {CPU_BENCH_SHAPE})")
    ap.add_argument("--head-dims", type=int, nargs="+", default=list(BENCH_DIMS), help="head dims of the timings")
    ap.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto",
                    help="auto: the CPU (mirror), and the GPU (kernels) too when CuPy sees one")
    ap.add_argument("--no-check", action="store_true", help="skip the checks (timings only)")
    ap.add_argument("--sweep", action="store_true",
                    help="GPU: time the fp32 kernel's other configurations too (SWEEP)")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds), for scripts/run_all.py")
    args = ap.parse_args(argv)
    causal = not args.no_causal
    versions = flash_v2.VERSIONS if args.version == "all" else (args.version,)
    devices = run_devices(args.device)

    ok = True
    for dev in devices:
        gpu = dev == "gpu"
        xp = np
        if gpu:
            import cupy as xp
        B, H, N = args.check_shape or (CPU_CHECK_SHAPE if not gpu else CHECK_SHAPE)
        if args.quick:
            B, H, N = 1, 2, 200
        what = f"GPU ({gpu_name()}), CUDA kernels" if gpu else "CPU, numpy tile mirror"
        print(f"\n== stage 02 FlashAttention-2 forward on the {what}")
        if not args.no_check:
            print(f"checks: B={B} H={H} N={N} D={args.head_dim} causal={causal}; max abs errors "
                  "(each within the tolerance rule: 2x naive same-dtype error + 1e-5)")
            for version in versions:
                br, bc = flash_v2.tiles(version, args.head_dim, causal)
                for dt in VERSION_DTYPES[version]:
                    try:
                        line = check(version, dt, xp, B, H, N, args.head_dim, causal)
                        print(f"  {version:>9} {dt:>5} (Br={br}, Bc={bc}): {line}")
                    except (AssertionError, ValueError, TypeError, RuntimeError) as e:
                        print(f"  {version:>9} {dt:>5}: CHECK FAILED: {e}")
                        ok = False
            if not ok:
                print("A check failed: no timings.")
                continue
            print("All results match. Timing.")
        shape = args.bench_shape or (BENCH_SHAPE if gpu else CPU_BENCH_SHAPE)
        if args.quick:
            shape = (1, 2, 256) if not gpu else (1, 4, 1024)
        if not gpu:
            bench(versions, [args.head_dim], shape, gpu, xp, causals=(causal,))
            continue
        bench(versions, args.head_dims, shape, gpu, xp)
        if args.sweep:
            for config in SWEEP:
                dims = [D for D in args.head_dims if config[0] == 4 or D <= 64]  # TM = 8 at d = 128: spills
                print(f"\n-- fp32 (TM, NWARPS, ASYNC_V, PREFETCH_K) = {config}: Br = {config[1] * 4 * config[0]}")
                bench(("fp32",), dims, shape, gpu, xp, config=config)
    checked = "not checked (--no-check)" if args.no_check else "vs fp64 oracle and previous version"
    print(f"SUMMARY 02_flash_v2 {'PASS' if ok else 'FAIL'} {'/'.join(versions)} fwd {checked}, "
          f"on {', '.join(devices)}")
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
