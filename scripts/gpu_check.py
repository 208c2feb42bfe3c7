"""One command for a machine that already has a GPU and the packages (nothing is installed):

    python3 scripts/gpu_check.py [--bench-args "..."] [--out DIR]

It runs every `gpu` test, every stage's run.py on the GPU (default sizes), the ring as 4 ranks on
this GPU through the mpi backend, and a short benchmark, then prints one summary. Logs go to --out.
"""
import argparse
import os
import pathlib
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from stages.common.launch import mpi_env, mpirun_command  # noqa: E402


def run(name, cmd, out_dir, env, timeout):
    print(f"\n######## {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout)
        out, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "") + "\nTIMEOUT", -1
    (out_dir / f"{name}.log").write_text(out)
    tail = "\n".join(out.splitlines()[-25:])
    print(tail, flush=True)
    last = [ln for ln in out.splitlines() if ln.strip()][-1:] or [""]
    return name, rc, time.time() - t0, last[0][:90]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="folder for the logs")
    ap.add_argument("--bench-args", default="--quick", help="arguments for scripts/bench.py")
    ap.add_argument("--skip", nargs="*", default=[], help="steps to skip: tests, stages, ring, bench")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per step")
    args = ap.parse_args(argv)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = mpi_env()
    py = sys.executable
    steps = []
    if "tests" not in args.skip:
        steps.append(("gpu_tests", [py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]))
    if "stages" not in args.skip:
        for folder in ("00_naive", "01_flash_v1", "02_flash_v2", "03_flash_v2_backward"):
            if (ROOT / "stages" / folder / "run.py").exists():
                steps.append((f"run_{folder}", [py, f"stages/{folder}/run.py"]))
    if "ring" not in args.skip and (ROOT / "stages/04_ring/run.py").exists():
        steps.append(("ring_mpi_4ranks_1gpu", mpirun_command(4) + [py, "stages/04_ring/run.py", "--backend", "mpi"]))
    if "bench" not in args.skip and (ROOT / "scripts/bench.py").exists():
        steps.append(("bench", [py, "scripts/bench.py", "--out", str(out_dir)] + shlex.split(args.bench_args)))
    results = [run(name, cmd, out_dir, env, args.timeout) for name, cmd in steps]
    print("\n================ GPU check summary ================")
    for name, rc, secs, last in results:
        print(f"{name:<28} {'PASS' if rc == 0 else 'FAIL':<5} {secs:>7.1f}s  {last}")
    failed = [r for r in results if r[1] != 0]
    print("ALL GPU CHECKS PASS" if not failed else f"{len(failed)} GPU check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
