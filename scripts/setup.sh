#!/usr/bin/env bash
# Create .venv and install attnuq with all extras that import on a CPU-only machine.
# torch is pinned here (the CPU wheel); the package itself only asks for a range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[hf,tabular,bench,weather,dev]"
