"""The notebooks: each executes top to bottom on the CPU with no failing cell and draws the figures it should
(GPU cells say they fell back to the CPU mirror); the committed notebooks carry their outputs; and the
figure check itself fails when a figure is missing."""
import copy
import os
import pathlib
import sys

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# notebook (file name without .ipynb) -> the least number of figures (image/png outputs) it must draw on the CPU.
# 02 and 03 each have one more figure drawn from the committed results/bench.csv.
EXPECTED_FIGURES = {
    "00_naive": 1,               # memory against N
    "01_flash_v1": 2,            # tile visit order (full and causal), memory O(N) against O(N^2)
    "02_flash_v2": 14,           # loop order, blocks vs SMs, split-K/Q, lanes, causal tiles, mma fragments,
                                 # ldmatrix lane addresses, cp.async timeline, TF32 bits, 3xTF32 errors,
                                 # benchmark; variants: masks, window tiles, softcap and ALiBi
    "03_flash_v2_backward": 3,   # memory (store vs recompute), causal tiles visited, benchmark
    "04_ring": 7,                # schedule, backward schedule, zigzag work, window steps, timeline, the halves,
                                 # efficiency and memory on 4 GPUs
    "05_train_gpt": 1,           # loss curves of the kernels on the recall task
    "06_hopper": 5,              # swizzle and passes, the K steps' bytes, pipeline timelines, ping-pong timeline,
                                 # a window's band of K/V tiles
}
MAX_NOTEBOOK_BYTES = 1_000_000   # outputs stay small: PNGs at a modest dpi, no huge printouts


def count_figures(nb):
    """The number of image/png outputs of a notebook's code cells."""
    return sum("image/png" in out.get("data", {})
               for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []))


def check_outputs(nb, name):
    """Raise AssertionError when a cell has an error output or the notebook draws fewer figures than expected."""
    errors = [(i, out.get("ename"), out.get("evalue")) for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.output_type == "error"]
    assert not errors, f"{name}: cells with errors (index, exception, message): {errors}"
    assert name in EXPECTED_FIGURES, f"{name}: add it to EXPECTED_FIGURES in tests/test_notebooks.py"
    n = count_figures(nb)
    assert n >= EXPECTED_FIGURES[name], f"{name}: {n} figures drawn, expected at least {EXPECTED_FIGURES[name]}"


@pytest.mark.slow  # up to half a minute each: started first (conftest.py)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    # the kernel (a process of its own) imports this checkout's `stages`, whichever checkout an installed package
    # points at
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # run from scratch: the committed outputs must not count
        if cell.cell_type == "code":
            cell.outputs = []
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    check_outputs(nb, path.stem)


GPU_ARCHS = ["sm_75", "this GPU"]  # a T4 (no bfloat16, no cp.async, no TF32 tensor cores, 64 KB) and this GPU


@pytest.fixture(scope="module")
def notebooks_on_the_gpu():
    """{(notebook, arch): CompletedProcess} of scripts/run_notebooks.py --gpu --dry-run for every notebook, on this GPU
    and as a T4 (ATTN_ARCH=sm_75), all started together."""
    from tests.test_runners import as_gpu, run_at_once

    envs = {arch: as_gpu(arch) for arch in GPU_ARCHS}
    runs = {(path.name, arch): ([sys.executable, "scripts/run_notebooks.py", path.stem, "--gpu", "--dry-run"],
                                dict(envs[arch], PYTHONPATH=str(ROOT)))
            for path in NOTEBOOKS for arch in GPU_ARCHS if envs[arch] is not None}
    return run_at_once(runs)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", GPU_ARCHS)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_the_gpu(path, arch, notebooks_on_the_gpu):
    """Each notebook with the GPU in view, on this GPU and as a T4 runs it: what the GPU lacks is left out, the cells
    pass (scripts/run_notebooks.py exits non-zero, naming the cell, when one raises)."""
    if (path.name, arch) not in notebooks_on_the_gpu:
        pytest.skip(f"this GPU cannot stand in for {arch}")
    out = notebooks_on_the_gpu[(path.name, arch)]
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_notebook_is_executed(path):
    """Notebooks are committed executed (regenerate with scripts/run_notebooks.py), so the figures show on GitHub."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.execution_count is None]
    assert not unrun, f"{path.name}: cells {unrun} have not been executed; run scripts/run_notebooks.py"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not executed top to bottom in one run: {counts}"
    check_outputs(nb, path.stem)
    timed = [i for i, c in enumerate(nb.cells) if "execution" in c.metadata]
    assert not timed, f"{path.name}: cells {timed} carry execution timestamps; run scripts/run_notebooks.py"
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name}: {path.stat().st_size} bytes of outputs"


def test_figure_check_fails_when_a_figure_is_missing():
    path = ROOT / "notebooks" / "04_ring.ipynb"
    nb = nbformat.read(path, as_version=4)
    check_outputs(nb, path.stem)  # the committed notebook passes ...
    broken = copy.deepcopy(nb)
    cell = next(c for c in broken.cells if c.cell_type == "code"
                and any("image/png" in o.get("data", {}) for o in c.get("outputs", [])))
    cell.outputs = [o for o in cell.outputs if "image/png" not in o.get("data", {})]  # ... one figure removed
    assert count_figures(broken) == count_figures(nb) - 1
    with pytest.raises(AssertionError, match="figures drawn, expected at least"):
        check_outputs(broken, path.stem)


def test_output_check_fails_on_an_error_output():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1 / 0")
    cell.outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]
    nb.cells.append(cell)
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        check_outputs(nb, "00_naive")


def test_every_notebook_has_a_figure_count():
    missing = [p.stem for p in NOTEBOOKS if p.stem not in EXPECTED_FIGURES]
    assert not missing, f"notebooks without an entry in EXPECTED_FIGURES: {missing}"


def test_every_stage_has_a_notebook():
    names = {p.name[:2] for p in NOTEBOOKS}
    stages = {p.name[:2] for p in (ROOT / "stages").iterdir() if p.is_dir() and p.name[:2].isdigit()}
    assert stages <= names, f"stages without a notebook: {sorted(stages - names)}"
