"""Pipeline parallelism captured whole on two and four GPUs: NCCL sends and receives inside CUDA graphs.

Each test starts one process per GPU (tests/ranks.py) with a time limit. Every rank captures its
stage(s) of a `torch.distributed.pipelining` schedule's `step()` and the optimizer as one graph and is
compared bitwise, losses and parameters, with the same schedule run eagerly in the same processes, in
deterministic mode (CUBLAS_WORKSPACE_CONFIG from tests/gpu/conftest.py). The first send or receive
between two ranks makes NCCL's communicators for them: that happens in the warm-ups, never in the
capture. Tests needing more GPUs than the machine has are skipped.
"""

from __future__ import annotations

import pytest
import torch

import graphstep
from pipeline_workers import (
    eval_between_steps,
    outer_losses_list,
    p2p_differs_at_capture,
    stage_fails_mid_step,
    train_gpt_pipeline,
    train_pipeline,
)
from ranks import run_ranks

GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multigpu,
    pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs"),
]
FOUR = pytest.mark.skipif(GPUS < 4, reason="needs four CUDA GPUs")
TIMEOUT = 300
STEPS = 20


def nccl(worker, world: int, **kwargs):
    return run_ranks(worker, world, backend="nccl", timeout=TIMEOUT, **kwargs)


def _check(reports: list, world: int, steps: int = STEPS) -> None:
    assert len(reports) == world
    for rank, report in enumerate(reports):
        assert report["backend"] == "cuda", f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        stats = report["stats"]
        assert stats["captures"] == 1, f"rank {rank}: {stats}"
        assert stats["replays"] == steps - stats["warmup_calls"], f"rank {rank}: {stats}"


@pytest.mark.parametrize("world", [pytest.param(2, id="2gpu"), pytest.param(4, id="4gpu", marks=FOUR)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipelined_mlp_bitwise_equal_to_the_eager_schedule(schedule, world):
    """One stage per GPU (GPipe, 1F1B), two per GPU (interleaved 1F1B: 4 or 8 stages)."""
    _check(nccl(train_pipeline, world, schedule=schedule, steps=STEPS, graphs="cuda"), world)


@pytest.mark.parametrize("world", [pytest.param(2, id="2gpu"), pytest.param(4, id="4gpu", marks=FOUR)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipelined_gpt_bitwise_equal_to_the_eager_schedule(schedule, world):
    """The demo GPT split into stages as the benchmark runs it, AdamW, bf16 autocast."""
    reports = nccl(train_gpt_pipeline, world, schedule=schedule, steps=STEPS, graphs="cuda", amp=True)
    _check(reports, world)


@FOUR
@pytest.mark.parametrize("dp", ["fsdp", "replicate"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_stages_times_two_way_data_parallel(schedule, dp):
    """A (dp=2, pp=2) DeviceMesh: each stage sharded by FSDP2 or replicated (replicate, DDP's semantics
    on FSDP2's machinery, as torchtitan pairs with pipelining) over its data-parallel pair. The stages'
    collectives differ and interleave with the sends and receives: the ranks stop voting collective by
    collective at the first send and compare per group and per pair at the end of each call."""
    reports = nccl(train_gpt_pipeline, 4, schedule=schedule, steps=STEPS, graphs="cuda", dp=dp)
    _check(reports, 4)


def test_a_losses_list_made_outside_the_step_is_refused_on_both_ranks():
    rank0, rank1 = nccl(outer_losses_list, 2, graphs="cuda")
    warmups = graphstep.Config().warmup_steps
    assert rank1["error"] == "PythonWriteError" and rank1["call"] == warmups, rank1
    assert "Make the list inside the step" in rank1["message"], rank1
    assert rank0["error"] == "CaptureError" and "failed on rank 1" in rank0["message"], rank0


def test_a_receive_unlike_its_send_at_capture_is_refused_on_both_ranks():
    """NCCL sends and receives inside the capture execute nothing: only the comparison at the end of the
    capture can tell that rank 1 receives int32 where rank 0 sends float32."""
    warmups = graphstep.Config().warmup_steps
    for rank, report in enumerate(nccl(p2p_differs_at_capture, 2)):
        assert report["error"] == "CollectiveMismatchError" and report["call"] == warmups, (
            f"rank {rank}: {report}"
        )
        assert "rank 1 received 1 tensor (first: int32x4" in report["message"], report
        assert report["stats"]["captures"] == 0


def test_schedule_eval_between_captured_training_calls():
    """Replays after `schedule.eval()` keep the capture's receive buffers; the re-capture that a moved
    parameter asks for becomes one more warm-up (the schedule initialises its stages), then captures."""
    for rank, report in enumerate(nccl(eval_between_steps, 2, move_at=6)):
        assert report["errors"] == [], f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 2, f"rank {rank}: {report}"


def test_a_stage_failing_mid_call_is_reported_to_the_other_at_the_end_of_its_step():
    """Stage 0 raises before sending in a warm-up. With NCCL stage 1's host does not wait in its receive:
    it reaches the end of its step, where the vote tells it, and raises RankFailedError naming stage 0.
    (Its GPU keeps the unmatched receive queued: no destroy_process_group afterwards, as docs say.)"""
    rank0, rank1 = nccl(stage_fails_mid_step, 2, destroy=False)
    assert rank0["error"] == "RuntimeError" and rank0["message"] == "boom on stage 0", rank0
    assert rank1["error"] == "RankFailedError" and rank1["call"] == 1, rank1
    assert "failed on rank 0" in rank1["message"] and "boom on stage 0" in rank1["message"], rank1
