"""The notebooks' optional set-up cell (scripts/notebook_setup.py): every notebook opens with it, word for word,
and the cell does the right thing offline, on the CPU, in seconds: inside the repository nothing; outside it a
clone (here of this repository, through a local bare copy as REPO_URL), the right pip installs, and `import stages`
from the clone; with no REPO_URL a message and nothing else.

The cell runs in a subprocess, as a notebook kernel would run it. Its `git` and `pip` are recording stand-ins: a
`git` script alone on PATH logs its arguments and runs the real git; a package `pip` first on PYTHONPATH (found by
`python -m pip`) logs its arguments and installs nothing. `python -S` leaves out the site-packages, so the cell
sees a machine where nothing is installed, as on a fresh notebook service.
"""
import ast
import copy
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("notebook_setup", ROOT / "scripts" / "notebook_setup.py")
setup = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(setup)

NOTEBOOKS = setup.notebook_paths()
GIT = shutil.which("git")
CPU_PACKAGES = ["numpy>=1.26", "ml_dtypes>=0.4", "matplotlib", "mpi4py>=4.0", "mpich"]
GPU_PACKAGES = ["cupy-cuda12x>=14.0", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"]
# what the cell's last lines report: where it left the kernel and which `stages` it imports
REPORT = "\nimport os, stages\nprint('REPORT', os.getcwd(), stages.__file__)"
needs_git = pytest.mark.skipif(GIT is None, reason="git is not installed")


@pytest.fixture
def shims(tmp_path):
    """A folder with the stand-ins: bin/git (logs, then runs the real git) and py/pip (logs, installs nothing).
    Returns (env for the cell, folder of the stand-ins, function that reads the git and pip logs)."""
    bin_dir, py_dir = tmp_path / "shims" / "bin", tmp_path / "shims" / "py" / "pip"
    bin_dir.mkdir(parents=True)
    py_dir.mkdir(parents=True)
    git_log, pip_log = tmp_path / "shims" / "git.log", tmp_path / "shims" / "pip.log"
    (bin_dir / "git").write_text(f'#!/bin/sh\necho "$*" >> "{git_log}"\nexec "{GIT}" "$@"\n')
    (bin_dir / "git").chmod(0o755)
    (py_dir / "__init__.py").write_text("")
    (py_dir / "__main__.py").write_text(
        f"import json, sys\nwith open({str(pip_log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=str(bin_dir), PYTHONPATH=str(py_dir.parent), HOME=str(tmp_path))

    def logs():
        git = git_log.read_text().splitlines() if git_log.exists() else []
        pip = [json.loads(line) for line in pip_log.read_text().splitlines()] if pip_log.exists() else []
        return git, pip
    return env, bin_dir, logs


def run_cell(cwd, env, url="", bare_python=True, report=True):
    """Run the set-up cell (REPO_URL = url) in cwd; bare_python: `python -S`, no site-packages. Returns
    (stdout lines without the report, the REPORT fields or None)."""
    code = setup.cell_source(url) + (REPORT if report else "")
    cmd = [sys.executable] + (["-S"] if bare_python else []) + ["-c", code]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the set-up cell failed:\n{out.stdout}\n{out.stderr}"
    lines = out.stdout.splitlines()
    report_line = [ln.split()[1:] for ln in lines if ln.startswith("REPORT ")]
    return [ln for ln in lines if not ln.startswith("REPORT ")], (report_line[0] if report_line else None)


def has_nvidia_driver():
    return os.path.exists("/proc/driver/nvidia")  # the cell's other sign of a GPU; a test cannot hide it


# ---------------------------------------------------------------- the cells in the notebooks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_opens_with_the_setup_cells(path):
    nb = nbformat.read(path, as_version=4)
    found = setup.problems(nb)
    assert not found, f"{path.name}: {'; '.join(found)}; run: python scripts/notebook_setup.py --write"
    cell = next(c for c in nb.cells if c.cell_type == "code")
    printed = "".join(o.get("text", "") for o in cell.outputs)
    assert printed.startswith("Set-up: this notebook runs inside the repository"), (path.name, printed)


def test_drift_check_catches_a_changed_cell():
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    assert setup.problems(nb) == []
    changed = copy.deepcopy(nb)
    cell = next(c for c in changed.cells if c.get("id") == setup.CODE_ID)
    cell.source = cell.source.replace("--depth", "--depth=2 --depth", 1)
    assert setup.problems(changed) == ["the set-up cell's code differs from scripts/notebook_setup.py"]
    moved = copy.deepcopy(nb)
    moved.cells.insert(0, nbformat.v4.new_code_cell("x = 1"))
    assert setup.problems(moved) == ["the first code cell is not the set-up cell"]


def test_put_setup_cells_is_idempotent_and_keeps_the_count_order():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# title"), nbformat.v4.new_code_cell("a = 1", execution_count=1),
                nbformat.v4.new_code_cell("b = 2", execution_count=2)]
    once = setup.put_setup_cells(copy.deepcopy(nb), "printed\n")
    twice = setup.put_setup_cells(copy.deepcopy(once), "printed\n")
    for done in (once, twice):
        assert setup.problems(done) == []
        assert [c.get("execution_count") for c in done.cells if c.cell_type == "code"] == [1, 2, 3]
        assert [c.source for c in done.cells][0] == "# title"
    assert [c.source for c in once.cells] == [c.source for c in twice.cells]


def test_cell_installs_what_requirements_txt_names():
    """The cell's package lists (its `want = ...` lines) are those of requirements.txt, version floors included."""
    specs = []
    for node in ast.walk(ast.parse(setup.cell_source())):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "want" for t in targets):
            specs += [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    assert specs == CPU_PACKAGES + GPU_PACKAGES
    lines = {line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()}
    assert not [spec for spec in specs if spec not in lines], "the cell names a package requirements.txt does not"


# ---------------------------------------------------------------- the cell, run


def test_inside_the_repository_it_does_nothing(shims):
    env, _, logs = shims
    for bare in (False, True):  # with the packages installed, and with none (then it puts the root on sys.path)
        lines, (cwd, stages_file) = run_cell(ROOT / "notebooks", env, url="unused: inside there is no clone",
                                             bare_python=bare)
        assert lines == ["Set-up: this notebook runs inside the repository; nothing to do."]
        assert pathlib.Path(cwd) == ROOT / "notebooks"
        assert pathlib.Path(stages_file).resolve().is_relative_to(ROOT)
    assert logs() == ([], []), "inside the repository the cell must run neither git nor pip"


@needs_git
@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "nvidia-smi"])  # an id "gpu" would mark a gpu test
def test_outside_it_clones_installs_and_moves_into_the_clone(tmp_path, shims, gpu):
    if not gpu and has_nvidia_driver():
        pytest.skip("this machine has an NVIDIA driver (/proc/driver/nvidia): the cell sees a GPU")
    env, bin_dir, logs = shims
    if gpu:  # a stand-in nvidia-smi on PATH: the cell's sign of a GPU
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    bare = tmp_path / "naive-to-ring-attention.git"  # the published repository, offline: a bare copy of this one
    subprocess.run([GIT, "clone", "--bare", "--quiet", str(ROOT), str(bare)], check=True, timeout=60)
    work = tmp_path.resolve() / "content"  # the service's empty working folder
    work.mkdir()
    clone = work / "naive-to-ring-attention"

    lines, (cwd, stages_file) = run_cell(work, env, url=str(bare))
    git, pip = logs()
    assert git == [f"clone --depth 1 {bare} {clone}"]
    expected = CPU_PACKAGES + (GPU_PACKAGES if gpu else []) + ["-e", str(clone)]
    assert pip == [["install", "--quiet", *expected]]
    assert pathlib.Path(cwd) == clone / "notebooks"
    assert pathlib.Path(stages_file).resolve() == clone / "stages" / "__init__.py"
    assert lines[-1].startswith(f"Set-up: {clone} is ready ({'GPU' if gpu else 'CPU only'})"), lines

    # the kernel restarts: the working folder is the service's again, the clone is found, nothing is cloned twice
    lines, (cwd, stages_file) = run_cell(work, env, url=str(bare))
    assert logs()[0] == git, "a second run must not clone again"
    assert pathlib.Path(cwd) == clone / "notebooks"
    assert pathlib.Path(stages_file).resolve() == clone / "stages" / "__init__.py"


