"""Distributed coordination on CPU: 2 and 4 processes over gloo.

Collectives run eagerly here (the eager backend, or the recording backend for steps without
collectives); what is tested is that ranks warm up, capture, re-capture and refuse together,
that every step is still exactly the eager one, and that nothing hangs. The same workers run
on two GPUs with NCCL and real graphs in tests/gpu/test_distributed_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import graphstep
from dist_break_workers import train_with_breaks
from dist_failure_workers import (
    graphs_after_a_ddp_reset,
    one_rank_exits_mid_run,
    one_rank_out_of_memory_at_capture,
)
from dist_workers import (
    agree_at_random,
    destroy_with_open_step,
    dtensor_grad_references,
    dtensor_shard_replaced,
    leave_step_open,
    nccl_graph_registration,
    one_more_collective,
    one_rank_changes,
    one_rank_exits,
    one_rank_is_late,
    one_rank_raises,
    one_rank_syncs,
    train_pair,
)
from graphstep import distributed
from graphstep.errors import GraphStepError
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "fsdp_keep", "tp"])
def test_parallel_training_matches_eager_on_every_rank(kind):
    reports = run_ranks(train_pair, 2, kind=kind, steps=14)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["backend"] == "eager"
    stats = [r["stats"] for r in reports]
    warmups = distributed.DDP_WARMUP_STEPS if kind == "ddp" else graphstep.Config().warmup_steps
    assert stats[0]["warmup_calls"] == stats[1]["warmup_calls"] == warmups
    assert stats[0]["captures"] == stats[1]["captures"] == 1


def test_ddp_gradient_accumulation_with_no_sync():
    for rank, report in enumerate(run_ranks(train_pair, 2, kind="ddp", steps=13, micro_batches=2)):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


def test_ddp_with_a_block_as_an_eager_segment_on_the_autograd_path():
    for rank, report in enumerate(run_ranks(train_pair, 2, kind="ddp", steps=13, segment=True)):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1


def test_2d_mesh_fsdp_times_tensor_parallel_on_four_ranks():
    reports = run_ranks(train_pair, 4, kind="fsdp_tp", steps=8, mesh_shape=(2, 2), timeout=180)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
    assert {r["stats"]["captures"] for r in reports} == {1}


def test_a_change_on_one_rank_recaptures_on_every_rank():
    reports = run_ranks(one_rank_changes, 2, change="move")
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 2, f"rank {rank} did not re-capture with the other: {report}"


def test_the_recapture_limit_reached_on_one_rank_stops_every_rank():
    reports = run_ranks(one_rank_changes, 2, change="move", max_recaptures=0)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1 and report["stats"]["eager_calls"] == 6, (
            f"rank {rank}: {report}"
        )


def test_a_value_churning_on_one_rank_makes_every_rank_step_eagerly_with_it():
    """Rank 1's step reads a loss scale that changes on calls 6-10: it captures two variants (rank 0
    captures again with it), then runs eagerly until the value holds still, and rank 0 steps eagerly
    with it rather than replaying alone; then both capture and replay again."""
    reports = run_ranks(one_rank_changes, 2, change="churn", steps=14)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
    rank0, rank1 = (r["stats"] for r in reports)
    assert rank1["churn_calls"] >= 2 and rank0["churn_calls"] == 0, (rank0, rank1)
    assert rank0["eager_calls"] == rank1["eager_calls"] == rank1["churn_calls"], (rank0, rank1)
    assert rank0["captures"] == rank1["captures"] == 4 and rank0["replays"] == rank1["replays"], (
        rank0,
        rank1,
    )


def test_a_new_shape_on_one_rank_holds_the_others_back_until_it_can_capture():
    reports = run_ranks(one_rank_changes, 2, change="shape")
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
    rank0, rank1 = (r["stats"] for r in reports)
    warmups = graphstep.Config().warmup_steps
    # Rank 1 warms its new shape up; rank 0 meanwhile steps eagerly with the graph it has, then
    # captures again when rank 1 captures. 12 calls each, one step per call (the recording
    # backend's captures execute the step; a CUDA capture is followed by a replay instead).
    assert rank1["warmup_calls"] == 2 * warmups and rank1["captures"] == 2
    assert rank0["warmup_calls"] == warmups and rank0["eager_calls"] == warmups and rank0["captures"] == 2
    for s in (rank0, rank1):
        assert s["warmup_calls"] + s["eager_calls"] + s["captures"] + s["replays"] == 12


def test_a_host_sync_on_one_rank_stops_every_rank_from_capturing():
    reports = run_ranks(one_rank_syncs, 2)
    rank0, rank1 = reports
    assert rank0["stats"]["captures"] == rank1["stats"]["captures"] == 0
    assert len(rank0["errors"]) == len(rank1["errors"]) >= 1
    assert "on rank 1" in rank0["errors"][0]
    assert "dist_workers.py" in rank1["errors"][0] and "float(total)" in rank1["errors"][0]


def test_a_replaced_dtensor_shard_needs_no_capture_on_the_eager_backend():
    # On CPU the step runs on the eager backend, which bakes nothing: the replaced shard is simply
    # used (on CUDA, where graphs bake addresses, the guard reads through the DTensor and captures again).
    for report in run_ranks(dtensor_shard_replaced, 2):
        assert report["stats"]["captures"] == 1


def test_a_rank_imports_graphstep_after_its_environment_is_set():
    """With expandable segments, importing graphstep turns NCCL's graph registration off: only if the
    rank's environment is in place first (the harness imports the worker's module after setting it)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert run_ranks(nccl_graph_registration, 2, env=env) == ["0", "0"]


