"""Every notebook executes top to bottom on the CPU (GPU cells say they were skipped)."""
import pathlib

import nbclient
import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_every_stage_has_a_notebook():
    names = {p.name[:2] for p in NOTEBOOKS}
    stages = {p.name[:2] for p in (ROOT / "stages").iterdir() if p.is_dir() and p.name[:2].isdigit()}
    assert stages <= names, f"stages without a notebook: {sorted(stages - names)}"
