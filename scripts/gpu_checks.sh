#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (about 4 minutes on an H100): every CUDA test
# (`pytest -m gpu`), then the GPU step benchmarks (GPT-2 small in bf16: compute-bound and
# launch-bound, and torchdebug's host time per boundary). Uses the python that holds a CUDA torch
# (`PYTHON=...` to choose) and the source tree (no install). Results go to stdout and, when OUT is
# set, to files under it. Record what it prints in docs/benchmarks.md ("On a GPU").
#
#   bash scripts/gpu_checks.sh            # or: OUT=/some/dir PYTHON=python3 bash scripts/gpu_checks.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/torchdebug-gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
date -u
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA GPU here: nothing to check (the CUDA tests skip themselves in the normal suite)"
    exit 0
fi
"$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"

echo "== CUDA tests (pytest -m gpu)"
# -p no:benchmark: pytest-benchmark, where installed, warns under xdist and filterwarnings=error
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -p no:benchmark -m gpu -rfs --tb=short --continue-on-collection-errors >"$OUT/cuda_tests.log" 2>&1
echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cuda_tests.log"

echo "== GPT-2 small, batch 8, seq 1024 (compute-bound)"
timeout 100 "$PY" benchmarks/gpu_step.py --repeats 7 --chunk 20 2>&1 | tee "$OUT/gpu_step_full.log"
echo "== GPT-2 small, batch 1, seq 64 (launch-bound)"
timeout 100 "$PY" benchmarks/gpu_step.py --repeats 15 --chunk 20 --batch 1 --seq 64 2>&1 | tee "$OUT/gpu_step_launch.log"
echo "== torchdebug's host time per boundary, launch-bound"
timeout 60 "$PY" benchmarks/gpu_step.py --boundaries --repeats 5 --chunk 20 --batch 1 --seq 64 2>&1 | tee "$OUT/gpu_boundaries.log"
date -u
