#!/usr/bin/env bash
# One device call on a machine of 2, 4 or 8 GPUs: the distributed GPU tests (those that need more GPUs
# than the machine has are skipped), then the distributed benchmark on every GPU present.
# Usage (from the repo root): bash scripts/gpu-check-distributed.sh [pytest args, e.g. -k 4gpu]
# BENCH=0 skips the benchmark, TESTS=0 the tests (a device call has 10 minutes: split the two on 4 GPUs).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 OMP_NUM_THREADS=1
OUT=${OUT:-/tmp/graphstep-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install failed, using PYTHONPATH=src"; export PYTHONPATH=$PWD/src; }
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch; print(f'torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {torch.cuda.get_device_name()} x{torch.cuda.device_count()}')" | tee "$OUT/env.txt"
status=0
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest tests/gpu/test_distributed_gpu.py tests/gpu/test_pipelining_gpu.py -q -p no:cacheprovider --timeout=300 -rA "$@" 2>&1 | tee "$OUT/gpu-distributed-tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "${BENCH:-1}" != 0 ] && [ "$GPUS" -ge 2 ]; then
  timeout 420 torchrun --nproc_per_node "$GPUS" benchmarks/distributed.py --out "$OUT/results" 2>&1 | grep -v "^W1" | tail -n 20
fi
[ "${TESTS:-1}" != 0 ] && echo "== summary ($GPUS GPUs): $(tail -n 1 "$OUT/gpu-distributed-tests.log")"
exit "$status"
