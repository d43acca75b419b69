#!/usr/bin/env bash
# One device call: install graphstep on the GPU machine, run tests/gpu, print a summary.
# Usage (from the repo root, on the GPU machine): bash scripts/gpu-check.sh [pytest args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/graphstep-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install failed, using PYTHONPATH=src"; export PYTHONPATH=$PWD/src; }
python3 - <<'PY' | tee "$OUT/env.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name()} x{torch.cuda.device_count()}")
PY
python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout=300 -rA --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log"
status=${PIPESTATUS[0]}
echo "== summary: $(tail -n 1 "$OUT/gpu-tests.log")"
exit "$status"
