"""Launching `mpirun` from Python (run_all.py, gpu_check.py, the ring's tests and notebook).

    cmd = mpirun_command(4) + [sys.executable, "stages/04_ring/run.py"]
    subprocess.run(cmd, env=mpi_env())

The mpirun next to this interpreter comes first (the venv's `pip install mpich`), then PATH. The
Python passed to it is the full path of this interpreter: a bare `python3` under a system mpirun
can pick another Python without numpy. Open MPI refuses more ranks than cores unless told
`--oversubscribe` (MPICH oversubscribes by default), and refuses root unless two variables are set.
"""
import os
import pathlib
import shutil
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the folder that holds stages/


def find_mpirun():
    """Path of mpirun (or mpiexec): next to sys.executable first, then PATH; None when there is none."""
    for name in ("mpirun", "mpiexec"):
        here = pathlib.Path(sys.executable).parent / name
        if here.exists():
            return str(here)
    return shutil.which("mpirun") or shutil.which("mpiexec")


def is_open_mpi(exe):
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    return "Open MPI" in text or "OpenRTE" in text


def mpirun_command(n):
    """[mpirun, (--oversubscribe,) -n, n]: append the program. Raises RuntimeError when there is no mpirun."""
    exe = find_mpirun()
    if exe is None:
        raise RuntimeError("mpirun not found: install an MPI runtime (pip install mpich) or use scripts/tutorial.sh, "
                           "which sets one up in .venv")
    return [exe] + (["--oversubscribe"] if is_open_mpi(exe) else []) + ["-n", str(n)]


def mpi_env(**extra):
    """os.environ plus unbuffered output, one OpenMP thread per rank, Open MPI's run-as-root consent, and this
    checkout first on PYTHONPATH: every rank imports the same `stages` as the process that launched it, whether or
    not the package is installed (`pip install -e .`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    others = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + others)
    env.update(extra)
    return env
