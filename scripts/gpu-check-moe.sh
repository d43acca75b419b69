#!/usr/bin/env bash
# One device call (issue 42): the MoE GPU tests and the tests a segment's transformers path touches, with
# the machine's transformers; the MoE memory benchmark beside them; then the auxiliary-loss cases again
# with a carried transformers (.whl/moe: one whose load-balancing loss uses histc, not bincount).
# Usage (repo root on the GPU machine, the device tool carrying .whl): bash scripts/gpu-check-moe.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/graphstep-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install failed, using PYTHONPATH=src"; export PYTHONPATH=$PWD/src; }
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
timeout 300 python3 benchmarks/moe_memory.py >"$OUT/moe-memory.log" 2>&1 &
memory=$!
python3 -m pytest -q -p no:cacheprovider --timeout=300 -n 4 --dist loadfile -rA tests/gpu/test_moe_gpu.py \
  tests/gpu/test_graph_breaks_gpu.py tests/gpu/test_real_models_gpu.py tests/gpu/test_integrations_gpu.py \
  tests/gpu/test_inputs_gpu.py >"$OUT/moe-tests.log" 2>&1
grep -E "^(FAILED|ERROR)|breaks, peak" "$OUT/moe-tests.log"; tail -n 1 "$OUT/moe-tests.log"
wait $memory; tail -n 12 "$OUT/moe-memory.log"; cp benchmarks/results/*moe-memory* "$OUT/" 2>/dev/null
if ls .whl/moe/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe/site-packages \
    .whl/moe/transformers-*.whl .whl/moe/tokenizers-*.whl .whl/moe/safetensors-*.whl >/dev/null 2>&1
  if ! PYTHONPATH=/tmp/moe/site-packages python3 -c "import transformers" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/moe/site-packages .whl/moe/huggingface_hub-*.whl >/dev/null 2>&1
  fi
  PYTHONPATH=/tmp/moe/site-packages python3 -c "import transformers; print('carried transformers', transformers.__version__)" \
    && PYTHONPATH=/tmp/moe/site-packages python3 -m pytest -q -p no:cacheprovider --timeout=300 -n 4 -rA \
      tests/gpu/test_moe_gpu.py -k "aux and not no_aux" >"$OUT/moe-tests-carried.log" 2>&1
  grep -E "^(FAILED|ERROR)|breaks, peak" "$OUT/moe-tests-carried.log"; tail -n 1 "$OUT/moe-tests-carried.log"
fi
