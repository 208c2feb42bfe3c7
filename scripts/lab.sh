#!/usr/bin/env bash
# Opens the notebooks in JupyterLab. Sets up .venv as the other scripts do, installs JupyterLab into it on first use
# (the tests and the tutorial run the notebooks without it), then starts it on notebooks/. Extra args go to
# `jupyter lab` (--port 8890, --no-browser, ...). As root (a container's default user) it adds --allow-root, without
# which JupyterLab refuses to start.
set -euo pipefail
source "$(dirname "$0")/setup_env.sh"
if ! python -c "import jupyterlab" 2>/dev/null; then
  echo "[lab] installing JupyterLab into .venv (first use)"
  python -m pip install --quiet --no-compile jupyterlab
fi
ROOT_FLAG=()
if [ "$(id -u)" = 0 ]; then ROOT_FLAG=(--allow-root); fi
exec jupyter lab notebooks/ ${ROOT_FLAG[@]+"${ROOT_FLAG[@]}"} "$@"
