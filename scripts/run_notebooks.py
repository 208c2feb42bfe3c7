#!/usr/bin/env python3
"""Execute every notebook in notebooks/ top to bottom and save it in place: each notebooks/NN_*.ipynb is overwritten
with its new outputs (--dry-run executes and writes nothing).

    python scripts/run_notebooks.py                  # all of notebooks/*.ipynb, on the CPU, each saved in place
    python scripts/run_notebooks.py 02 04            # only the notebooks whose names start with 02 or 04
    python scripts/run_notebooks.py --dry-run        # execute and report, write nothing (a check, not a refresh)
    python scripts/run_notebooks.py --gpu            # let the kernels see the GPU (default: hidden)

The notebooks are committed executed, so their figures show when someone browses the repository. This
script is the one way to regenerate them: the GPU is hidden (CUDA_VISIBLE_DEVICES="") unless --gpu is
given, so the committed outputs are the CPU ones, where each GPU cell says it ran the CPU mirror instead.
Volatile metadata (execution timestamps, the kernel's Python version) is stripped so that re-running
gives a small diff; the notebooks fix their random seeds, and their figures are PNG at a modest dpi.
Exits non-zero, naming the cell, when a cell raises.
"""
import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def strip_volatile(nb):
    """Drop what changes from run to run without changing what the notebook shows."""
    nb.metadata.pop("widgets", None)
    lang = nb.metadata.get("language_info")
    if lang is not None:
        lang.pop("version", None)  # the Python patch version of whoever ran it last
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # iopub timestamps (nbclient's record_timing)
        cell.metadata.pop("ExecuteTime", None)
        if cell.cell_type == "code":  # one stdout/stderr output per run of prints: how the kernel happened to
            merged = []               # flush them (one chunk or four) is not worth a diff
            for out in cell.outputs:
                if merged and out.output_type == "stream" and merged[-1].output_type == "stream" \
                        and merged[-1].name == out.name:
                    merged[-1].text += out.text
                else:
                    merged.append(out)
            cell.outputs = merged
    return nb


def execute(path, timeout=600):
    """Execute one notebook in its own folder; return (notebook, seconds)."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the failing cell's source and traceback)
    return strip_volatile(nb), time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="prefixes of notebook names (default: every notebook); each one run is "
                    "saved in place, over the file, unless --dry-run")
    ap.add_argument("--dry-run", action="store_true", help="execute but do not write the notebooks back (the files "
                    "stay as they are)")
    ap.add_argument("--gpu", action="store_true", help="do not hide the GPU from the kernels")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = ap.parse_args()
    import nbformat

    if not args.gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the kernel process inherits this: CuPy sees no device
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.names:
        paths = [p for p in paths if any(p.name.startswith(n) for n in args.names)]
    if not paths:
        sys.exit(f"no notebook in {NOTEBOOKS} matches {args.names}")
    total = 0.0
    for path in paths:
        print(f"[run_notebooks] {path.relative_to(ROOT)} ...", end=" ", flush=True)
        nb, dt = execute(path, timeout=args.timeout)
        total += dt
        pngs = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        if not args.dry_run:
            nbformat.write(nb, path)
        print(f"{dt:.1f} s, {pngs} figures{'' if args.dry_run else ', saved'}", flush=True)
    print(f"[run_notebooks] {len(paths)} notebooks in {total:.1f} s")


if __name__ == "__main__":
    main()
