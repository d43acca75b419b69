"""Distributed steps on two GPUs with NCCL and real CUDA graphs (run on nvidia-h200-x2).

Each test starts its own two processes (tests/ranks.py) with a time limit, so a hang fails
the test instead of the suite. Bitwise tests run in deterministic mode; CUBLAS_WORKSPACE_CONFIG
is set by tests/gpu/conftest.py before the processes start, so they inherit it.
"""

from __future__ import annotations

import pytest
import torch

from dist_workers import (
    destroy_with_open_step,
    leave_step_open,
    one_more_collective,
    one_rank_changes,
    one_rank_raises,
    one_rank_syncs,
    train_pair,
)
from graphstep import distributed
from ranks import run_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
TIMEOUT = 240


def nccl(worker, **kwargs):
    return run_ranks(worker, 2, backend="nccl", timeout=TIMEOUT, **kwargs)


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_keep", "tp"])
def test_30_steps_bitwise_equal_to_eager(kind):
    reports = nccl(train_pair, kind=kind, steps=30)
    for rank, report in enumerate(reports):
        assert report["backend"] == "cuda"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert (
            report["stats"]["captures"] == 1
            and report["stats"]["replays"] >= 30 - distributed.DDP_WARMUP_STEPS
        )


def test_ddp_gradient_accumulation_with_no_sync():
    for rank, report in enumerate(nccl(train_pair, kind="ddp", steps=30, micro_batches=2)):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


def test_ddp_with_a_block_as_an_eager_segment_reduces_its_gradients_in_the_graph_after_it():
    for rank, report in enumerate(nccl(train_pair, kind="ddp", steps=30, segment=True)):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


def test_ddp_with_expandable_segments():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    reports = nccl(train_pair, kind="ddp", steps=20, env=env)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


@pytest.mark.parametrize("change", ["move", "shape"])
def test_a_change_on_one_rank_is_agreed_by_both(change):
    reports = nccl(one_rank_changes, change=change)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 2, f"rank {rank}: {report}"


def test_a_host_sync_on_one_rank_stops_both():
    rank0, rank1 = nccl(one_rank_syncs)
    assert rank0["stats"]["captures"] == rank1["stats"]["captures"] == 0
    assert len(rank0["errors"]) == len(rank1["errors"]) >= 1
    assert "on rank 1" in rank0["errors"][0] and "float(total)" in rank1["errors"][0]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_destroy_process_group_with_a_live_graph_returns(kind):
    for report in nccl(destroy_with_open_step, kind=kind):
        assert report == {"graphs_before": 1, "closed_after": True}


def test_a_step_left_open_at_exit_does_not_hang():
    reports = nccl(leave_step_open, kind="ddp", destroy=False)
    assert [r["graphs"] for r in reports] == [1, 1]


@pytest.mark.parametrize("mesh_shape", [(1, 2), (2, 1)], ids=["dp1xtp2", "dp2xtp1"])
def test_2d_mesh_fsdp_times_tensor_parallel_on_two_gpus(mesh_shape):
    """The 2-D code path on the GPUs there are; 2x2 needs four (issue 7)."""
    reports = nccl(train_pair, kind="fsdp_tp", steps=30, mesh_shape=mesh_shape)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


# -- no rank left hanging, mismatched collectives, with NCCL collectives inside real graphs --------


def test_a_step_failing_on_one_rank_while_capturing_fails_both_and_the_next_call_captures():
    """Rank 1 raises before its backward in the capture: rank 0 stops before its DDP all-reduce
    (captured, not executed, under CUDA), both raise CaptureError, then both capture."""
    call = distributed.DDP_WARMUP_STEPS + 1
    reports = nccl(one_rank_raises, failing=1, call=call, where="before", go_on="all")
    for rank, report in enumerate(reports):
        assert report["call"] == call - 1 and report["error"] == "CaptureError", f"rank {rank}: {report}"
        assert report["then"] == {"call": call, "error": None}, f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1
    assert "failed on rank 1" in reports[0]["message"] and "boom before backward" in reports[0]["message"]


def test_one_more_nccl_collective_on_one_rank_while_capturing_is_named_on_both():
    reports = nccl(one_more_collective, extra_on=1, when="capture", graphs="cuda")
    for rank, report in enumerate(reports):
        assert report["error"] == "CollectiveMismatchError", f"rank {rank}: {report}"
        assert "rank 1: collective #5: c10d.allreduce_ of [float32[1]]" in report["message"], report
        assert report["stats"]["captures"] == 0 and report["stats"]["replays"] == 0


def test_a_warmup_failing_on_one_rank_fails_both_in_the_same_call():
    reports = nccl(one_rank_raises, failing=1, call=3, where="before")
    assert reports[1]["error"] == "RuntimeError" and reports[1]["call"] == 2
    assert reports[0]["error"] == "RankFailedError" and reports[0]["call"] == 2
    assert "failed on rank 1" in reports[0]["message"]
