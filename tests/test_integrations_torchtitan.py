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
from titan_common import histc_on_cpu, run_pair


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


@pytest.fixture
def one_rank_cpu():
    """What the DeepSeek-V3 debug model needs on a CPU: a one-rank gloo group (its load-balancing hook asks
    for the meshes even on one rank); `torch.histc` of the router's int64 expert indices, which torch
    implements on CUDA only, counted in float32 (exact for these counts); deterministic kernels (its fp32
    scatter-adds differ from run to run otherwise, eager against eager)."""
    import torch
    import torch.distributed as dist

    from ranks import _free_port

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    was, was_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with histc_on_cpu():
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
        if made:
            dist.destroy_process_group()


def test_deepseek_v3_for_loop_experts_break_the_graph_and_train_bitwise(one_rank_cpu):
    """Without grouped GEMM (CPU), torchtitan's experts split their tokens by `num_tokens_per_expert.tolist()`.
    The recording backend once baked the capture's counts into every replay (silently wrong losses); now
    the read stops the capture and the experts module becomes a graph break: bitwise equal to eager."""
    report = run_pair(
        "deepseek_v3",
        "cpu",
        steps=5,
        config=graphstep.Config(backend="recording", warmup_steps=1),
        n_layers=2,  # layer 0 dense, layer 1 MoE
        seq_len=16,
    )
    assert report["first_bad_step"] is None, report
    assert not report["params_differ"], report
    assert report["stats"]["graph_breaks"] == 1, report
    assert report["segments"] == ["model.layers.1.moe.experts"] * 2, report  # its forward and its backward
