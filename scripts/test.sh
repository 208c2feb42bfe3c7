#!/usr/bin/env bash
# The tests: ruff lint, then pytest (every stage's CPU tests, NVRTC compiles of every kernel configuration
# for each architecture from sm_75 to sm_90 within its limits, the mpirun ring tests, every notebook
# executed), on every core (pytest-xdist). `gpu` tests run when a GPU is there and skip with a reason otherwise. Sets up .venv on first
# use. Extra args go to pytest.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
echo "[test] ruff check ."
ruff check .
echo "[test] pytest on every core: the stages' CPU tests and tile mirrors, the mpirun ring tests, the notebooks, and"
echo "       an NVRTC compile of every kernel configuration for sm_75 to sm_90 (the slowest part: a few minutes on"
echo "       two cores, mostly at the end of the progress bar). GPU tests skip on a machine without a GPU."
python -m pytest -q -n auto "$@"
