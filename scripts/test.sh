#!/usr/bin/env bash
# Set up (scripts/setup.sh), then lint, type-check and run the test suite of the library and the
# harness.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/ruff check src harness tests benchmarks scripts conftest.py
.venv/bin/mypy
# the tests; then (for a full run, no arguments) every docstring example of both packages
.venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --durations=15 "$@"
if [ "$#" -eq 0 ]; then
    .venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" --doctest-modules src/attnuq \
        harness/src/attnuq_bench -p no:cacheprovider
fi
