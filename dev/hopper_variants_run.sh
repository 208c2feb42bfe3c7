#!/usr/bin/env bash
# What one sm_90 GPU (H100 or H200) runs for stage 06's attention variants (issue 69), logs and CSVs into OUT_DIR:
#   dev/hopper_variants_run.sh OUT_DIR tests   the variants' gpu tests (forward, backward, packed batches, ring blocks)
#                                              and the stage 06 gpu tests they share a main loop with
#   dev/hopper_variants_run.sh OUT_DIR bench [BEFORE]
#                                              dev/bench_variants.py --hopper (OUT_DIR/bench_variants_hopper_<gpu>.csv);
#                                              with BEFORE (a tree from before the hooks: git archive COMMIT | tar -x
#                                              -C BEFORE), dev/bench.py's bf16 rows in this tree and in BEFORE, one
#                                              after the other on the same GPU: plain attention's speed before and
#                                              after (its kernels now run through the hooks)
#   dev/hopper_variants_run.sh OUT_DIR all [BEFORE]   both; OUT_DIR/DONE is written at the end
# Needs the GPU packages already there (numpy, cupy, pytest; torch for FlexAttention and SDPA). Each step's output
# ends with its exit status.
set -uo pipefail
OUT="${1:?usage: dev/hopper_variants_run.sh OUT_DIR tests|bench|all}"
PART="${2:?usage: dev/hopper_variants_run.sh OUT_DIR tests|bench|all}"
BEFORE="${3:-}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="$(command -v python3)"

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
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  # the kernels compile once per process: one pytest process, several workers would compile each its own
  step variants_tests 600 "$PY" -m pytest -q -m gpu -p no:cacheprovider -x tests/test_06_hopper_gpu_variants.py
  step stage06_tests 600 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_06_hopper_gpu.py \
    tests/test_06_hopper_gpu_backward.py
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  step bench_variants 420 "$PY" dev/bench_variants.py --hopper --out "$OUT"
  if [ -n "$BEFORE" ]; then
    for tree in "$PWD" "$BEFORE"; do
      name=$([ "$tree" = "$PWD" ] && echo after || echo before)
      mkdir -p "$OUT/plain_$name"
      step "plain_$name" 600 env PYTHONPATH="$tree" "$PY" "$tree/dev/bench.py" --dtypes bf16 --seqs 1024 4096 16384 \
        --head-dims 64 128 --no-plots --out "$OUT/plain_$name"
    done
  fi
fi
date -u > "$OUT/DONE"
