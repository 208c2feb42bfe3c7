#!/usr/bin/env bash
# Sourced by tutorial.sh and test.sh: make .venv (once) and install requirements.txt into it, this repository
# included as the package `stages` (again only when requirements.txt changes). Needs nothing but python3 >= 3.10.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ATTN_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.requirements.sha"
WANT="$(sha256sum "$ROOT/requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "[setup] installing requirements.txt into $VENV (first run: a few minutes)"
  # a pip older than 23 (an old venv's) may not install this repository editable from pyproject.toml (PEP 660)
  if ! "$VENV/bin/python" -c 'import sys, pip; sys.exit(int(pip.__version__.split(".")[0]) < 23)'; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
  fi
  # --no-compile: Python byte-compiles each module when it is first imported, not every module of every package now
  (cd "$ROOT" && "$VENV/bin/python" -m pip install --quiet --no-compile -r requirements.txt)  # `-e .`: this repository
  echo "$WANT" > "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