def test_optimizer_state_holding_a_dtensor_gradient_is_found_through_its_shard():
    for report in run_ranks(dtensor_grad_references, 2):
        assert report["dtensor"] == "DTensor" and report["before"] == []
        assert len(report["after"]) == 1 and report["after"][0].endswith("['last_grad']"), report


def test_destroy_process_group_closes_live_steps_first():
    for report in run_ranks(destroy_with_open_step, 2, kind="ddp"):
        assert report == {"graphs_before": 1, "closed_after": True}


def test_a_step_left_open_does_not_hang_exit():
    reports = run_ranks(leave_step_open, 2, kind="ddp", destroy=False)
    assert [r["graphs"] for r in reports] == [1, 1]


def test_a_rank_past_max_graphs_runs_eagerly_and_the_others_with_it():
    """Rank 1's new shape finds no room (max_graphs=1): it runs eagerly, and it still votes, so
    rank 0 steps eagerly with it instead of replaying alone."""
    reports = run_ranks(one_rank_changes, 2, change="shape", max_graphs=1)
    for rank, report in enumerate(reports):
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
    rank0, rank1 = (r["stats"] for r in reports)
    assert rank0["eager_calls"] == rank1["eager_calls"] == 6 and rank0["captures"] == rank1["captures"] == 1


# -- automatic graph breaks with ranks: every rank breaks at the same modules -----------------------


