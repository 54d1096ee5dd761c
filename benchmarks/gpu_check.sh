#!/usr/bin/env bash
# The one prepared GPU check (docs/gpu.md): every step of benchmarks/gpu_check.py, results in $OUT_DIR/gpu_check.json
# and the whole output in $OUT_DIR/gpu_check.log.
#   bash benchmarks/gpu_check.sh [OUT_DIR]            (a machine with one CUDA GPU and this repo's requirements)
#   bash benchmarks/gpu_check.sh OUT_DIR --dry-run    (the same steps at toy sizes on CPU, before spending GPU time)
# Uses the packages already installed (python3 on PATH, or PYTHON=...); the repo is put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${1:-outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}
shift || true
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT_DIR" "$@"
