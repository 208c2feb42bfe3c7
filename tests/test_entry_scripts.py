"""Every script that imports `stages` (the stages' runners, scripts/, dev/) runs from a checkout that was never
installed (`pip install -e .` is what the quick start does, but a GPU server may allow no install): each puts its
checkout first on sys.path before it imports `stages`.

Each script runs with --help in a fresh interpreter that sees the installed packages (numpy, mpi4py, ...) but not this
repository: the test's own sys.path without the checkout, no .pth file run (an editable install hooks the checkout in
through one), and the working directory elsewhere. A control in the same interpreter shows that `import stages`
fails there, so a script that passes found `stages` by itself.
"""
import json
import pathlib
import subprocess
import sys

import pytest

from stages.common.mpirun import mpi_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in
                 [*ROOT.glob("stages/*/run.py"), ROOT / "stages/05_train_gpt/train.py", *ROOT.glob("scripts/*.py"),
                  *ROOT.glob("dev/*.py")]
                 if "__main__" in p.read_text() and "stages" in p.read_text())

# The child interpreter: -I (no PYTHONPATH, no user site, no script directory), -S (no site: no .pth file runs, and an
# editable install hooks the checkout in through one), then the parent's sys.path less the checkout, so that it
# finds every installed package wherever this machine keeps them (site-packages, the user site, PYTHONPATH).
UNINSTALLED = """
import json, sys
sys.path += json.loads(sys.argv.pop(1))
"""
CONTROL = UNINSTALLED + """
try:
    import stages
except ModuleNotFoundError:
    print("no stages")
"""
RUN = UNINSTALLED + """
import os, runpy
script = sys.argv[1]
sys.argv = [script, "--help"]
sys.path.insert(0, os.path.dirname(script))  # as `python script` does
runpy.run_path(script, run_name="__main__")
"""


def _without_stages():
    """The test's sys.path less every folder from which `stages` imports (the checkout, by PYTHONPATH or an
    install's path entry)."""
    return [p for p in sys.path if p and not (pathlib.Path(p) / "stages" / "__init__.py").exists()]


def _python(code, *args, cwd):
    """Run code in the child interpreter (Open MPI's run-as-root consent set, as mpi_env sets it for the ranks:
    a script that imports mpi4py initialises MPI)."""
    cmd = [sys.executable, "-I", "-S", "-c", code, json.dumps(_without_stages()), *args]
    return subprocess.run(cmd, cwd=cwd, env=mpi_env(), capture_output=True, text=True, timeout=90)


def test_the_control_cannot_import_stages(tmp_path):
    out = _python(CONTROL, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "no stages", out.stdout + out.stderr


def test_the_list_holds_the_runners():
    assert {f"stages/{n}/run.py" for n in ("00_naive", "04_ring", "05_train_gpt", "06_hopper")} <= set(SCRIPTS)
    assert {"scripts/run_all.py", "scripts/gpu_check.py", "dev/bench.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_runs_without_an_install(script, tmp_path):
    out = _python(RUN, str(ROOT / script), cwd=tmp_path)
    assert out.returncode == 0, f"{script} --help from an uninstalled checkout:\n{out.stderr[-2000:]}"
    assert "usage" in out.stdout.lower(), out.stdout[-500:]
