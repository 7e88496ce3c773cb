#!/usr/bin/env bash
# Run the test suite as on an AVX2 machine, on an AVX-512 / AMX one: PyTorch's CPU dispatch,
# MKL and oneDNN are capped at AVX2 and the C kernels are compiled with -march=haswell into
# their own cache. Arguments go to pytest (default: the whole suite). Needs .venv (setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat > "$tmp/cc" <<'CC'
#!/bin/sh
for a in "$@"; do
  if [ "$a" = "-march=native" ]; then a="-march=haswell"; fi
  set -- "$@" "$a"; shift
done
exec "${ATTNUQ_REAL_CC:-cc}" "$@"
CC
chmod +x "$tmp/cc"
export ATTNUQ_REAL_CC="${CC:-cc}" CC="$tmp/cc" ATTNUQ_CACHE_DIR="$tmp/kernels"
export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
.venv/bin/python -c "import torch; print('torch CPU capability:', torch.backends.cpu.get_cpu_capability())"
.venv/bin/python -m pytest -q -n "${PYTEST_WORKERS:-2}" -p no:cacheprovider "$@"