def test_graph_breaks_with_ranks_are_the_union_of_every_rank_s_and_replay_bitwise():
    """Two MoE layers of different classes whose token dispatch reads counts on the host, rank 0 in the
    second layer only, rank 1 in the first: each rank's capture stops in another module, and every rank
    makes both breaks (the union), warms up once more in the same call, captures on the next and
    replays; bitwise equal to eager on every rank. (No collective in the step: the recording backend
    replays none. A break found on one rank only, under DDP and FSDP2: below; on GPUs, with replays:
    tests/gpu/test_distributed_gpu.py.)"""
    reports = run_ranks(train_with_breaks, 2, kind="plain", crossed=True)
    for rank, report in enumerate(reports):
        assert report["backend"] == "recording" and report["error"] is None, f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["breaks"] == ["model.blocks.0.moe", "model.blocks.1.moe"], f"rank {rank}: {report}"
        stats = report["stats"]
        assert stats["graph_breaks"] == 2 and stats["captures"] == 1, f"rank {rank}: {stats}"
        assert stats["warmup_calls"] == report["warmups_needed"] + 1, f"rank {rank}: {stats}"
        assert stats["replays"] == 6 - stats["warmup_calls"] - 1, f"rank {rank}: {stats}"


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_graph_break_under_ddp_or_fsdp2_found_on_one_rank_is_made_on_every_rank(kind):
    """Only rank 1's MoE layers read counts on the host: its capture stops there; rank 0's is stopped at
    its next collective (DDP's all-reduce, FSDP2's all-gather) by rank 1's failure. Both break at the
    same modules (under DDP the MoE layers; under FSDP2 their `Combine`, which holds no parameters), DDP
    and FSDP2 are reset (both ranks stopped mid-step), both warm up once more in that call and capture
    on the next (DDP: on the one after, its buckets rebuilt in between): bitwise equal to eager. Up to
    that capture only (the recording backend replays no collective: the GPU tests replay)."""
    warmups = distributed.DDP_WARMUP_STEPS if kind == "ddp" else graphstep.Config().warmup_steps
    fsdp = kind == "fsdp"
    extra = 1 if fsdp else 2
    steps = warmups + extra + 1
    reports = run_ranks(train_with_breaks, 2, kind=kind, sparse_on=(1,), steps=steps, combine=fsdp)
    where = "model.blocks.{}.moe.combine" if fsdp else "model.module.blocks.{}.moe"
    for rank, report in enumerate(reports):
        assert report["error"] is None and report["losses_equal"] and report["params_equal"], report
        assert report["breaks"] == [where.format(0), where.format(1)], f"rank {rank}: {report}"
        stats = report["stats"]
        assert stats["graph_breaks"] == 1 and stats["captures"] == 1, f"rank {rank}: {stats}"
        assert stats["warmup_calls"] == warmups + extra and stats["replays"] == 0, f"rank {rank}: {stats}"


@pytest.mark.parametrize("why", ["breaks_off", "fsdp_parameters"])
def test_no_break_with_ranks_stops_every_rank_in_the_same_call_and_loses_nothing(why):
    """Rank 1's capture stops in an MoE layer and no break is made: graph breaks are off, or the layer
    holds parameters FSDP2 gathers around it (as a segment between graphs, it would not find them
    gathered in a replay). Every rank raises in the same call, with the reason; nothing of it is kept,
    and the same batch again is refused again the same way (FSDP2, reset, captures again)."""
    kind, breaks = ("plain", "off") if why == "breaks_off" else ("fsdp", "auto")
    reports = run_ranks(
        train_with_breaks, 2, kind=kind, sparse_on=(1,), graph_breaks=breaks, steps=5, again=True
    )
    for rank, report in enumerate(reports):
        assert report["breaks"] == [] and report["stats"]["captures"] == 0, f"rank {rank}: {report}"
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        error = report["error"]
        assert error is not None and error["call"] == report["warmups_needed"], f"rank {rank}: {report}"
        if why == "breaks_off":
            assert error["error"] == "HostSyncError", f"rank {rank}: {report}"
        else:
            assert error["error"] == "CaptureError", f"rank {rank}: {report}"
            assert "stopped on rank 1 and no rank breaks" in error["message"], error
            assert "FSDP2 (fully_shard, unit model.blocks.0)" in error["message"], error
        assert error["then"] == {"error": error["error"], "message": error["message"]}, error
    if why == "breaks_off":
        assert "on rank 1" in reports[0]["error"]["message"]


@pytest.mark.parametrize("vote", ["shm", "gloo"])
def test_both_votes_agree_on_the_least_advanced_phase(vote):
    reports = run_ranks(agree_at_random, 3, env=_vote_env(vote))
    for board, wrong in reports:
        assert board == {"shm": "shared memory", "gloo": "gloo"}[vote]
        assert wrong == [], wrong


