#!/usr/bin/env bash
# The whole tutorial, end to end: every stage's run.py in order, each checked against the stage
# before it (GPU stages on the GPU when there is one, on their CPU mirrors otherwise), the ring
# under `mpirun -n 4`, then one summary table. Sets up .venv on first use.
#   ./scripts/tutorial.sh            # quick sizes (a few minutes on a laptop)
#   ./scripts/tutorial.sh --full     # each run.py at its default sizes
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
python scripts/run_all.py "$@"
