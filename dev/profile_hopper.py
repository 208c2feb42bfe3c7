"""What the profiler shows at each version of stage 06's forward (the wgmma, ws and pingpong kernels) or, with
--backward, of its backward (the wgmma and ws main kernels): Nsight Compute counters on one problem, one CSV row per
version; with --fp8, of version fp8's attention kernel beside version pingpong's (the same main loop in 16 bits).

    python3 dev/profile_hopper.py --out results/profile_hopper_h100.csv
    python3 dev/profile_hopper.py --backward --out results/profile_hopper_bwd_h100.csv
    python3 dev/profile_hopper.py --fp8 --seq 8192 --batch 2 --out results/profile_hopper_fp8_h200.csv
    python3 dev/profile_hopper.py --head-dim 64 --seq 8192 --batch 2 --causal

Needs an sm_90 GPU, CuPy, cuda-bindings and Nsight Compute's `ncu` with permission to read the performance counters.
The script runs itself under ncu once per version: the child makes the inputs and calls the forward (or the
backward) twice; ncu measures the second launch of the version's kernel. ncu runs one kernel at a time at fixed
clocks: its durations compare the versions with each other; dev/bench_hopper.py and dev/bench.py give the speeds.

Columns, per version: duration_ms, warp_instructions, sm_busy_pct (sm__throughput, % of peak), tensor_pct (the
tensor pipe's active cycles, % of peak while the SM is active; "" where this ncu does not report it), smem_wavefronts
(the passes shared memory made for every kind of request: loads, stores, wgmma's operand reads, the copy engine's
writes), smem_bank_conflicts (the extra passes bank conflicts cost among them), and, per warp,
the average cycles stalled for each reason (stall_<reason>: barrier = bar.sync, the named barriers and
__syncthreads; long_scoreboard = waits on global or shared-memory loads; wait = fixed-latency waits, which include
wgmma.wait_group; math_pipe_throttle = a math pipe busy; sleeping = mbarrier try_wait suspended), then the run's
provenance.
"""
import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))

STALLS = ("barrier", "long_scoreboard", "wait", "math_pipe_throttle", "sleeping", "mio_throttle")
METRICS = {  # CSV column -> ncu metric
    "duration_ms": "gpu__time_duration.sum",
    "warp_instructions": "smsp__inst_executed.sum",
    "sm_busy_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    # wgmma's HGMMA instructions run on the tensor pipe's hmma unit: its share of the active cycles
    "tensor_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    **{f"{pipe}_pct": f"sm__inst_executed_pipe_{pipe}.avg.pct_of_peak_sustained_active"
       for pipe in ("xu", "alu", "fma")},
    "smem_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",  # passes of shared memory, all requests
    "smem_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",  # the extra passes conflicts cost
    **{f"stall_{s}": f"smsp__average_warp_latency_issue_stalled_{s}.ratio" for s in STALLS},
}


def child(args):
    """Under ncu: the version's forward (or backward), twice. Version fp8's pre-pass launches other kernels; its
    attention kernel is flash_v3_forward_fp8."""
    import cupy

    from stages.common import bfloat16, make_inputs
    from stages.hopper import flash_v3, flash_v3_backward

    q, k, v, do = make_inputs(args.batch, args.heads, args.seq, args.seq, args.head_dim, dtype=bfloat16, xp=cupy,
                              grad=True)
    if args.backward:
        o, lse = flash_v3.forward(q, k, v, causal=args.causal)
    for _ in range(2):
        if args.backward:
            flash_v3_backward.backward(q, k, v, o, lse, do, causal=args.causal, version=args.child)
        else:
            flash_v3.forward(q, k, v, causal=args.causal, version=args.child)
    cupy.cuda.runtime.deviceSynchronize()


def _value(text):
    text = text.replace(",", "").strip()
    try:
        return float(text)
    except ValueError:  # n/a: this ncu or GPU does not have the metric
        return None


def profile(ncu, kernel, version, argv):
    """{column: value} of the version's kernel (flash_v3_forward or flash_v3_backward), second launch, from ncu's CSV
    output."""
    kernel = f"{kernel}_{version}"
    cmd = [ncu, "--csv", "--metrics", ",".join(METRICS.values()), "-k", f"regex:{kernel}",
           "-s", "1", "-c", "1", sys.executable, os.path.abspath(__file__), "--child", version] + argv
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith('"')]
    if not lines:
        raise SystemExit(f"ncu found no {kernel} kernel for version {version} (exit {run.returncode}):\n"
                         f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
    got = {r["Metric Name"]: r for r in csv.DictReader(io.StringIO("\n".join(lines)))}
    row = {}
    for col, metric in METRICS.items():
        r = got.get(metric)
        x = _value(r["Metric Value"]) if r else None
        if x is not None and col == "duration_ms":  # ncu picks the unit
            x *= {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "nsecond": 1e-6, "ms": 1.0, "msecond": 1.0}[
                r["Metric Unit"]]
        row[col] = "" if x is None else f"{x:.4g}"
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="CSV path (default: print only)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--backward", action="store_true", help="the backward's versions instead of the forward's")
    ap.add_argument("--fp8", action="store_true", help="version fp8's kernel beside version pingpong's (forward)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.fp8 and args.backward:
        raise SystemExit("--fp8 profiles the forward: version fp8 has no backward")
    if args.fp8 and args.head_dim != 128:
        raise SystemExit(f"--fp8: version fp8 takes head dim 128, not {args.head_dim}")
    if args.child:
        return child(args)
    import bench  # provenance
    import cupy

    from stages.hopper import flash_v3, flash_v3_backward

    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu) and not shutil.which(ncu):
        raise SystemExit("profile_hopper.py needs Nsight Compute's ncu (on PATH or /usr/local/cuda/bin)")
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    prov = bench.provenance(cupy, None, gpu)
    ncu_version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    problem = ["--head-dim", str(args.head_dim), "--seq", str(args.seq), "--batch", str(args.batch),
               "--heads", str(args.heads)] + (["--causal"] if args.causal else [])
    kernel, versions = "flash_v3_forward", flash_v3.VERSIONS
    if args.fp8:  # flash_v3_forward_pingpong, then flash_v3_forward_fp8 (the same main loop; the pre-pass differs)
        kernel, versions = "flash_v3_forward", ("pingpong", flash_v3.FP8)
    if args.backward:
        kernel, versions = "flash_v3_backward", flash_v3_backward.VERSIONS
        problem.append("--backward")
    rows = []
    for version in versions:
        row = dict(version=version, dtype="bf16", head_dim=args.head_dim, seq_len=args.seq, batch=args.batch,
                   heads=args.heads, causal=args.causal, **profile(ncu, kernel, version, problem), ncu=ncu_version,
                   **prov)
        rows.append(row)
        print(", ".join(f"{k}={row[k]}" for k in ["version", *METRICS]), flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
