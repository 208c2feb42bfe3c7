"""One command for a machine that already has a GPU and the packages (nothing is installed):

    python3 scripts/gpu_check.py [--bench-args "..."] [--out DIR]

It runs every `gpu` test (one pytest process per test file, in parallel), every stage's run.py on
the GPU (default sizes), the ring as 4 ranks on this GPU through the mpi backend, stage 05's GPU runs
(training against PyTorch, long context, the ring training), and a short benchmark, then prints one
summary. Logs go to --out. With no GPU it stops at once: skipped GPU tests are not a pass.
"""
import argparse
import os
import pathlib
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: `stages` imports with no install

from stages.common.mpirun import mpi_env, mpirun_command  # noqa: E402


def run(name, cmd, out_dir, env, timeout):
    return run_parallel([(name, cmd)], out_dir, env, timeout)[0]


def run_parallel(steps, out_dir, env, timeout):
    """Run the steps at once (each its own process, output to out_dir/NAME.log); wait; print each tail.
    Returns [(name, rc, seconds, last line)]."""
    t0 = time.time()
    procs = []
    for name, cmd in steps:
        print(f"\n######## {name}: {' '.join(cmd)}", flush=True)
        log = open(out_dir / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=log,
                                             stderr=subprocess.STDOUT), log))
    results = []
    for name, proc, log in procs:
        try:
            rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            log.write("\nTIMEOUT\n")
            rc = -1 if rc == 0 else rc
        log.close()
        out = (out_dir / f"{name}.log").read_text()
        print(f"\n######## {name} (rc {rc}):\n" + "\n".join(out.splitlines()[-25:]), flush=True)
        last = [ln for ln in out.splitlines() if ln.strip()][-1:] or [""]
        results.append((name, rc, time.time() - t0, last[0][:90]))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"), help="folder for the logs")
    ap.add_argument("--bench-args", default="--quick", help="arguments for dev/bench.py")
    ap.add_argument("--skip", nargs="*", default=[], help="steps to skip: tests, stages, ring, train_gpt, bench")
    ap.add_argument("--timeout", type=int, default=900, help="seconds allowed per step")
    ap.add_argument("--jobs", type=int, default=8,
                    help="test files run at once, one pytest process each (NVRTC compiles are CPU-bound)")
    args = ap.parse_args(argv)
    from stages.common import gpu_name, has_gpu

    if not has_gpu():
        print("gpu_check: no CUDA GPU is visible (CuPy sees none); every step here needs one. "
              "On a CPU-only machine use scripts/test.sh and scripts/tutorial.sh.")
        return 2
    print(f"gpu_check on {gpu_name()}", flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = mpi_env()
    py = sys.executable
    steps, results = [], []
    if "tests" not in args.skip:  # the test files in --jobs parallel pytest processes, before anything is timed
        files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                       if "mark.gpu" in f.read_text())
        tests = [(f"gpu_tests_{pathlib.Path(f).stem}", [py, "-m", "pytest", "-q", "-m", "gpu", "-rs",
                                                         "-p", "no:cacheprovider", f]) for f in files]
        for i in range(0, len(tests), max(1, args.jobs)):
            results += run_parallel(tests[i:i + max(1, args.jobs)], out_dir, env, args.timeout)
    if "stages" not in args.skip:
        for folder in ("00_naive", "01_flash_v1", "02_flash_v2", "03_flash_v2_backward"):
            if (ROOT / "stages" / folder / "run.py").exists():
                steps.append((f"run_{folder}", [py, f"stages/{folder}/run.py"]))
    if "ring" not in args.skip and (ROOT / "stages/04_ring/run.py").exists():
        steps.append(("ring_mpi_4ranks_1gpu", mpirun_command(4) + [py, "stages/04_ring/run.py", "--backend", "mpi"]))
    if "train_gpt" not in args.skip and (ROOT / "dev/train_gpt_gpu_runs.py").exists():
        steps.append(("train_gpt_gpu_runs", [py, "dev/train_gpt_gpu_runs.py"]))  # writes results/train_gpt_*
    if "bench" not in args.skip and (ROOT / "dev/bench.py").exists():
        steps.append(("bench", [py, "dev/bench.py", "--out", str(out_dir)] + shlex.split(args.bench_args)))
    results += [run(name, cmd, out_dir, env, args.timeout) for name, cmd in steps]
    print("\n================ GPU check summary ================")
    results = [(n, rc if rc != 0 or " passed" in last or not n.startswith("gpu_tests") else 5, t, last)
               for n, rc, t, last in results]  # a test file whose GPU tests all skipped is not a pass
    for name, rc, secs, last in results:
        print(f"{name:<40} {'PASS' if rc == 0 else 'FAIL':<5} {secs:>7.1f}s  {last}")
    failed = [r for r in results if r[1] != 0]
    print("ALL GPU CHECKS PASS" if not failed else f"{len(failed)} GPU check(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
