"""Where the backward's time goes: Nsight Compute counters of stage 03's tensor-core kernel (version 'tc') and of
PyTorch's FlashAttention-2 backward kernel on the same problem, one CSV row per kernel; with --dtype fp32, stage 03's
version 'fp32x3' and PyTorch's memory-efficient backward kernel (CUTLASS, float32); with --dtype fp32 --forward, the
forward kernels instead (stage 02's version 'fp32x3' and PyTorch's memory-efficient forward).

    python3 dev/profile_backward.py --out results/profile_backward_h100.csv
    python3 dev/profile_backward.py --dtype fp16 --head-dim 64 --seq 4096 --batch 4 --heads 16 --causal
    python3 dev/profile_backward.py --dtype fp32 --head-dim 64 --out fp32.csv
    python3 dev/profile_backward.py --dtype fp32 --forward --head-dim 128 --out fp32_forward.csv

Needs a CUDA GPU, CuPy, PyTorch and Nsight Compute's `ncu` (on PATH or in /usr/local/cuda/bin) with permission to
read the GPU's performance counters. The script runs itself under ncu once per kernel: the child makes the inputs,
runs stage 02's forward, then each backward twice; ncu measures the second launch of the kernel it is given (the
first is a warm-up). ncu runs one kernel at a time at fixed clocks, so its durations compare the two kernels with
each other; dev/bench.py gives the speeds.

Columns, per kernel:
    duration_ms           the kernel's time under ncu
    warp_instructions     instructions executed, counted per warp (smsp__inst_executed)
    ldmatrix              ldmatrix instructions (smsp__inst_executed_op_ldsm)
    smem_wavefronts       shared-memory wavefronts (one per 128 bytes a warp moves; an ldmatrix.x4 is four)
    smem_pct_of_peak      shared-memory pipe throughput, % of its peak over the kernel
    tensor_pct_of_peak    tensor (HMMA) pipe activity, % of its peak while the SM is active
    mma_instructions      tensor-core (HMMA) instructions executed
    issue_pct             instructions issued, % of the SM's peak issue rate while it is active
    short_scoreboard      cycles per warp stalled waiting on shared-memory / ldmatrix results (short scoreboard)
    registers, smem_kb    registers per thread, dynamic shared memory per block (KB)
    occupancy_pct         achieved occupancy (active warps / the SM's maximum)
and the run's provenance (dev/bench.py's columns, plus the ncu version).
"""
import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

METRICS = {  # CSV column -> ncu metric
    "duration_ms": "gpu__time_duration.sum",
    "warp_instructions": "smsp__inst_executed.sum",
    "ldmatrix": "smsp__inst_executed_op_ldsm.sum",
    "smem_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "smem_pct_of_peak": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed",
    "tensor_pct_of_peak": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "mma_instructions": "sm__inst_executed_pipe_tensor_op_hmma.sum",
    "issue_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
    "short_scoreboard": "smsp__average_warp_latency_issue_stalled_short_scoreboard.ratio",
    "registers": "launch__registers_per_thread",
    "smem_kb": "launch__shared_mem_per_block_dynamic",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
}
KERNELS = {"ours": "flash_v2_backward_tc", "torch": "flash_bwd_dq_dk_dv"}  # kernel-name patterns (ncu -k regex:)
KERNELS_FP32 = {"ours": "flash_bwd_fp32x3", "torch": "fmha_cutlassB"}  # --dtype fp32
KERNELS_FP32_FORWARD = {"ours": "flash_v2_forward_fp32x3", "torch": "fmha_cutlassF"}  # --dtype fp32 --forward


def child(args):
    """Under ncu: stage 02's forward, then our backward and PyTorch's flash backward, twice each."""
    import cupy
    import torch

    from stages import flash_v2, flash_v2_backward
    from stages.common import bfloat16, cast

    dtype = {"bf16": bfloat16, "fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}[args.dtype]
    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, do = (cast(cupy.asarray(rng.standard_normal(shape, dtype=np.float32)), dtype) for _ in range(4))
    if args.forward:  # our fp32x3 forward and PyTorch's memory-efficient forward, twice each
        for _ in range(2):
            flash_v2.forward(q, k, v, causal=args.causal, version="fp32x3")
        tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            for _ in range(2):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
        torch.cuda.synchronize()
        return
    o, lse = flash_v2.forward(q, k, v, causal=args.causal)
    for _ in range(2):
        flash_v2_backward.backward(q, k, v, o, lse, do, causal=args.causal,
                                   version="fp32x3" if args.dtype == "fp32" else "auto")
    cupy.cuda.Device().synchronize()
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # PyTorch's own layout, (B, N, H, d) in memory, seen as (B, H, N, d): as dev/bench.py gives it
    bits = cupy.uint32 if args.dtype == "fp32" else cupy.uint16
    tq, tk, tv, tdo = (torch.as_tensor(x.view(bits), device="cuda").view(tdt).transpose(1, 2).contiguous()
                       .transpose(1, 2) for x in (q, k, v, do))
    for t in (tq, tk, tv):
        t.requires_grad_(True)
    backend = "EFFICIENT_ATTENTION" if args.dtype == "fp32" else "FLASH_ATTENTION"
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, backend)):
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=args.causal)
    for _ in range(2):
        torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True)
    torch.cuda.synchronize()


