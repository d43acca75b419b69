"""torchtitan 0.2.2 under graphstep on real CUDA graphs: docs/frameworks.md's recipe, bitwise equal to eager.

torchtitan's own train spec builds, parallelizes and trains each model (tests/titan_common.py): the Llama 3
debug model (6 layers, 6.2 M parameters) and the DeepSeek-V3 debug model (MoE: 8 experts, top 3, 2 shared,
`torch._grouped_mm`), with torchtitan's activation checkpointing and its per-block `torch.compile`, on one
GPU; and torchtitan's `parallelize_llama` on a 2 × 2 mesh (FSDP2 × TP, torchtitan's ParallelDims) on four.
Each case trains an eager twin and the captured step on the same batches in deterministic mode, the lr
warm-up changing the learning rate every step, and compares every loss, gradient norm and parameter.

Needs torchtitan and its dependencies (the GPU machine: the wheels in .whl installed into
/tmp/stacks/site-packages, see scripts/gpu-probe-stacks.sh).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("torchtitan.models.llama3", reason="needs torchtitan (pip install graphstep[torchtitan])")

from gpu_common import needs_cuda

import graphstep
from ranks import run_ranks
from titan_common import fsdp_tp_pair, run_pair

pytestmark = needs_cuda
STEPS = 8


@contextlib.contextmanager
def deterministic(warn_only: bool = False):
    """Deterministic kernels. `warn_only` for the MoE: its router counts tokens per expert with
    `torch.histc`, which has no deterministic CUDA kernel (integer counts: exact in any order)."""
    was, was_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)


def check(report: dict, *, steps: int = STEPS) -> None:
    assert report["backend"] == "cuda", report
    assert report["first_bad_step"] is None, report
    assert not report["params_differ"], report
    stats = report["stats"]
    assert stats["captures"] == 1 and stats["graph_breaks"] == 0 and stats["eager_calls"] == 0, stats
    assert stats["replays"] == steps - stats["warmup_calls"], stats
    assert report["segments"] == [], report  # AdamW's step (fused, live lr) and the clipping in the graph
    assert len(set(report["losses"])) == steps  # it trained


@pytest.fixture
def one_rank_group():
    """A process group of one rank, as torchtitan's trainer always has (the MoE's load-balancing hook asks
    for one even on a single GPU); destroyed afterwards, so the 4-GPU test's ranks start clean."""
    import torch.distributed as dist

    from ranks import _free_port

    made = not dist.is_initialized()
    if made:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_llama3_debug_model_bitwise(ac, one_rank_group):
    """`ac`: torchtitan's activation checkpointing (`full`: every block; `selective`: every 2nd block)."""
    with deterministic():
        report = run_pair(
            "llama3", "cuda", steps=STEPS, config=graphstep.Config(backend="cuda"), seq_len=64, ac=ac
        )
    check(report)


def test_llama3_debug_model_compiled_blocks_bitwise(one_rank_group):
    """torchtitan's per-block `torch.compile` (inductor; `job.compile`, applied by its parallelize function,
    after AC): the blocks compile in the warm-ups (a warm-up that compiled is followed by one more), the
    capture records their kernels."""
    with deterministic():
        report = run_pair(
            "llama3",
            "cuda",
            steps=STEPS + 2,
            config=graphstep.Config(backend="cuda"),
            seq_len=64,
            compile_blocks=True,
        )
    check(report, steps=STEPS + 2)


@pytest.mark.parametrize("ac", ["none", "full"])
def test_deepseek_v3_debug_model_bitwise(ac, one_rank_group):
    """The MoE: the router's top-k, the token counts per expert, the permutation and `torch._grouped_mm`
    are in the graph (no host read on this path), and so is the expert-bias update torchtitan's optimizer
    container runs as a step hook (load balancing)."""
    with deterministic(warn_only=True):
        report = run_pair(
            "deepseek_v3", "cuda", steps=STEPS, config=graphstep.Config(backend="cuda"), seq_len=64, ac=ac
        )
    check(report)
    assert report["pool_bytes"] > 0


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
def test_llama3_fsdp_times_tp_on_a_2x2_mesh_bitwise():
    """torchtitan's `parallelize_llama` with dp_shard=2 × tp=2 (its ParallelDims): FSDP2's all-gathers and
    reduce-scatters and TP's collectives in the graph, on every rank bitwise equal to the same model run
    eagerly; the token count summed over the batch mesh outside the step, as torchtitan's trainer does."""
    reports = run_ranks(fsdp_tp_pair, 4, backend="nccl", timeout=240, steps=STEPS)
    for rank, report in enumerate(reports):
        assert report["first_bad_step"] is None and not report["params_differ"], f"rank {rank}: {report}"
        check(report)
