#!/usr/bin/env bash
# One GPU check of the Triton kernels (issue #22), in at most 8 minutes on one H200:
#   1. the Triton tests compiled on CUDA tensors (TRITON_INTERPRET=0; tests/attnuq/ops/test_triton.py
#      plus the CUDA dispatch test), at most 3 minutes;
#   2. benchmarks/bench_triton.py: sampled attention vs SDPA flash at B4 H16 D64 bf16 for
#      L in {1024, 4096, 16384}, peak memory, the torch path, moments, and the nu=4 overhead of
#      two Hugging Face models, at most 4.5 minutes.
# Outputs (gpu.md, gpu.json, triton_tests.log) go to the folder given as the first argument,
# default $OUT if set, else docs/benchmarks.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]     (after: bash scripts/setup.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-docs/benchmarks}}
mkdir -p "$OUT_DIR"
PY=.venv/bin/python
if [ ! -x "$PY" ]; then
  echo "gpu_check: .venv missing; run bash scripts/setup.sh first" >&2
  exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch" >&2
  exit 2
fi
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/attnuq/ops/test_triton.py \
  >"$OUT_DIR/triton_tests.log" 2>&1
tests_rc=$?
tail -n 15 "$OUT_DIR/triton_tests.log"
timeout 270 "$PY" benchmarks/bench_triton.py --out-dir "$OUT_DIR" \
  --tests-log "$OUT_DIR/triton_tests.log"
bench_rc=$?
echo "gpu_check: tests rc=$tests_rc, benchmark rc=$bench_rc; outputs in $OUT_DIR"
exit $(( tests_rc != 0 || bench_rc != 0 ))