def test_it_skips_pip_when_everything_is_installed(tmp_path, shims):
    """Run with this environment's packages (no -S), next to an uploaded copy of the repository: what is installed
    is not installed again, and nothing is cloned."""
    env, _, logs = shims
    wanted = CPU_PACKAGES + (GPU_PACKAGES if has_nvidia_driver() else []) + ["naive-to-ring-attention"]
    missing = [name for name in (spec.split(">=")[0] for spec in wanted) if not installed(name)]
    if missing:
        pytest.skip(f"this environment lacks {missing}: pip would run")
    work = tmp_path.resolve() / "content"
    upload = work / "naive-to-ring-attention"  # the parts of the repository the cell looks at
    shutil.copytree(ROOT / "stages", upload / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", upload)
    (upload / "notebooks").mkdir()
    lines, (cwd, stages_file) = run_cell(work, env, bare_python=False)
    assert logs() == ([], []), "everything is installed: neither git nor pip may run"
    assert lines[-1].endswith("pip installed: nothing, all there"), lines
    assert pathlib.Path(cwd) == upload / "notebooks"
    assert pathlib.Path(stages_file).resolve() == upload / "stages" / "__init__.py"


def installed(name):
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_without_repo_url_it_says_what_to_do(tmp_path, shims):
    env, _, logs = shims
    work = tmp_path.resolve() / "content"
    work.mkdir()
    lines, _ = run_cell(work, env, url="", report=False)
    assert len(lines) == 1 and "Set REPO_URL" in lines[0] and str(work) in lines[0], lines
    assert logs() == ([], [])
    assert list(work.iterdir()) == [], "with no REPO_URL nothing is written"


# ---------------------------------------------------------------- the links


def test_github_repo_reads_both_url_forms():
    for url in ("https://github.com/OWNER/REPO", "https://github.com/OWNER/REPO.git", "git@github.com:OWNER/REPO.git",
                "https://github.com/OWNER/REPO/"):
        assert setup.github_repo(url) == "OWNER/REPO", url
    assert setup.github_repo("https://example.org/OWNER/REPO.git") is None


def test_links_come_from_repo_url(monkeypatch, capsys):
    monkeypatch.setattr(setup, "REPO_URL", "https://github.com/OWNER/REPO.git")
    assert setup.links() == 0
    out = capsys.readouterr().out
    for path in NOTEBOOKS:
        assert f"https://colab.research.google.com/github/OWNER/REPO/blob/{setup.BRANCH}/notebooks/{path.name}" in out
        assert (f"https://kaggle.com/kernels/welcome?src=https://github.com/OWNER/REPO/blob/{setup.BRANCH}/"
                f"notebooks/{path.name}") in out
