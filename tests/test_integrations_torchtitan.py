"""torchtitan (0.2.2) under graphstep on the CPU's recording backend: docs/frameworks.md's recipe as written.

torchtitan's Llama 3 debug model (cut to 2 layers, 16 tokens: CPU time), built, parallelized and trained
with torchtitan's own train spec (tests/titan_common.py): the captured step is bitwise torchtitan's eager
step, loss, gradient norm and every parameter, while the lr warm-up changes the learning rate every step.
Skipped where torchtitan is not installed (`pip install graphstep[torchtitan]`; `make test` leaves it out:
its `datasets` dependency pulls pyarrow and pandas). The GPU tests: tests/gpu/test_torchtitan_gpu.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3", reason="needs torchtitan (pip install graphstep[torchtitan])")

import graphstep
from titan_common import run_pair


@pytest.mark.parametrize("ac", ["none", "full"])
def test_llama3_debug_model_recipe_bitwise_equal_to_eager(ac):
    report = run_pair(
        "llama3",
        "cpu",
        steps=4,
        config=graphstep.Config(backend="recording", warmup_steps=1),
        n_layers=2,
        seq_len=16,
        ac=ac,
    )
    assert report["first_bad_step"] is None, report
    assert not report["params_differ"], report
    stats = report["stats"]
    # a warm-up, the capture (the recording backend's capture runs the step), two replays
    assert stats["captures"] == 1 and stats["replays"] == 2 and stats["graph_breaks"] == 0, stats
    assert stats["eager_calls"] == 0 and report["segments"] == [], report  # AdamW's step is in the graph
    assert len(set(report["losses"])) == 4  # it trained: every step's loss differs
