"""Pipeline parallelism (`torch.distributed.pipelining`) captured whole, on CPU over gloo.

Each rank's step runs its stage(s) through a schedule's `step()` (micro-batches, sends and receives
between stages, the loss collected on the last stage) and the optimizer; graphstep captures it on every
rank. Plain pipelines run on the recording backend (the CPU stand-in for a graph: a replay re-runs the
recorded operations, the waits on sends and receives in their place); the 2 x 2 mesh with FSDP2 on each
stage on the eager backend, as the other FSDP2 tests on CPU. Every result is compared bitwise with the
same schedule run eagerly in the same processes. tests/gpu/test_pipelining_gpu.py runs the same workers
on GPUs with NCCL and CUDA graphs.
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

import graphstep
from graphstep.distributed import p2p
from pipeline_workers import (
    eval_between_steps,
    outer_losses_list,
    p2p_differs_at_capture,
    stage_fails_mid_step,
    train_gpt_pipeline,
    train_pipeline,
)
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize(
    ("schedule", "model"),
    [("gpipe", "mlp"), ("1f1b", "gpt"), ("interleaved", "mlp")],
    ids=["gpipe", "1f1b", "interleaved"],
)
def test_a_pipelined_step_is_captured_whole_and_equals_the_eager_schedule(schedule, model):
    """GPipe and 1F1B: one stage per rank; interleaved 1F1B: four stages over two ranks. 1F1B runs the
    demo GPT split into stages as the benchmark does (graphstep.bench.pipeline), the others an MLP."""
    worker = train_gpt_pipeline if model == "gpt" else train_pipeline
    reports = run_ranks(worker, 2, schedule=schedule, steps=5, graphs="recording")
    warmups = graphstep.Config().warmup_steps
    for rank, report in enumerate(reports):
        assert report["backend"] == "recording"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        stats = report["stats"]
        assert stats["warmup_calls"] == warmups and stats["captures"] == 1, f"rank {rank}: {stats}"
        assert stats["replays"] == 5 - warmups - 1, f"rank {rank}: {stats}"


def test_two_stages_times_two_way_fsdp_on_four_ranks():
    """Each stage sharded by FSDP2 over its data-parallel pair: the stages' all-gathers and
    reduce-scatters differ and interleave with the sends and receives, so ranks stop voting collective
    by collective at the first send (a vote would wait for a peer that waits in a receive)."""
    reports = run_ranks(train_pipeline, 4, schedule="1f1b", steps=5, graphs="eager", dp="fsdp", timeout=120)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1, f"rank {rank}: {report}"


def test_a_losses_list_made_outside_the_step_is_refused_on_every_rank():
    rank0, rank1 = run_ranks(outer_losses_list, 2)
    warmups = graphstep.Config().warmup_steps
    assert rank1["error"] == "PythonWriteError" and rank1["call"] == warmups, rank1
    assert "losses=kept" in rank1["message"] and "Make the list inside the step" in rank1["message"]
    assert rank0["error"] == "CaptureError" and rank0["call"] == warmups, rank0
    assert "failed on rank 1" in rank0["message"]
    assert rank0["stats"]["captures"] == rank1["stats"]["captures"] == 0


def test_a_receive_unlike_its_send_at_capture_is_refused_on_every_rank():
    """Rank 1 receives rank 0's float32 numbers as int32 while capturing only (same bytes: nothing fails
    on the wire, a replay would feed it garbage): the ranks compare what they exchanged at the end of
    the capture, and both refuse it, naming the pair."""
    warmups = graphstep.Config().warmup_steps
    for rank, report in enumerate(run_ranks(p2p_differs_at_capture, 2)):
        assert report["error"] == "CollectiveMismatchError" and report["call"] == warmups, (
            f"rank {rank}: {report}"
        )
        message = report["message"]
        assert "rank 0 sent 1 tensor (first: float32x4" in message, message
        assert "rank 1 received 1 tensor (first: int32x4" in message, message
        assert report["stats"]["captures"] == 0 and report["stats"]["replays"] == 0


def test_a_stage_failing_mid_call_on_gloo_is_bounded_by_the_vote_timeout():
    """Stage 0 raises before sending in its second call. With gloo, stage 1 waits in its receive (the host
    blocks there) and never votes: stage 0 gives up after GRAPHSTEP_VOTE_TIMEOUT and raises its own error;
    its process ends, which ends stage 1's receive with gloo's error. (With NCCL the host does not wait
    in a receive: stage 1 reaches the end of its step and both learn it there, tests/gpu.)"""
    env = {"GRAPHSTEP_VOTE_TIMEOUT": "2"}
    rank0, rank1 = run_ranks(stage_fails_mid_step, 2, env=env, destroy=False, timeout=60)
    assert rank0["error"] == "RuntimeError" and rank0["message"] == "boom on stage 0", rank0
    assert rank0["call"] == rank1["call"] == 1 and rank0["waited_s"] < 20, rank0
    assert rank1["error"] is not None and rank1["waited_s"] < 20, rank1


# -- the end-of-call comparison of a pipelined step's communication (no processes) ---------------


def _summary(rank: int, sends: dict, recvs: dict, groups: dict) -> str:
    log = p2p.CommLog(rank)
    for peer, shapes in sends.items():
        log._sequences[f"{rank}>{peer}"] = shapes
    for peer, shapes in recvs.items():
        log._sequences[f"{peer}>{rank}"] = shapes
    for group, keys in groups.items():
        log._sequences[f"group {group}"] = keys
    return log.summary()


def test_matching_sends_receives_and_group_collectives_pass():
    texts = [
        _summary(0, {1: ["float32[2, 16]"] * 4}, {1: ["float32[2, 16]"] * 4}, {"0,2": ["ag", "rs"]}),
        _summary(1, {0: ["float32[2, 16]"] * 4}, {0: ["float32[2, 16]"] * 4}, {"1,3": ["ag"]}),
        _summary(2, {}, {}, {"0,2": ["ag", "rs"]}),
        _summary(3, {}, {}, {"1,3": ["ag"]}),
    ]
    assert p2p.mismatch(texts) is None


def test_a_receive_unlike_its_send_is_named_by_pair():
    texts = [
        _summary(0, {1: ["float32[2, 16]"] * 4}, {}, {}),
        _summary(1, {}, {0: ["float32[2, 16]"] * 3 + ["float32[2, 8]"]}, {}),
    ]
    found = p2p.mismatch(texts)
    assert found is not None and "rank 0 sent to rank 1" in found and "4 tensors" in found, found


def test_a_group_member_with_other_collectives_is_named():
    texts = [_summary(0, {}, {}, {"0,1": ["ag", "rs"]}), _summary(1, {}, {}, {"0,1": ["ag"]})]
    found = p2p.mismatch(texts)
    assert found is not None and "group 0,1" in found and "rank 1: 1 collective (" in found, found
    assert json.loads(texts[0])["group 0,1"][0] == 2


def test_schedule_eval_between_captured_training_calls():
    """`schedule.eval()` (eager, outside the step) before call 5 makes the next training call initialise
    the stages again eagerly (new receive buffers, a host exchange of shapes); the replays keep the
    capture's buffers, which hold the same shapes, and equal eager. A parameter moved before call 6 asks
    for a capture: the schedule would initialise its stages in it, so that call is one more warm-up (on
    every rank) and the next captures."""
    for rank, report in enumerate(run_ranks(eval_between_steps, 2, move_at=6)):
        assert report["errors"] == [], f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        stats = report["stats"]
        warmups = graphstep.Config().warmup_steps
        assert stats["captures"] == 2 and stats["warmup_calls"] == warmups + 1, f"rank {rank}: {stats}"
        assert stats["replays"] == 2, f"rank {rank}: {stats}"


class _Stage:
    def __init__(self, has_backward: bool):
        self.has_backward = has_backward


class _Schedule:
    """The attributes `p2p.initialises` reads of a single-stage schedule, as torch 2.11 leaves them."""

    def __init__(self, *, forward: bool, backward: bool, stage_backward: bool):
        self._stage_forward_initialized, self._stage_backward_initialized = forward, backward
        self._has_backward = True
        self._stage = _Stage(stage_backward)


@pytest.mark.parametrize(
    ("forward", "backward", "stage_backward", "expected"),
    [
        (False, False, False, True),  # the first call: shapes exchanged on the host
        (True, False, True, True),  # after eval() on torch 2.13: backward set up again
        (True, True, False, True),  # after eval() on torch 2.11: the stage's flag left False
        (True, True, True, False),  # a training call after training calls
    ],
)
def test_a_call_that_sets_up_a_stage_again_is_one_more_warm_up(forward, backward, stage_backward, expected):
    """`p2p.initialises`: whether the schedule's next step would write its stages' set-up (a capture would
    refuse the write; graphstep makes that call one more warm-up). torch 2.11 keeps the stages initialised
    across `schedule.eval()` but leaves each stage's `has_backward` False until the next step."""
    schedule = _Schedule(forward=forward, backward=backward, stage_backward=stage_backward)
    assert p2p.initialises(schedule) is expected
