"""Every script that imports `stages` (the stages' runners, scripts/, dev/) runs from a checkout that was never
installed (`pip install -e .` is what the quick start does, but a GPU server may allow no install): each puts its
checkout first on sys.path before it imports `stages`.

Each script runs in a fresh interpreter that sees the installed packages (numpy, mpi4py, ...) but not this
repository: the test's own sys.path without the checkout, no .pth file run (an editable install hooks the checkout in
through one), and the working directory elsewhere; it must get as far as parsing its arguments. That run is
tests/test_docs_commands.py's (one interpreter per script also checks the options its documentation shows). A control
in the same interpreter shows that `import stages` fails there, so a script that passes found `stages` by itself.
"""
import json
import os
import pathlib
import subprocess
import sys

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


def _without_stages():
    """The test's sys.path less every folder from which `stages` imports (the checkout, by PYTHONPATH or an
    install's path entry)."""
    return [p for p in sys.path if p and not (pathlib.Path(p) / "stages" / "__init__.py").exists()]


def _python(code, *args, cwd, timeout=90):
    """Run code in the child interpreter (Open MPI's run-as-root consent set, as mpi_env sets it for the ranks:
    a script that imports mpi4py initialises MPI)."""
    cmd = [sys.executable, "-I", "-S", "-c", code, json.dumps(_without_stages()), *args]
    return subprocess.run(cmd, cwd=cwd, env=mpi_env(), capture_output=True, text=True, timeout=timeout)


def test_the_control_cannot_import_stages(tmp_path):
    out = _python(CONTROL, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "no stages", out.stdout + out.stderr


def test_the_list_holds_the_runners():
    assert {f"stages/{n}/run.py" for n in ("00_naive", "04_ring", "05_train_gpt", "06_hopper")} <= set(SCRIPTS)
    assert {"scripts/run_all.py", "scripts/gpu_check.py", "dev/bench.py"} <= set(SCRIPTS)



# ---------------------------------------------------------------- scripts/run_all.py (the tutorial)
def _run_all():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all", ROOT / "scripts" / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tutorial_shows_each_line_of_a_stage_as_it_comes(monkeypatch):
    """run_all.run_streaming prints a stage's lines while the stage runs: the first line of a child that then waits
    half a second is printed before the child prints its second."""
    import time

    run_all = _run_all()
    printed = []
    monkeypatch.setattr(run_all, "print", lambda *a, **k: printed.append((time.monotonic(), "".join(map(str, a)))),
                        raising=False)
    child = "import time; print('first', flush=True); time.sleep(0.5); print('SUMMARY x PASS done')"
    out, rc = run_all.run_streaming([sys.executable, "-c", child], mpi_env(), timeout=60)
    assert rc == 0 and out == "first\nSUMMARY x PASS done\n"
    (t1, first), (t2, second) = printed
    assert (first, second) == ("first\n", "SUMMARY x PASS done\n") and t2 - t1 >= 0.4
    assert run_all.stage_result(out, rc) == ("PASS", "done")


def test_the_tutorial_fails_a_stage_that_is_absent_or_silent(monkeypatch, tmp_path, capsys):
    """An absent stage (no run.py), a stage with no SUMMARY line and one that exits non-zero after a PASS are
    failures, and the tutorial's exit code says so."""
    run_all = _run_all()
    assert run_all.stage_result("no summary\n", 0)[0] == "FAIL"
    assert run_all.stage_result("SUMMARY x PASS ok\n", 1) == ("FAIL", "exit code 1: ok")
    monkeypatch.setattr(run_all, "STAGES", [("99_absent", None)])
    assert run_all.main([]) == 1
    out = capsys.readouterr().out
    assert "99_absent" in out and "FAIL" in out and "no stages/99_absent/run.py" in out and "1 stage(s) FAILED" in out


# ---------------------------------------------------------------- scripts/lab.sh
def _fake_venv(tmp_path, programs):
    """A folder that setup_env.sh takes for a ready .venv (its requirements stamp matches) with fake programs in bin/:
    {name: shell body}."""
    import hashlib

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".requirements.sha").write_text(hashlib.sha256((ROOT / "requirements.txt").read_bytes()).hexdigest())
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    for name, body in programs.items():
        (venv / "bin" / name).write_text("#!/bin/sh\n" + body + "\n")
        (venv / "bin" / name).chmod(0o755)
    return venv


