#!/usr/bin/env python3
"""The optional set-up cell that opens every notebook, for a free notebook service (Google Colab, Kaggle).

    python scripts/notebook_setup.py --write    # put the set-up cells (a note, then the code) into every notebook
    python scripts/notebook_setup.py --check    # exit 1, naming the notebooks, when their set-up cells differ
    python scripts/notebook_setup.py --links    # the "open in Colab / Kaggle" link of every notebook

A learner who opens one notebook on a notebook service has the notebook alone: no repository, no `stages`,
maybe no CuPy. The cell below (CELL) clones the repository from REPO_URL, installs with pip what the notebooks
import and the machine lacks, and moves into the clone's notebooks/ folder. Inside a checkout (JupyterLab started
as notebooks/README.md says, or the notebooks executed by the tests) it changes nothing but, when needed, sys.path.
The cell is plain Python and holds all its logic: it must run before anything of the repository is there.

Its text lives here once; --write copies it into every notebook (before the notebook's first code cell, with the
output it prints inside the repository), and tests/test_notebook_setup.py checks that every notebook carries
exactly this text and runs the cell, offline, inside the repository, outside it with a local clone as REPO_URL,
and with no REPO_URL.

REPO_URL is the one place the repository's public address is written. It stays empty until the project is
published; then set it here and run --write. --links falls back to `git remote get-url origin` while it is empty.
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

REPO_URL = ""     # the repository's git URL, e.g. what GitHub's "Code" button shows; empty: not published yet
BRANCH = "main"   # the branch the "open in" links open

NOTE_ID, CODE_ID = "setup-note", "setup"  # cell ids: --write finds (and updates) its two cells by them

NOTE = """\
## Optional: set-up on a notebook service (Colab, Kaggle)

The next cell matters only when this notebook was opened alone on a free notebook service, where nothing of the
repository is installed. Inside the repository (JupyterLab started in a checkout, as `notebooks/README.md` says)
it does nothing but say so.

On a notebook service it:
1. finds the repository in the current folder, or clones it from `REPO_URL`. While `REPO_URL` is empty, set it to
   the repository's git URL, or upload the repository's folder into the current folder;
2. installs with pip what the notebooks import and the machine lacks: numpy, ml_dtypes, matplotlib, mpi4py with
   the MPI runtime mpich, and on a machine with an NVIDIA GPU also CuPy with NVRTC and the CUDA headers (the
   kernels compile at run time, no CUDA toolkit needed); then this repository as the package `stages`;
3. moves into the clone's `notebooks/` folder, where the cells below expect to run.

Run it again after the service restarts the kernel: it finds the clone and installs only what is missing. On
Kaggle, switch on the notebook's Internet setting first (pip and git need it)."""

CELL = r'''# Optional set-up for a notebook service (the note above). Inside the repository it only says so.
REPO_URL = ""  # the repository's git URL (scripts/notebook_setup.py writes it here)
import importlib.metadata, importlib.util, os, pathlib, re, shutil, subprocess, sys

def is_checkout(d):
    toml = d / "pyproject.toml"
    return (d / "stages").is_dir() and toml.is_file() and 'name = "naive-to-ring-attention"' in toml.read_text()

def installed(spec):  # "cupy-cuda12x>=14.0": that package is installed, at least at that version
    name, _, least = spec.partition(">=")
    try:
        have = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return [int(x) for x in re.findall(r"\d+", have)[:2]] >= [int(x) for x in re.findall(r"\d+", least)[:2]]

here = pathlib.Path.cwd().resolve()
root = next((d for d in (here, *here.parents) if is_checkout(d)), None)
if root:  # a checkout sets itself up (notebooks/README.md): install nothing here
    if importlib.util.find_spec("stages") is None:
        sys.path.insert(0, str(root))
    print("Set-up: this notebook runs inside the repository; nothing to do.")
else:  # a clone made before the kernel restarted, or an uploaded folder, or a fresh clone
    root = next((d for d in sorted(here.iterdir()) if d.is_dir() and is_checkout(d)), None)
    if root is None and REPO_URL:
        root = here / REPO_URL.rstrip("/").split("/")[-1].removesuffix(".git")
        subprocess.run(["git", "clone", "--depth", "1", REPO_URL, str(root)], check=True)
    if root is None:
        print("Set-up: the repository is not here. Set REPO_URL at the top of this cell to its git URL, or upload "
              f"the repository's folder into {here}; then run this cell again.")
    else:
        gpu = bool(shutil.which("nvidia-smi")) or os.path.exists("/proc/driver/nvidia")
        want = ["numpy>=1.26", "ml_dtypes>=0.4", "matplotlib", "mpi4py>=4.0", "mpich"]  # as in requirements.txt
        want += ["cupy-cuda12x>=14.0", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"] if gpu else []
        todo = [spec for spec in want if not installed(spec)]
        todo += [] if installed("naive-to-ring-attention") else ["-e", str(root)]  # `stages`, for scripts too
        if todo:
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *todo], check=True)
        os.chdir(root / "notebooks")  # the notebooks run in notebooks/ and find the repository from there
        sys.path.insert(0, str(root))
        print(f"Set-up: {root} is ready ({'GPU' if gpu else 'CPU only'}); "
              f"pip installed: {' '.join(todo) or 'nothing, all there'}")'''