def _environment():
    """(cupy, torch), or SystemExit saying what is missing."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("CuPy sees no device")
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"PyTorch {torch.__version__} sees no CUDA device")
    except Exception as e:  # no CuPy, no driver, no device, no CUDA build of PyTorch
        raise SystemExit(f"profile_backward.py needs a CUDA GPU, CuPy and a CUDA build of PyTorch: "
                         f"{type(e).__name__}: {str(e)[:160]}")
    return cupy, torch


def _ncu():
    found = shutil.which("ncu") or ("/usr/local/cuda/bin/ncu" if os.path.exists("/usr/local/cuda/bin/ncu") else None)
    if found is None:
        raise SystemExit("profile_backward.py needs Nsight Compute's ncu (on PATH or /usr/local/cuda/bin)")
    return found


def _unit(unit, scales):
    """The factor of ncu's unit (per launch or per block: the part before '/') in scales."""
    base = unit.split("/")[0]
    if base not in scales:
        raise SystemExit(f"profile_backward.py: ncu reported the unit {unit!r}, which this script does not know")
    return scales[base]


def profile(ncu, impl, argv, kernels=KERNELS):
    """{column: value} of the kernel kernels[impl], second launch, from ncu's CSV output."""
    cmd = [ncu, "--csv", "--metrics", ",".join(METRICS.values()), "-k", f"regex:{kernels[impl]}", "-s", "1", "-c", "1",
           sys.executable, os.path.abspath(__file__), "--child", *argv]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    if run.returncode != 0 or not rows:
        raise SystemExit(f"ncu found no {kernels[impl]!r} kernel (exit {run.returncode}):\n{run.stdout[-2000:]}\n"
                         f"{run.stderr[-2000:]}")
    values = {r["Metric Name"]: (r["Metric Value"].replace(",", ""), r["Metric Unit"]) for r in rows}
    out = {"impl": impl, "kernel": rows[0]["Kernel Name"].split("<")[0].split("(")[0].replace("void ", "")}
    for col, metric in METRICS.items():
        if metric not in values:
            raise SystemExit(f"ncu did not report {metric} (this ncu version or GPU may not have it)")
        value, unit = values[metric]
        x = float(value)
        if col == "duration_ms":  # ncu picks the unit
            x *= _unit(unit, {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
                              "s": 1e3, "second": 1e3})
        if col == "smem_kb":  # KB = 1024 bytes, as elsewhere in this repository
            x *= _unit(unit, {"byte": 1, "B": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6}) / 1024
        out[col] = round(x, 4)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="CSV to write (default: print only)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--forward", action="store_true", help="the forward kernels instead (with --dtype fp32 only)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.forward and args.dtype != "fp32":
        ap.error("--forward profiles the float32 forward kernels: add --dtype fp32")
    if args.child:
        return child(args)
    cupy, torch = _environment()
    ncu = _ncu()
    import bench  # provenance columns
    problem = [f"--dtype={args.dtype}", f"--head-dim={args.head_dim}", f"--seq={args.seq}", f"--batch={args.batch}",
               f"--heads={args.heads}"] + ["--causal"] * args.causal + ["--forward"] * args.forward
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    gpu = gpu.decode() if isinstance(gpu, bytes) else str(gpu)
    prov = bench.provenance(cupy, torch, gpu)
    rows = []
    kernels = KERNELS_FP32_FORWARD if args.forward else KERNELS_FP32 if args.dtype == "fp32" else KERNELS
    for impl in kernels:
        row = profile(ncu, impl, problem, kernels)
        row.update(direction="fwd" if args.forward else "bwd", dtype=args.dtype, head_dim=args.head_dim,
                   seq_len=args.seq, batch=args.batch, heads=args.heads,
                   causal=args.causal, ncu=version, **prov)
        rows.append(row)
    ours, torch_row = rows
    for col in METRICS:
        print(f"{col:20s} ours {ours[col]:>16,.2f}   torch {torch_row[col]:>16,.2f}   ours/torch "
              f"{ours[col] / torch_row[col] if torch_row[col] else float('nan'):.3f}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
