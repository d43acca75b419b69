"""Distributed steps on two and four GPUs with NCCL and real CUDA graphs (nvidia-h100-x2 / -x4).

Each test starts its own processes (tests/ranks.py), one per GPU it uses, with a time limit, so a
hang fails the test instead of the suite. Tests that run on 2 and on 4 ranks are parametrized by
world size (ids `2gpu`, `4gpu`); those needing more GPUs than the machine has are skipped. Bitwise
tests run in deterministic mode; CUBLAS_WORKSPACE_CONFIG is set by tests/gpu/conftest.py before the
processes start, so they inherit it. Run them all with scripts/gpu-check-distributed.sh.
"""

from __future__ import annotations

import pytest
import torch

from dist_break_workers import train_with_breaks
from dist_failure_workers import (
    graphs_after_a_ddp_reset,
    one_rank_exits_mid_run,
    one_rank_out_of_memory_at_capture,
)
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

GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.multigpu,
    pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs"),
]
TIMEOUT = 240
FOUR = pytest.mark.skipif(GPUS < 4, reason="needs four CUDA GPUs")
WORLDS = [pytest.param(2, id="2gpu"), pytest.param(4, id="4gpu", marks=FOUR)]
"""Tests that run on two ranks and on four: the world size, skipped beyond the GPUs present."""


def nccl(worker, world: int = 2, **kwargs):
    return run_ranks(worker, world, backend="nccl", timeout=TIMEOUT, **kwargs)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_keep", "tp"])
def test_30_steps_bitwise_equal_to_eager(kind, world):
    reports = nccl(train_pair, world, kind=kind, steps=30)
    assert len(reports) == world
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
    """Rank 0's capture succeeds, rank 1's syncs: rank 0 releases its graph, the last of its pool, and
    captures again on the next call, into a fresh pool (torch's pinned-memory allocator asserts on a
    capture into a pool whose graphs were all released: the failure on 2 x H200 of 2026-11-26)."""
    rank0, rank1 = nccl(one_rank_syncs)
    assert rank0["stats"]["captures"] == rank1["stats"]["captures"] == 0
    assert len(rank0["errors"]) == len(rank1["errors"]) >= 2  # captured again, and again stopped
    assert "on rank 1" in rank0["errors"][0] and "float(total)" in rank1["errors"][0]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_destroy_process_group_with_a_live_graph_returns(kind, world):
    for report in nccl(destroy_with_open_step, world, kind=kind):
        assert report == {"graphs_before": 1, "closed_after": True}


def test_a_step_left_open_at_exit_does_not_hang():
    reports = nccl(leave_step_open, kind="ddp", destroy=False)
    assert [r["graphs"] for r in reports] == [1, 1]


@pytest.mark.parametrize(
    "mesh_shape",
    [(1, 2), (2, 1), pytest.param((2, 2), marks=FOUR)],
    ids=["dp1xtp2", "dp2xtp1", "dp2xtp2"],
)
def test_2d_mesh_fsdp_times_tensor_parallel(mesh_shape):
    """FSDP2 x tensor parallel: the 2-D code path on two GPUs, the 2 x 2 mesh on four (issue 41)."""
    world = mesh_shape[0] * mesh_shape[1]
    reports = nccl(train_pair, world, kind="fsdp_tp", steps=30, mesh_shape=mesh_shape)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


# -- no rank left hanging, mismatched collectives, with NCCL collectives inside real graphs --------


@pytest.mark.parametrize("world", WORLDS)
def test_a_step_failing_on_one_rank_while_capturing_fails_all_then_all_capture_bitwise(world):
    """The last rank raises before its backward in the capture: the others stop before their DDP
    all-reduce (captured, not executed, under CUDA), all raise CaptureError; DDP rebuilds its buckets
    in the next two calls, as eager DDP did (other buckets sum over 4 ranks in another order), then
    all capture, bitwise equal to an eager twin that skipped the failed call's batch."""
    call, failing = distributed.DDP_WARMUP_STEPS + 1, world - 1
    reports = nccl(one_rank_raises, world, failing=failing, call=call, where="before", go_on="all", twin=True)
    for rank, report in enumerate(reports):
        assert report["call"] == call - 1 and report["error"] == "CaptureError", f"rank {rank}: {report}"
        assert report["then"] == {"call": call, "error": None} and "later" not in report, (
            f"rank {rank}: {report}"
        )
        assert report["stats"]["captures"] == 1 and report["stats"]["warmup_calls"] == call + 1
        assert report["params_equal"], f"rank {rank}: {report}"
    assert f"failed on rank {failing}" in reports[0]["message"]
    assert "boom before backward" in reports[0]["message"]


def test_one_more_nccl_collective_on_one_rank_while_capturing_is_named_on_both():
    reports = nccl(one_more_collective, extra_on=1, when="capture", graphs="cuda")
    for rank, report in enumerate(reports):
        assert report["error"] == "CollectiveMismatchError", f"rank {rank}: {report}"
        assert "rank 1: collective #5: c10d.allreduce_ of [float32[1]]" in report["message"], report
        assert report["stats"]["captures"] == 0 and report["stats"]["replays"] == 0


