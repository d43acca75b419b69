"""DeepSpeed (0.19.8) ZeRO-1/2 engines captured with graphstep.integrations.deepspeed on GPUs: CUDA graphs,
NCCL, deterministic mode, each against an eager twin engine on the same micro-batches (tests/deepspeed_workers.py):
every loss and parameter bitwise equal, and the loss scale, the learning rate (WarmupLR) and DeepSpeed's
counters (`global_steps`, `micro_steps`, `skipped_steps`, `global_samples`) the same.

DeepSpeed's fused ops are not built on the GPU machine (its wheel is built with DS_BUILD_OPS=0): the engines
use DeepSpeed's torch AdamW (`"torch_adam": true`). The captured engine is built by
`graphstep.integrations.deepspeed.initialize` (on graphstep's capture stream); the twin by `deepspeed.initialize`.
Each test starts its own processes (tests/ranks.py), one per GPU. Needs DeepSpeed on the path:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/stacks/site-packages .whl/*.whl
    PYTHONPATH=/tmp/stacks/site-packages:$PWD/src python -m pytest -q tests/gpu/test_deepspeed_gpu.py
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

# Found, not imported: DeepSpeed runs in the ranks' processes only (an import here would stay in the test
# process and slow every later capture's census of live objects).
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("needs DeepSpeed (pip install graphstep[deepspeed])", allow_module_level=True)

from deepspeed_workers import check, train_cases
from ranks import run_ranks

GPUS = torch.cuda.device_count()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]
TIMEOUT = 300
ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

ONE_GPU = [
    {"zero": 1, "dtype": "bf16", "accum": 1, "steps": 12},
    {"zero": 2, "dtype": "bf16", "accum": 1, "steps": 12},
    {"zero": 2, "dtype": "fp16", "accum": 1, "steps": 14},
    {"zero": 1, "dtype": "fp16", "accum": 2, "steps": 16},
    {
        "zero": 2,
        "dtype": "bf16",
        "accum": 3,
        "steps": 21,
        "sizes": [4] * 12 + [2] + [4] * 8,
    },  # short: 1st of its window
    {"zero": 2, "dtype": "fp32", "accum": 1, "steps": 10, "clip": 0.0},
]


def test_zero_engines_on_one_gpu_bitwise_equal_to_eager():
    (reports,) = run_ranks(
        train_cases, 1, backend="nccl", timeout=TIMEOUT, env=ENV, cases=ONE_GPU, device="cuda", warmup_steps=3
    )
    for report in reports:
        check(report)


@pytest.mark.multigpu
@pytest.mark.parametrize(
    "world",
    [
        pytest.param(2, id="2gpu", marks=pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")),
        pytest.param(4, id="4gpu", marks=pytest.mark.skipif(GPUS < 4, reason="needs four CUDA GPUs")),
    ],
)
def test_zero_engines_on_ranks_bitwise_equal_to_eager(world):
    cases = [
        {"zero": 2, "dtype": "bf16", "accum": 1, "steps": 12},
        {"zero": 1, "dtype": "bf16", "accum": 2, "steps": 12},
        {"zero": 2, "dtype": "bf16", "accum": 2, "steps": 12},
        {"zero": 2, "dtype": "fp16", "accum": 1, "steps": 14},
    ]
    reports = run_ranks(
        train_cases,
        world,
        backend="nccl",
        timeout=TIMEOUT,
        env=ENV,
        cases=cases,
        device="cuda",
        warmup_steps=3,
    )
    assert len(reports) == world
    for rank_reports in reports:
        for report in rank_reports:
            check(report)
