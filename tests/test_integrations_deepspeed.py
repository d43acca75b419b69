"""DeepSpeed (0.19.8) ZeRO-1/2 engines under graphstep.integrations.deepspeed, on DeepSpeed's CPU
accelerator with gloo and the recording backend (which bakes Python as a CUDA graph does).

`engine(x)`, `engine.backward(loss)`, `engine.step()` captured, against an eager twin engine on the same
micro-batches: every loss and parameter bitwise equal, and the loss scale, the learning rate (WarmupLR)
and DeepSpeed's counters (`global_steps`, `micro_steps`, `skipped_steps`, `global_samples`) the same, on
1 and 2 ranks; fp16's dynamic scaler skips steps and changes its scale on most calls; gradient
accumulation, with a short micro-batch at the end of an epoch in between. What is refused is refused with
DeepSpeed's name for it. Skipped where DeepSpeed is not installed (`pip install graphstep[deepspeed]`).
The GPU tests: tests/gpu/test_deepspeed_gpu.py.
"""

from __future__ import annotations

import importlib.util

import pytest

# Found, not imported: DeepSpeed runs in the ranks' processes only (an import here would stay in the test
# process and slow every later capture's census of live objects).
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs DeepSpeed (pip install graphstep[deepspeed])", allow_module_level=True)

from deepspeed_workers import check, refusals, train_cases
from ranks import run_ranks

ONE_RANK = [
    {"zero": 2, "dtype": "fp32", "accum": 1, "steps": 6},
    {"zero": 2, "dtype": "fp16", "accum": 1, "steps": 10},
    {"zero": 1, "dtype": "bf16", "accum": 2, "steps": 10},
    # a short micro-batch first in its window (a new shape: eager calls there): the next positions' graphs
    # read what an eager call made, and are captured again
    {"zero": 2, "dtype": "bf16", "accum": 3, "steps": 18, "sizes": [4] * 9 + [2] + [4] * 8},
    # accumulation 2, then 1 from the 10th micro-batch (`set_train_batch_size`): the loss's division changes
    {"zero": 1, "dtype": "fp16", "accum": 2, "steps": 14, "clip": 0.0, "regas": (10, 1)},
]


def test_zero_engine_step_trains_like_the_eager_engine():
    (reports,) = run_ranks(train_cases, 1, cases=ONE_RANK, timeout=180)
    for report in reports:
        check(report)


def test_zero_engine_step_on_two_ranks_trains_like_the_eager_engine():
    cases = [
        # ZeRO-2 reduce-scatters each micro-batch's gradients into the ranks' partitions, through its
        # contiguous buckets (`grad.data = bucket view`)
        {"zero": 2, "dtype": "bf16", "accum": 2, "steps": 8},
        {"zero": 1, "dtype": "fp16", "accum": 2, "steps": 10},
    ]
    for rank_reports in run_ranks(train_cases, 2, cases=cases, timeout=180):
        for report in rank_reports:
            check(report)


def test_what_cannot_be_captured_is_refused_with_deepspeeds_name_for_it():
    (found,) = run_ranks(refusals, 1, timeout=120)
    assert "ZeRO stage 3" in found["zero3"] and "stage 1 or 2" in found["zero3"], found
    assert "wall_clock_breakdown" in found["wall_clock"], found
    # What engine.step() made, read after it inside the step: refused at once (a replay would see the
    # capture's); between calls it is DeepSpeed's own.
    assert found["read_after_step"].startswith("ReadAfterStepError: engine.get_global_grad_norm()"), found
    assert found["norm_between_calls"] > 0, found
    # A plain graphstep.capture of the engine's step: refused, naming the integration; nothing lost.
    assert found["plain"] is not None and "capture_engine_step" in found["plain"], found
    assert found["counters_after_refusal"]["global_steps"] == found["counters_after_refusal"]["micro_steps"]