def test_lab_allows_root_only_as_root(tmp_path):
    """JupyterLab refuses to start as root without --allow-root: lab.sh adds it when the user id is 0, not otherwise
    (a fake jupyter prints what it is given)."""
    venv = _fake_venv(tmp_path, {"python": "exit 0", "jupyter": 'echo "jupyter $*"'})
    out = subprocess.run([str(ROOT / "scripts/lab.sh"), "--port", "8890"], env={"PATH": "/usr/bin:/bin",
                         "ATTN_VENV": str(venv), "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert args[:3] == ["jupyter", "lab", "notebooks/"] and args[-2:] == ["--port", "8890"]
    assert ("--allow-root" in args) == (os.getuid() == 0)


# ---------------------------------------------------------------- scripts/mpirun
def test_scripts_mpirun_starts_open_mpi_as_open_mpi_wants(tmp_path):
    """Where mpi4py loads Open MPI (a GPU image's MPI): scripts/mpirun picks Open MPI's mpirun over an MPICH one
    found first, adds --oversubscribe and, as root, Open MPI's consent variables, and turns a bare `python` into the
    interpreter's full path. A fake python3 (its mpi4py reports Open MPI) and two fake mpiruns print what they get;
    the real MPICH path runs in tests/test_docs_commands.py."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "python3": f'case "$*" in *Get_library_version*) echo "Open MPI v4.1.5, package: Open MPI";; '
                   f'*sys.executable*) echo "{bin_dir}/python3";; esac; exit 0',
        "mpirun": 'if [ "$1" = --version ]; then echo "mpirun (Open MPI) 4.1.5"; exit 0; fi; '
                  'echo "openmpi $* root=${OMPI_ALLOW_RUN_AS_ROOT:-} threads=$OMP_NUM_THREADS"',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    hydra = tmp_path / "mpich"
    hydra.mkdir()
    (hydra / "mpirun").write_text('#!/bin/sh\n[ "$1" = --version ] && echo "HYDRA build details:"; echo mpich\n')
    (hydra / "mpirun").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{hydra}:/usr/bin:/bin", "ATTN_VENV": str(tmp_path / "no_venv"), "HOME": str(tmp_path)}
    out = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "4", "python", "stages/04_ring/run.py", "--quick"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    root = "1" if os.getuid() == 0 else ""
    assert out.stdout.split() == ["openmpi", "--oversubscribe", "-n", "4", f"{bin_dir}/python3",
                                  "stages/04_ring/run.py", "--quick", f"root={root}", "threads=1"]
    assert f"{bin_dir}/mpirun" in out.stderr


def test_scripts_mpirun_says_what_is_missing(tmp_path):
    """mpi4py loads MPICH and the only mpirun is Open MPI's: one message naming both, exit 2."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\ncase "$*" in *Get_library_version*) echo "MPICH Version: 4.2";; '
                                     f'*sys.executable*) echo "{bin_dir}/python3";; esac\nexit 0\n')
    (bin_dir / "mpirun").write_text('#!/bin/sh\necho "mpirun (Open MPI) 4.1.5"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = subprocess.run([str(ROOT / "scripts/mpirun"), "-n", "2", "python", "x.py"], cwd=tmp_path,
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", "ATTN_VENV": str(tmp_path / "none")},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "mpi4py loads MPICH" in out.stderr and "(openmpi)" in out.stderr, out.stderr
