"""Run every stage of the tutorial in order and print one summary table.

Each stage's run.py checks itself against the stage before it and ends with a line
`SUMMARY <stage> <PASS|FAIL> <what it checked>`; this script shows each stage's output as it runs and collects
those lines. A stage that fails, prints no SUMMARY line, or has no run.py fails the tutorial.

    python scripts/run_all.py            # quick sizes
    python scripts/run_all.py --full     # each run.py's default sizes
    python scripts/run_all.py --only 02_flash_v2 04_ring

On a machine with a GPU each run.py also runs its kernels there, and the ring's 4 ranks share the GPU through the
mpi backend (run.py's --backend auto picks it, and says so).
"""
import argparse
import pathlib
import subprocess
import sys
import threading
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


def run_streaming(cmd, env, timeout):
    """Run cmd, printing each line of its output (stdout and stderr together) as it comes; return (output, exit
    code). The child's Python writes unbuffered (mpi_env sets PYTHONUNBUFFERED), so a line shows when it is
    printed. After timeout seconds the process is killed and the output ends with a TIMEOUT line."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            bufsize=1)
    lines = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = -1
        lines.append(f"\nTIMEOUT after {timeout} s\n")
        print(lines[-1], flush=True)
    reader.join(timeout=10)
    return "".join(lines), rc


def stage_result(out, rc):
    """(PASS | FAIL, what was checked) from a stage's output and exit code: its last SUMMARY line, a FAIL when
    there is none or the exit code is not 0."""
    summary = [ln.split() for ln in out.splitlines() if ln.startswith("SUMMARY ")]
    if not summary:
        return "FAIL", f"exit code {rc}, no SUMMARY line"
    status, what = summary[-1][2], " ".join(summary[-1][3:])
    if rc != 0 and status == "PASS":
        return "FAIL", f"exit code {rc}: {what}"
    return status, what


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="default sizes instead of --quick")
    ap.add_argument("--only", nargs="+", default=None, choices=[folder for folder, _ in STAGES], metavar="STAGE",
                    help=f"stage folders to run (default: all): {', '.join(folder for folder, _ in STAGES)}")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds allowed per stage")
    args = ap.parse_args(argv)
    env = mpi_env()
    rows = []
    for folder, ranks in STAGES:
        if args.only and folder not in args.only:
            continue
        script = ROOT / "stages" / folder / "run.py"
        if not script.exists():
            print(f"\n######## {folder}: no {script.relative_to(ROOT)}", flush=True)
            rows.append((folder, "FAIL", 0.0, f"no {script.relative_to(ROOT)}"))
            continue
        try:
            launcher = mpirun_command(ranks) if ranks else []
        except RuntimeError as e:
            raise SystemExit(str(e))
        cmd = launcher + [sys.executable, str(script.relative_to(ROOT))] + ([] if args.full else ["--quick"])
        print(f"\n######## {' '.join(cmd if ranks else ['python'] + cmd[1:])}", flush=True)
        t0 = time.time()
        out, rc = run_streaming(cmd, env, args.timeout)
        status, what = stage_result(out, rc)
        rows.append((folder, status, time.time() - t0, what))
    print("\n================ tutorial summary ================")
    print(f"{'stage':<22} {'result':<7} {'time':>7}  checked")
    for folder, status, secs, what in rows:
        print(f"{folder:<22} {status:<7} {secs:>6.1f}s  {what}")
    failed = [r for r in rows if r[1] != "PASS"]
    print("ALL STAGES PASS" if not failed else f"{len(failed)} stage(s) FAILED")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
