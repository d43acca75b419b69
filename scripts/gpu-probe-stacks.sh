#!/usr/bin/env bash
# One device call (issue 39, phase 1): install torchtitan, DeepSpeed and their dependencies from the
# wheels carried in .whl/, then run scripts/stacks_probe.py part by part on 1 GPU: eager vs graphstep,
# bitwise. Each part has its own time limit and a failing part does not stop the others. ~4-5 minutes.
# Usage (repo root on the GPU machine, the device tool carrying .whl): bash scripts/gpu-probe-stacks.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
OUT=${OUT:-/tmp/graphstep-gpu}
mkdir -p "$OUT"
START=$SECONDS
# The target path contains "site-packages": graphstep's user-code check (guards/user_code.py) counts
# files under such a path as library code, as it does for the real site-packages. A bare /tmp/site
# would make torchtitan and DeepSpeed look like the user's own code.
SITE=/tmp/stacks/site-packages
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
  >"$OUT/stacks-install.log" 2>&1 || echo "wheel install failed: see stacks-install.log"
export PYTHONPATH=$SITE
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "graphstep install failed, using src"; export PYTHONPATH=$SITE:$PWD/src; }
nvcc --version 2>/dev/null | tail -n 1

LOG="$OUT/stacks-probe.log"
: >"$LOG"
BUDGET=${BUDGET:-335}  # seconds for all parts: the whole call stays under 6 minutes
part() {  # part SECONDS ARGS...: one probe run in its own process, cut to what the budget has left
  local limit=$1 left=$((BUDGET - SECONDS + START))
  shift
  if [ "$left" -lt 20 ]; then echo "RESULT $*: SKIPPED (time budget spent)" | tee -a "$LOG"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $* ($((SECONDS - START)) s in, limit $limit s)" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" python3 scripts/stacks_probe.py "$@" >>"$LOG" 2>&1
  [ $? -ge 124 ] && echo "RESULT $*: TIMEOUT after $limit s" | tee -a "$LOG"
}

part 45 versions
if ! python3 -c "import torchtitan.models.llama3, torchtitan.models.deepseek_v3" >>"$LOG" 2>&1; then
  echo "torchtitan $(ls .whl/torchtitan-*.whl) does not import on this torch: trying .whl/alt" | tee -a "$LOG"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/alt/torchtitan-*.whl \
    >>"$OUT/stacks-install.log" 2>&1
  part 45 versions
fi
part 30 tolist
part 90 titan-llama3 --optimizer inner
part 90 titan-dsv3 --optimizer inner
part 60 deepspeed --zero 2 --dtype bf16 --optimizer inner
part 40 deepspeed --zero 1 --dtype fp32 --optimizer inner
part 45 titan-llama3 --optimizer container
part 30 titan-llama3 --sched inside
part 30 deepspeed --zero 2 --dtype bf16 --optimizer zero
# the next wall after DeepSpeed's host reads: no clipping, bf16 without its overflow check
PROBE_DS_CLIP=0 PROBE_DS_NO_OVERFLOW_CHECK=1 PROBE_TEXT=6000 part 30 deepspeed --zero 2 --dtype bf16 --optimizer inner

echo "== summary ($((SECONDS - START)) s)"
grep -E "^RESULT|^  [a-z_]+ |^  graphstep counts|^python|does not import" "$LOG" | cut -c1-600