def test_a_warmup_failing_on_one_rank_fails_both_in_the_same_call():
    """Rank 1 fails in a warm-up; rank 0 stops before its all-reduce, in the same call. Then only
    rank 1 calls again: it waits in the vote until rank 0's process is gone. (With the group
    destroyed on rank 0, this hung on 2 x H200: NCCL's teardown waits for every rank, and rank 1 was
    waiting for rank 0 in the vote. So rank 0 returns without `destroy_process_group`.)"""
    reports = nccl(one_rank_raises, failing=1, call=3, where="before", destroy=False)
    assert reports[1]["error"] == "RuntimeError" and reports[1]["call"] == 2
    assert reports[0]["error"] == "RankFailedError" and reports[0]["call"] == 2
    assert "failed on rank 1" in reports[0]["message"]
    assert reports[1]["then"]["error"] == "RankFailedError" and "exited" in reports[1]["then"]["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_a_warmup_failing_on_one_rank_fails_all_in_the_same_call_and_all_go_on(world):
    """The last rank fails before its backward in a warm-up; the others stop before their all-reduce
    and raise in the same call; DDP is made usable on every rank, and every rank's next call works."""
    failing = world - 1
    reports = nccl(one_rank_raises, world, failing=failing, call=3, where="before", go_on="all")
    for rank, report in enumerate(reports):
        expected = "RuntimeError" if rank == failing else "RankFailedError"
        assert report["call"] == 2 and report["error"] == expected, f"rank {rank}: {report}"
        assert report["then"] == {"call": 3, "error": None}, f"rank {rank}: {report}"


@pytest.mark.parametrize("world", WORLDS)
def test_a_graph_captured_before_ddp_was_reset_is_captured_again(world):
    """One signature's graph holds the DDP buckets of its capture; another signature's capture stops on
    the last rank, DDP is reset and rebuilds its buckets (the old ones freed): the first signature's
    next call captures again on every rank instead of replaying into freed memory; bitwise equal to
    an eager DDP twin on every call."""
    reports = nccl(graphs_after_a_ddp_reset, world, failing=world - 1)
    for rank, report in enumerate(reports):
        warmups, first_small = report["warmups"], report["first_small_call"]
        assert report["errors"] == [{"call": first_small + warmups, "error": "CaptureError"}], report
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["captures_before_last"] == 2 and report["stats"]["captures"] == 3, report


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("captures", [1, 2])
def test_out_of_memory_at_capture_on_one_rank(captures, world):
    """The last rank allocates twice its GPU while its stream captures. Once: every rank runs that call
    as an eager step, warms up once more (DDP rebuilds its buckets), and captures; bitwise equal to eager. Twice in a row: every rank raises
    a CaptureError in the same call, loses nothing, and captures on the call after."""
    failing = world - 1
    reports = nccl(one_rank_out_of_memory_at_capture, world, failing=failing, captures=captures)
    warmups = distributed.DDP_WARMUP_STEPS
    for rank, report in enumerate(reports):
        assert report["backend"] == "cuda" and report["warmups"] == warmups
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        stats = report["stats"]
        # DDP rebuilds its buckets in the two eager calls after each reset: the call that ran
        # eagerly instead and one more warm-up; after the second capture's CaptureError, two more.
        extra = 2 if captures == 1 else 4
        assert stats["captures"] == 1 and stats["warmup_calls"] == warmups + extra, f"rank {rank}: {stats}"
        if captures == 1:
            assert report["errors"] == [], f"rank {rank}: {report['errors']}"
        else:
            (error,) = report["errors"]
            assert error["call"] == warmups + 2 and error["error"] == "CaptureError", error
            assert "out of memory" in error["message"] and "previous capture" in error["message"], error


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("at", ["warmup", "capture", "replay"])
def test_a_rank_that_exits_mid_run_stops_the_others_within_seconds(at, world):
    """The last rank's process ends in a warm-up's step, in the capture's, or between replays: every
    other rank raises RankFailedError naming it within seconds instead of waiting in NCCL."""
    leaving = world - 1
    reports = nccl(one_rank_exits_mid_run, world, exits=(leaving,), leaving=leaving, at=at, destroy=False)
    assert reports[leaving] == {"exitcode": 3}
    call = {"warmup": 2, "capture": distributed.DDP_WARMUP_STEPS, "replay": distributed.DDP_WARMUP_STEPS + 3}[
        at
    ]
    for rank, report in enumerate(reports[:leaving]):
        assert report["error"] == "RankFailedError" and report["call"] == call, f"rank {rank}: {report}"
        assert f"rank(s) [{leaving}]" in report["message"] and report["waited_s"] < 10, (
            f"rank {rank}: {report}"
        )


# -- automatic graph breaks with ranks ---------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sparse", ["every_rank", "last_rank"])
@pytest.mark.parametrize("kind", ["ddp"])
def test_automatic_graph_breaks_at_an_moe_layer_are_the_same_on_every_rank(kind, sparse, world):
    """An MoE layer's token dispatch reads its per-expert counts on the host (`bincount`, `int`, a Python
    loop over the experts): the capture stops inside it, on every rank or only on the last (the others'
    layers take a dense path with no host sync: their captures are stopped at a collective by the last
    rank's failure). Every rank breaks at both MoE layers (one break: every module of that class), warms
    up once more in the same call and captures on the next. Under DDP the break is the dispatch module
    with the experts' parameters (their gradients all-reduced in the graph after the segments' backward);
    Bitwise equal to eager on every rank, replays included. (With one bucket, as here, every DDP
    all-reduce is in the last graph.) FSDP2: `test_graph_breaks_under_fsdp2_are_the_same_on_every_rank_and_bitwise`."""
    steps = 20
    sparse_on = None if sparse == "every_rank" else (world - 1,)
    reports = nccl(train_with_breaks, world, kind=kind, sparse_on=sparse_on, steps=steps)
    where = "model.module.blocks.{}.moe"
    for rank, report in enumerate(reports):
        assert report["backend"] == "cuda" and report["error"] is None, f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["breaks"] == [where.format(0), where.format(1)], f"rank {rank}: {report}"
        stats = report["stats"]
        assert stats["graph_breaks"] == 1 and stats["captures"] == 1, f"rank {rank}: {stats}"
        # DDP, reset after the stopped capture, rebuilds its buckets in two calls
        assert stats["warmup_calls"] == report["warmups_needed"] + 2, f"rank {rank}: {stats}"
        assert stats["warmup_calls"] + stats["replays"] == steps, f"rank {rank}: {stats}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sparse", ["every_rank", "last_rank"])
