#!/usr/bin/env bash
# Create .venv and install the library attnuq with its extras and the harness attnuq-bench
# (harness/), both editable.
# torch and torchvision are pinned here (a CUDA build that also runs on the CPU; torchvision is
# what timm needs); the packages themselves only ask for a range (torch>=2.4,<3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1" \
    -e ".[hf,tabular,vision,plots,pretrained,dev]" -e "./harness[weather]"
