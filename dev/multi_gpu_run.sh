#!/usr/bin/env bash
# What a machine of several GPUs runs for stages 04 and 05:
#   dev/multi_gpu_run.sh OUT_DIR ring    the ring's multi-GPU tests, the mission's command (each scheme),
#                                        dev/bench_ring.py (each scheme)
#   dev/multi_gpu_run.sh OUT_DIR train   stage 05's multi-GPU tests and training run, dev/train_scaling.py
#   dev/multi_gpu_run.sh OUT_DIR all     both; OUT_DIR/DONE is written at the end
# Logs and CSVs go to OUT_DIR. Needs the GPU packages already there (numpy, cupy, mpi4py with an MPI, pytest;
# torch for PyTorch's context parallel). Each step's output ends with its exit status.
set -uo pipefail
OUT="${1:?usage: dev/multi_gpu_run.sh OUT_DIR ring|train|all}"
PART="${2:?usage: dev/multi_gpu_run.sh OUT_DIR ring|train|all}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # Open MPI as root (a lent machine)
PY="$(command -v python3)"
N="$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())')"
MPIRUN=(mpirun --oversubscribe -n "$N")

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to OUT/NAME.txt, print its tail
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "exit $rc" >> "$OUT/$name.txt"
  tail -n 15 "$OUT/$name.txt"
  return $rc
}

nvidia-smi -L > "$OUT/gpus.txt"
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
if [ "$PART" = ring ] || [ "$PART" = all ]; then
  step ring_tests 400 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_04_*.py &&
  step ring_mission 150 "${MPIRUN[@]}" "$PY" stages/04_ring/run.py
  for scheme in allgather alltoall; do
    step "ring_mission_$scheme" 150 "${MPIRUN[@]}" "$PY" stages/04_ring/run.py --scheme "$scheme"
  done
  step ring_bench 420 "${MPIRUN[@]}" "$PY" dev/bench_ring.py --repeat 3 --schemes ring allgather alltoall \
    --out "$OUT/ring_gpus.csv"
fi
if [ "$PART" = train ] || [ "$PART" = all ]; then
  step train_tests 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_05_train_gpt.py
  step train_readme 120 "${MPIRUN[@]}" "$PY" stages/05_train_gpt/train.py --attention ring --steps 60
  step train_scaling 600 "${MPIRUN[@]}" "$PY" dev/train_scaling.py --out "$OUT/train_gpt_scaling.csv"
fi
date > "$OUT/DONE"
