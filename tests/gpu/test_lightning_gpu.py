"""GraphStepCallback on a real GPU beyond AdamW: SGD + OneCycleLR (the update runs as an eager segment
with Lightning's closure in the graph), gradient accumulation, fused optimizers under 16-mixed, each
bitwise equal to plain Lightning in deterministic mode. The runs are those of
benchmarks/lightning_matrix.py (which runs the whole matrix); here a few rows are tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gpu_common import needs_cuda

pytestmark = [*needs_cuda, pytest.mark.timeout(300)]

pytest.importorskip("pytorch_lightning", reason="needs pytorch-lightning")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import lightning_matrix  # noqa: E402


@pytest.mark.parametrize(
    "case",
    [
        ("sgd_momentum", "one_cycle", "32-true", 1),
        ("sgd_nesterov", "one_cycle", "bf16-mixed", 1),
        ("adamw", "one_cycle", "bf16-mixed", 1),  # OneCycleLR cycles betas: AdamW's update as a segment
        ("adagrad", "warmup", "bf16-mixed", 1),
        ("sgd_momentum_fused", "one_cycle", "16-mixed", 1),
        ("sgd_nesterov", "one_cycle", "32-true", 2),
        ("adamw", "cosine", "bf16-mixed", 3),
        ("adamw_fused", "one_cycle", "16-mixed", 2),
    ],
    ids=lambda c: "-".join(map(str, c)),
)
def test_lightning_recipe_bitwise_equal_to_plain_lightning(case):
    row = lightning_matrix.run_case(case, steps=12)
    print(f"\n{row}")
    assert row["result"] == "equal", row
    accumulate = case[3]
    kinds = {1: 1, 2: 2}.get(accumulate, 3)  # one graph per kind of micro-batch
    assert row["stats"]["captures"] == kinds and row["stats"]["replays"] > 0, row
