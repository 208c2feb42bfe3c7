#!/usr/bin/env bash
# The tests: ruff lint, then pytest (every stage's CPU tests, compiles (NVRTC, ptxas) of every kernel configuration
# for each architecture from sm_75 to sm_90 within its limits, the mpirun ring tests, every notebook executed), on
# every core (pytest-xdist). `gpu` tests run when a GPU is there; without one they are left out and the summary says
# how many, file by file. Sets up .venv on first use. Extra args go to pytest.
set -euo pipefail
CORES="$(nproc)"
LAST="${ATTN_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}/.last_test_seconds"  # this machine's last whole run,
# kept beside the environment (not in git)
# The budget is CI's: the whole run (with the set-up of a fresh .venv) within 10 minutes on 2 cores.
MSG="[test] expected: within 10 minutes on 2 cores (CI's budget), less on more; this machine: $CORES cores"
if [ $# -eq 0 ] && [ -s "$LAST" ]; then
  MSG="$MSG, whose last whole run took $(( $(cat "$LAST") / 60 )) min $(( $(cat "$LAST") % 60 )) s"
fi
echo "$MSG"
START=$SECONDS
source "$(dirname "$0")/setup_env.sh"
echo "[test] ruff check ."
ruff check .
echo "[test] pytest on $CORES cores: the slow tests start first (the kernel compiles, then the notebooks), each"
echo "       reported at half and at its end; then every stage's CPU tests and the mpirun ring tests."
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
status=0
python -m pytest -q -n auto --maxschedchunk=1 "$@" || status=$?
if [ $# -eq 0 ] && [ $status -eq 0 ]; then echo $(( SECONDS - START )) > "$LAST"; fi
echo "[test] $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 )) s"
exit $status