def test_graph_breaks_under_fsdp2_are_the_same_on_every_rank_and_bitwise(sparse, world):
    """FSDP2 and a break at a module without parameters (the host sync in an MoE layer's `Combine`; the
    experts run densely in the graphs), on every rank or only the last: the break is made on every rank,
    the capture split by it keeps FSDP2's side streams and events inside each part
    (distributed/fsdp_parts.py; without that, CUDA refused the split capture on H100s, 2026-11-27), and
    training is bitwise equal to eager on every rank, replays included, with one capture."""
    steps = 10
    sparse_on = None if sparse == "every_rank" else (world - 1,)
    reports = nccl(train_with_breaks, world, kind="fsdp", sparse_on=sparse_on, steps=steps, combine=True)
    for rank, report in enumerate(reports):
        assert report["backend"] == "cuda" and report["error"] is None, f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["breaks"] == ["model.blocks.0.moe.combine", "model.blocks.1.moe.combine"], report
        stats = report["stats"]
        assert stats["graph_breaks"] == 1 and stats["captures"] == 1, f"rank {rank}: {stats}"
        assert stats["warmup_calls"] + stats["replays"] == steps and stats["replays"] > 0, (
            f"rank {rank}: {stats}"
        )


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_buckets_split_around_a_break_are_refused_with_the_way_out(world):
    """DDP with ~4 KiB buckets: a bucket is all-reduced in a backward graph before a segment's backward and
    waited for in a later graph. On 2 and 4 H100s (2026-11-27) that capture failed with "CUDA error:
    invalid argument"; not supported yet, so every rank raises a CaptureError in the same call, one
    naming the way out (one bucket), and nothing is lost."""
    reports = nccl(train_with_breaks, world, kind="ddp_buckets", steps=20)
    calls = {report["error"]["call"] for report in reports if report["error"] is not None}
    assert len(calls) == 1 and all(report["error"] is not None for report in reports), reports
    assert all(report["error"]["error"] == "CaptureError" for report in reports), reports
    assert any("bucket_cap_mb" in report["error"]["message"] for report in reports), reports
    for rank, report in enumerate(reports):  # the eager twin stopped before that call: nothing lost
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"


@pytest.mark.parametrize("world", WORLDS)
def test_a_break_at_a_module_holding_fsdp2_parameters_is_refused_on_every_rank(world):
    """The last rank's capture stops in an MoE layer whose experts FSDP2 gathers around it: no rank
    breaks, every rank raises the same CaptureError in the same call (saying why), nothing is lost
    (parameters equal to eager's before that call), and FSDP2 was reset on every rank: the same batch
    again captures again (not "mixed torch.Tensor and DTensor") and is refused again the same way."""
    reports = nccl(train_with_breaks, world, kind="fsdp", sparse_on=(world - 1,), steps=6, again=True)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["breaks"] == [] and report["stats"]["captures"] == 0, f"rank {rank}: {report}"
        error = report["error"]
        assert error is not None and error["error"] == "CaptureError", f"rank {rank}: {report}"
        assert error["call"] == report["warmups_needed"], f"rank {rank}: {report}"
        assert f"stopped on rank {world - 1} and no rank breaks" in error["message"], error
        assert "FSDP2 (fully_shard, unit model.blocks.0)" in error["message"], error
        assert error["then"] == {"error": "CaptureError", "message": error["message"]}, error
