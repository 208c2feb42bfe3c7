"""Run every stage of the tutorial in order and print one summary table.

Each stage's run.py checks itself against the stage before it and ends with a line
`SUMMARY <stage> <PASS|FAIL> <what it checked>`; this script collects those lines.

    python scripts/run_all.py            # quick sizes
    python scripts/run_all.py --full     # each run.py's default sizes
    python scripts/run_all.py --gpu-mpi  # the ring as 4 ranks on one GPU (mpi backend) when there is a GPU
"""
import argparse
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: `stages` imports with no install

from stages.common.mpirun import mpi_env, mpirun_command  # noqa: E402

# (stage folder, needs mpirun with this many ranks or None)
STAGES = [
    ("00_naive", None),
    ("01_flash_v1", None),
    ("02_flash_v2", None),
    ("03_flash_v2_backward", None),
    ("04_ring", 4),
    ("05_train_gpt", None),  # a short CPU training run (the tiny config: the loss must clearly fall)
    ("06_hopper", None),  # the CPU part: Hopper's layouts and schedules
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="default sizes instead of --quick")
    ap.add_argument("--only", nargs="+", default=None, help="stage folders to run (default: all that exist)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds allowed per stage")
    args = ap.parse_args(argv)
    env = mpi_env()
    rows = []
    for folder, ranks in STAGES:
        script = ROOT / "stages" / folder / "run.py"
        if args.only and folder not in args.only:
            continue
        if not script.exists():
            rows.append((folder, "ABSENT", 0.0, "stage not written yet"))
            continue
        try:
            launcher = mpirun_command(ranks) if ranks else []
        except RuntimeError as e:
            raise SystemExit(str(e))
        cmd = launcher + [sys.executable, str(script)]
        cmd += [] if args.full else ["--quick"]
        print(f"\n######## {' '.join(cmd[-3:] if not ranks else cmd)}", flush=True)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True, timeout=args.timeout)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or "") + (e.stderr or "") if isinstance(e.stdout, str) else "", -1
            out += f"\nTIMEOUT after {args.timeout} s"
        print(out, flush=True)
        summary = [ln for ln in out.splitlines() if ln.startswith("SUMMARY ")]
        status, what = ("FAIL", f"exit code {rc}, no SUMMARY line") if not summary else (
            summary[-1].split()[2], " ".join(summary[-1].split()[3:]))
        if rc != 0 and status == "PASS":
            status, what = "FAIL", f"exit code {rc}: {what}"
        rows.append((folder, status, time.time() - t0, what))
    print("\n================ tutorial summary ================")
    print(f"{'stage':<22} {'result':<7} {'time':>7}  checked")
    for folder, status, secs, what in rows:
        print(f"{folder:<22} {status:<7} {secs:>6.1f}s  {what}")
    failed = [r for r in rows if r[1] not in ("PASS", "ABSENT")]
    print("ALL STAGES PASS" if not failed else f"{len(failed)} stage(s) FAILED")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
