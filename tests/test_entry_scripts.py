"""Every script that imports `stages` (the stages' runners, scripts/, dev/) runs from a checkout that was never
installed (`pip install -e .` is what the quick start does, but a GPU server may allow no install): each puts its
checkout first on sys.path before it imports `stages`.

Each script runs with --help in a fresh interpreter that sees the installed packages (numpy, mpi4py, ...) but not this
repository: site-packages go on sys.path without their .pth files, which is where an editable install hooks the
checkout in, and the working directory is elsewhere. A control in the same interpreter shows that `import stages`
fails there, so a script that passes found `stages` by itself.
"""
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in
                 [*ROOT.glob("stages/*/run.py"), ROOT / "stages/05_train_gpt/train.py", *ROOT.glob("scripts/*.py"),
                  *ROOT.glob("dev/*.py")]
                 if "__main__" in p.read_text() and "stages" in p.read_text())

# The interpreter's packages without the .pth files: no editable install, no PYTHONPATH (-I), cwd elsewhere.
UNINSTALLED = """
import site, sys
sys.path += [p for p in site.getsitepackages() if p not in sys.path]
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


def _python(code, *args, cwd):
    return subprocess.run([sys.executable, "-I", "-S", "-c", code, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


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