# -- no rank left hanging, mismatched collectives (4 ranks) -------------------------------------

CAPTURE_RUN = distributed.DDP_WARMUP_STEPS + 1  # the step function's run that a DDP capture makes


@pytest.mark.parametrize("vote", ["shm", "gloo"])
def test_a_step_failing_on_one_rank_while_capturing_fails_every_rank(vote):
    """Rank 2 raises before its backward while the others are about to all-reduce gradients with
    it: they stop before that collective, and every rank raises a CaptureError. Nothing was kept,
    so the ranks are still in step; DDP rebuilds its buckets in the next two calls (eager), and
    the third captures on every rank."""
    reports = run_ranks(
        one_rank_raises,
        4,
        failing=2,
        call=CAPTURE_RUN,
        where="before",
        go_on="all",
        env=_vote_env(vote),
        timeout=240,
    )
    for rank, report in enumerate(reports):
        assert report["call"] == CAPTURE_RUN - 1, f"rank {rank}: {report}"
        assert report["error"] == "CaptureError", f"rank {rank}: {report}"
        assert report["then"] == {"call": CAPTURE_RUN, "error": None}, f"rank {rank}: {report}"
        assert "later" not in report, f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1 and report["stats"]["warmup_calls"] == CAPTURE_RUN + 1
    assert "boom before backward on rank 2" in reports[2]["message"]
    for rank in (0, 1, 3):
        message = reports[rank]["message"]
        assert "failed on rank 2" in message and "boom before backward" in message, message


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_warmup_failing_on_one_rank_fails_every_rank_in_the_same_call(where):
    """Before its backward, rank 2 leaves the others about to all-reduce with it; after, they
    finish their step. Either way every rank raises in that call, and no rank goes on."""
    reports = run_ranks(one_rank_raises, 4, failing=2, call=3, where=where, timeout=240)
    assert reports[2]["error"] == "RuntimeError" and reports[2]["call"] == 2
    for rank in (0, 1, 3):
        report = reports[rank]
        assert report["call"] == 2 and report["error"] == "RankFailedError", f"rank {rank}: {report}"
        assert "failed on rank 2" in report["message"] and f"boom {where} backward" in report["message"]
        assert report["stats"]["captures"] == 0


def test_a_replay_failing_on_one_rank_makes_every_rank_refuse_the_next_call():
    """A failure after the vote (here in a replay of the eager backend, after the all-reduce)
    cannot stop the others' call: the next vote carries it, and every rank refuses that call."""
    reports = run_ranks(one_rank_raises, 4, failing=2, call=CAPTURE_RUN + 2, where="after", timeout=240)
    assert reports[2]["error"] == "RuntimeError" and reports[2]["call"] == CAPTURE_RUN + 1
    assert reports[2]["then"]["error"] == "RankFailedError" and reports[2]["then"]["call"] == CAPTURE_RUN + 2
    assert "this rank's previous call" in reports[2]["then"]["message"]
    for rank in (0, 1, 3):
        report = reports[rank]
        assert report["call"] == CAPTURE_RUN + 2 and report["error"] == "RankFailedError", report
        assert "rank 2's previous call" in report["message"] and "boom after backward" in report["message"]


@pytest.mark.parametrize("backend", ["recording", "eager"])
def test_one_more_collective_on_one_rank_while_capturing_is_named_on_every_rank(backend):
    reports = run_ranks(one_more_collective, 4, extra_on=3, when="capture", graphs=backend, timeout=240)
    warmups = graphstep.Config().warmup_steps
    for report in reports:
        assert report["call"] == warmups and report["error"] == "CollectiveMismatchError", report
        message = report["message"]
        assert "while capturing" in message and "collective #5" in message, message
        assert "rank 3: collective #5: c10d.allreduce_ of [float32[1]]" in message, message
        assert "dist_workers.py" in message and "dist.all_reduce(torch.ones(1" in message, message
        assert "ranks 0, 1, 2: none: the step ended after 4 collectives" in message, message
        assert report["stats"]["captures"] == 0 and report["stats"]["replays"] == 0