def cell_source(url=REPO_URL):
    """The set-up cell's code with REPO_URL = url."""
    return CELL.replace('REPO_URL = ""', f"REPO_URL = {json.dumps(url)}", 1)


def inside_output():
    """What the cell prints inside the repository: run it in notebooks/, as the notebooks run."""
    out = subprocess.run([sys.executable, "-c", cell_source()], cwd=NOTEBOOKS, capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        raise SystemExit(f"the set-up cell failed inside the repository:\n{out.stdout}{out.stderr}")
    return out.stdout


def notebook_paths():
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def problems(nb):
    """What is wrong with a notebook's set-up cells: [] when its first code cell is CELL with the note above it."""
    first = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), None)
    if first is None or nb.cells[first].get("id") != CODE_ID:
        return ["the first code cell is not the set-up cell"]
    found = []
    if nb.cells[first].source != cell_source():
        found.append("the set-up cell's code differs from scripts/notebook_setup.py")
    if first == 0 or nb.cells[first - 1].get("id") != NOTE_ID or nb.cells[first - 1].source != NOTE:
        found.append("the note above the set-up cell is missing or differs")
    return found


def put_setup_cells(nb, output):
    """Put the note and the set-up cell before the notebook's first code cell (or where they are, replacing them).
    A new set-up cell counts as executed first when the notebook is executed: the other cells' counts move up one."""
    import nbformat

    old = [i for i, c in enumerate(nb.cells) if c.get("id") in (NOTE_ID, CODE_ID)]
    had_code = any(nb.cells[i].get("id") == CODE_ID for i in old)
    at = old[0] if old else next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    for i in reversed(old):
        del nb.cells[i]
    code = [c for c in nb.cells if c.cell_type == "code"]
    executed = bool(code) and code[0].get("execution_count") is not None
    if executed and not had_code:
        for c in code:
            if c.execution_count is not None:
                c.execution_count += 1
    note = nbformat.v4.new_markdown_cell(NOTE, id=NOTE_ID)
    cell = nbformat.v4.new_code_cell(cell_source(), id=CODE_ID, execution_count=1 if executed else None,
                                     outputs=[nbformat.v4.new_output("stream", name="stdout", text=output)]
                                     if executed else [])
    nb.cells[at:at] = [note, cell]
    nbformat.validate(nb)
    return nb


def write():
    import nbformat

    output = inside_output()
    for path in notebook_paths():
        nb = nbformat.read(path, as_version=4)
        if not problems(nb) and any(c.get("id") == CODE_ID and c.outputs for c in nb.cells):
            print(f"[notebook_setup] {path.relative_to(ROOT)}: up to date")
            continue
        nbformat.write(put_setup_cells(nb, output), path)
        print(f"[notebook_setup] {path.relative_to(ROOT)}: set-up cells written")


def check():
    import nbformat

    bad = {p.name: problems(nbformat.read(p, as_version=4)) for p in notebook_paths()}
    bad = {name: found for name, found in bad.items() if found}
    for name, found in bad.items():
        print(f"[notebook_setup] {name}: {'; '.join(found)}")
    if bad:
        print("[notebook_setup] run: python scripts/notebook_setup.py --write")
    return 1 if bad else 0


def github_repo(url):
    """'owner/name' of a GitHub URL (https or ssh form), else None."""
    m = re.search(r"github\.com[:/]+([^/]+)/([^/]+?)(?:\.git)?/*$", url)
    return f"{m[1]}/{m[2]}" if m else None


def links():
    url, source = REPO_URL, "REPO_URL in scripts/notebook_setup.py"
    if not url:
        out = subprocess.run(["git", "remote", "get-url", "origin"], cwd=ROOT, capture_output=True, text=True)
        url, source = out.stdout.strip(), "git remote origin (REPO_URL is empty, so the notebooks' cells have none)"
    if not url:
        print("No URL is known: REPO_URL in scripts/notebook_setup.py is empty and this checkout has no git remote "
              "'origin'. Once the repository is published, set REPO_URL and run --write, then --links.")
        return 1
    repo = github_repo(url)
    print(f"repository: {url} (from {source})")
    if repo is None:
        print("Colab and Kaggle open notebooks from GitHub by URL; this is not a GitHub URL. Upload a notebook "
              "to the service instead (Colab: File > Upload notebook) and run its set-up cell.")
        return 1
    for path in notebook_paths():
        github = f"https://github.com/{repo}/blob/{BRANCH}/notebooks/{path.name}"
        print(f"{path.name}\n  Colab:  https://colab.research.google.com/github/{repo}/blob/{BRANCH}/notebooks/"
              f"{path.name}\n  Kaggle: https://kaggle.com/kernels/welcome?src={github}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="put the set-up cells into every notebook")
    what.add_argument("--check", action="store_true", help="exit 1 when a notebook's set-up cells differ")
    what.add_argument("--links", action="store_true", help="print the 'open in Colab / Kaggle' links")
    args = ap.parse_args(argv)
    if args.write:
        write()
        return 0
    return check() if args.check else links()


if __name__ == "__main__":
    sys.exit(main())
