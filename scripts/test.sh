#!/usr/bin/env bash
# The tests: ruff lint, then pytest (every stage's CPU tests, compiles (NVRTC, ptxas) of every kernel configuration
# for each architecture from sm_75 to sm_90 within its limits, the mpirun ring tests, every notebook executed), on
# every core (pytest-xdist). `gpu` tests run when a GPU is there and skip with a reason otherwise. Sets up .venv on
# first use. Extra args go to pytest.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
echo "[test] ruff check ."
ruff check .
echo "[test] pytest on every core: the stages' CPU tests and tile mirrors, the mpirun ring tests, the notebooks, and"
echo "       a compile of every kernel configuration for sm_75 to sm_90 (the slowest part, started first: several"
echo "       minutes on two cores). GPU tests skip on a machine without a GPU."
# One BLAS thread per worker: -n auto already runs a worker on every core, and each worker's numpy (the float64
# oracles) would otherwise start a BLAS thread per core too, cores x cores threads that wait on one another.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
# glibc's malloc gives each large block (an Nq x Nk score matrix, an activation) its own mmap and returns it to the
# kernel when freed, so the next one faults in fresh zeroed pages: numpy's temporaries make much of the large cases'
# time system time. Taken from the heap instead and kept there when freed (up to 1 GB at its top), a block's pages
# are reused by the next.
export MALLOC_MMAP_MAX_="${MALLOC_MMAP_MAX_:-0}" MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1073741824}"
# --maxschedchunk=1: each worker is handed the next test in collection order as it finishes one (conftest.py puts the
# slow ones first), not a consecutive block of hundreds, which would give one worker every slow test.
python -m pytest -q -n auto --maxschedchunk=1 "$@"