def test_one_more_collective_on_every_call_is_found_at_the_first_warmup():
    reports = run_ranks(one_more_collective, 4, extra_on=3, when="always", graphs="recording", timeout=240)
    for report in reports:
        assert report["call"] == 0 and report["error"] == "CollectiveMismatchError", report
        assert "while running" in report["message"] and "restore a checkpoint" in report["message"]


@pytest.mark.parametrize("vote", ["shm", "gloo"])
def test_a_rank_that_exits_stops_the_others_at_the_next_vote(vote):
    reports = run_ranks(one_rank_exits, 4, exits=(2,), leaving=2, after=4, env=_vote_env(vote), timeout=240)
    assert reports[2] == {"exitcode": 3}
    for rank in (0, 1, 3):
        report = reports[rank]
        assert report["call"] == 4 and report["error"] == "RankFailedError", f"rank {rank}: {report}"
        assert ("rank(s) [2]" in report["message"]) if vote == "shm" else ("gloo" in report["message"])


def test_a_rank_that_never_arrives_is_named_after_the_vote_timeout():
    reports = run_ranks(
        one_rank_is_late, 4, late=1, after=4, sleep=8.0, env={"GRAPHSTEP_VOTE_TIMEOUT": "2"}, timeout=240
    )
    for rank in (0, 2, 3):
        report = reports[rank]
        assert report["call"] == 4 and report["error"] == "RankFailedError", f"rank {rank}: {report}"
        assert "rank(s) [1] did not reach graphstep's vote within 2 s" in report["message"]
    assert reports[1]["error"] == "RankFailedError" and "exited" in reports[1]["message"]


def test_a_rank_that_exits_in_the_middle_of_a_step_stops_the_others_within_seconds():
    """Rank 1 exits before its backward in a warm-up: rank 0, about to all-reduce with it, stops at
    that collective's vote once it sees the process gone (instead of waiting in the all-reduce)."""
    rank0, rank1 = run_ranks(one_rank_exits_mid_run, 2, exits=(1,), leaving=1, at="warmup", destroy=False)
    assert rank1 == {"exitcode": 3}
    assert rank0["call"] == 2 and rank0["error"] == "RankFailedError", rank0
    assert "rank(s) [1]" in rank0["message"] and rank0["waited_s"] < 10, rank0


def test_out_of_memory_at_capture_on_one_rank_steps_every_rank_eagerly_then_raises_on_every_rank():
    """Rank 1 runs out of memory in its capture (the recording backend; the eager backend retries no
    failed call, its capture being an eager step): every rank runs that call as an eager step (no error)
    and captures on the next; that one runs out of memory too, so every rank raises a CaptureError in
    the same call; the same batch again captures. Bitwise equal to eager throughout. (One failed
    capture only: tests/gpu/test_distributed_gpu.py, for real.)"""
    reports = run_ranks(one_rank_out_of_memory_at_capture, 2, failing=1, captures=2)
    warmups = graphstep.Config().warmup_steps
    for rank, report in enumerate(reports):
        assert report["backend"] == "recording" and report["warmups"] == warmups
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        assert report["stats"]["captures"] == 1 and report["stats"]["warmup_calls"] == warmups + 1, report
        (error,) = report["errors"]
        assert error["call"] == warmups + 1 and error["error"] == "CaptureError", error
        assert "ran out of memory" in error["message"] and "previous capture" in error["message"], error
    assert "failed on rank 1" in reports[0]["errors"][0]["message"]


def _vote_env(vote: str) -> dict[str, str]:
    return {"GRAPHSTEP_VOTE": "gloo"} if vote == "gloo" else {}


# -- NCCL graph registration with expandable segments -----------------------------------------


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128,expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("", False),
    ],
)
def test_expandable_segments_is_read_from_the_allocator_config(monkeypatch, conf, expected):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert distributed.expandable_segments() is expected


