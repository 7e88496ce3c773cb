#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: `attnuq demo` on a bundled data set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MPLBACKEND=Agg HF_HUB_OFFLINE=1
.venv/bin/attnuq demo "$@"
