#!/usr/bin/env bash
# One device call on a 2-GPU machine: the distributed GPU tests, then the distributed benchmark.
# Usage (from the repo root): bash scripts/gpu-check-distributed.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/graphstep-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install failed, using PYTHONPATH=src"; export PYTHONPATH=$PWD/src; }
python3 -c "import torch; print(f'torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name()} x{torch.cuda.device_count()}')" | tee "$OUT/env.txt"
python3 -m pytest tests/gpu/test_distributed_gpu.py -q -p no:cacheprovider --timeout=300 -rA "$@" 2>&1 | tee "$OUT/gpu-distributed-tests.log"
status=${PIPESTATUS[0]}
timeout 300 torchrun --nproc_per_node 2 benchmarks/distributed.py --out "$OUT/results" 2>&1 | grep -v "^W1" | tail -n 20
echo "== summary: $(tail -n 1 "$OUT/gpu-distributed-tests.log")"
exit "$status"