def test_nccl_graph_registration_is_turned_off_with_expandable_segments(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "unset after the test")
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")
    distributed.set_nccl_graph_registration()
    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"


def test_nccl_graph_registration_left_on_by_the_user_is_refused(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    distributed.set_nccl_graph_registration()  # the user's explicit choice is not overridden...
    assert os.environ["NCCL_GRAPH_REGISTER"] == "1"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(GraphStepError, match="NCCL_GRAPH_REGISTER=0") as info:  # ...but refused
        distributed.check_nccl_graph_registration(None)
    assert "158029" in str(info.value)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    distributed.check_nccl_graph_registration(None)


def test_process_group_without_torch_distributed_is_a_clear_error():
    assert not dist.is_initialized()
    step = graphstep.capture(lambda x: x * 2, process_group=object())
    for _ in range(2):  # and again: the refusal does not leave a half-set-up step behind
        with pytest.raises(GraphStepError, match="init_process_group"):
            step(torch.ones(2))


def test_a_single_process_needs_no_vote():
    assert distributed.ranks_for(None) is None


def test_ddp_needs_eleven_warmups_and_stops_sampling_timings():
    model = torch.nn.Linear(2, 2)
    assert not distributed.prepare_ddp([model])

    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module = module
            self.rate = None

        def _set_ddp_runtime_logging_sample_rate(self, rate):
            self.rate = rate

    wrapped = FakeDDP(model)
    assert distributed.prepare_ddp([wrapped])
    assert wrapped.rate == 2**31 - 1


def test_fsdp2_parameter_groups_are_found_on_every_torch():
    """FSDP2's state holds a list of parameter groups on newer torch, one group (or None) up to 2.11;
    graphstep's reset after a stopped call finds them either way."""
    from types import SimpleNamespace

    from graphstep.distributed.ranks import _param_groups

    group = object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[group])) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []


def test_a_graph_captured_before_ddp_was_reset_is_captured_again():
    """A graph of one signature holds the gradient buckets DDP had when it was captured. After another
    signature's capture stops on one rank, every rank resets DDP and it rebuilds its buckets (two eager
    calls); the first signature's next call captures again on every rank instead of replaying into the
    replaced buckets, and training stays equal to an eager DDP twin."""
    reports = run_ranks(graphs_after_a_ddp_reset, 2, failing=1)
    for rank, report in enumerate(reports):
        warmups, first_small = report["warmups"], report["first_small_call"]
        assert report["errors"] == [{"call": first_small + warmups, "error": "CaptureError"}], report
        assert report["losses_equal"] and report["params_equal"], f"rank {rank}: {report}"
        # big: one capture; small: one after the failed one and DDP's two rebuilding calls; big again
        assert report["captures_before_last"] == 2 and report["stats"]["captures"] == 3, report


def test_a_split_capture_stopped_by_cuda_names_ddp_buckets():
    """A capture split by graph breaks that CUDA stops with "invalid argument" (a wait across its parts):
    under DDP the error names one bucket as the way out; under FSDP2 (whose events graphstep keeps inside
    each part), for another error, or a model with neither, nothing is added."""
    from graphstep.distributed.breaks import split_capture_hint

    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module = module

    class Sharded(torch.nn.Linear):  # what graphstep looks for in a module fully_shard wrapped
        def _get_fsdp_state(self):
            return None

    cuda = RuntimeError("CUDA error: invalid argument")
    assert "bucket_cap_mb" in split_capture_hint(cuda, [FakeDDP(torch.nn.Linear(2, 2))])
    assert split_capture_hint(cuda, [torch.nn.Sequential(Sharded(2, 2))]) is None
    assert split_capture_hint(cuda, [torch.nn.Linear(2, 2)]) is None
    assert split_capture_hint(RuntimeError("out of memory"), [FakeDDP(torch.nn.Linear(2, 2))]) is None
