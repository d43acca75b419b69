"""Memory of a step with a graph break against its eager twin's, in one process (issue 42, item 2: with
breaks the MoE row peaked at 1.41-1.90x eager's allocated memory, every row without breaks at <= 1.05x).

A mixture of experts whose token dispatch reads the host (`torch.where`): one break, at the experts
module of each layer. Before each method the allocator's cache and cuBLAS's workspaces are emptied and
the peak counters reset, so each pays for what it makes (optimizer state, workspaces, the graphs' pool).
What a break cost before (benchmarks/break_memory_snapshot.py, docs/limits.md): each segment parameter's
gradient twice at the peak (the segment's buffer and a copy as `.grad` in the pool), the caller's stream's
cuBLAS workspaces beside the capture stream's, and the pool of the capture that found the break, kept by
the optimizer state made in the first warm-up.
"""

from __future__ import annotations

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch
from gpu_common import deterministic, needs_cuda

import graphstep

sys.path.insert(0, str(Path(__file__).parents[1]))
from break_models import MoE, MoENet

pytestmark = needs_cuda
DIM, HIDDEN, EXPERTS, CALLS = 512, 2048, 4, 8


class SyncingHead(torch.nn.Module):
    """A head that reads the host: a second break, at the end of the forward, where the capture that finds
    it has made all the forward's activations."""

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        scale = 1.0 if h.abs().max().item() < 1e6 else 0.5
        return self.out(h) * scale


def build(late_break: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MoENet(dim=DIM, layers=2)
    model.blocks = torch.nn.ModuleList(MoE(DIM, HIDDEN, EXPERTS) for _ in range(2))
    if late_break:
        model.out = SyncingHead()
    return model.cuda()


def step_of(model, opt):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def measured(calls):
    """Run `calls(peaks)` from an empty cache and no cuBLAS workspaces: its results, the most memory
    allocated and reserved above what was there before it, and each call's own peak above that (MiB)."""
    gc.collect()  # an earlier step's garbage collected during the run would lower the peaks seen (below eager's)
    torch.cuda.synchronize()
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    peaks: list[tuple[int, int]] = []  # (allocated, reserved), each call's
    results = calls(peaks)
    torch.cuda.synchronize()
    per_call = [(round((a - allocated) / 2**20, 1), round((r - reserved) / 2**20)) for a, r in peaks]
    return results, max(a for a, _ in peaks) - allocated, max(r for _, r in peaks) - reserved, per_call


def run_both(late_break: bool = False):
    model = build(late_break)
    twin = copy.deepcopy(model)
    opts = []
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        graphstep.optim.make_capturable(opt, "cuda")
        opts.append(opt)
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(8, 256, DIM, generator=g).cuda(), torch.randn(8, 256, 1, generator=g).cuda())
        for _ in range(CALLS)
    ]
    eager = step_of(twin, opts[1])
    step = graphstep.capture(step_of(model, opts[0]), model=model, optimizer=opts[0])

    def calls(fn, peaks):
        out = []
        for i, batch in enumerate(data):
            torch.manual_seed(i)
            torch.cuda.reset_peak_memory_stats()
            out.append(fn(*batch))
            peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        return out

    with deterministic():
        want, eager_alloc, eager_res, eager_calls = measured(lambda peaks: calls(eager, peaks))
        got, graph_alloc, graph_res, graph_calls = measured(lambda peaks: calls(step, peaks))
    for i, (w, o) in enumerate(zip(want, got)):
        assert torch.equal(w, o), f"call {i}: loss {o.item()} != eager {w.item()}"
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    assert step.stats.graph_breaks == 1 + late_break and step.stats.captures == 1, step.stats
    mib = 2**20
    print(
        f"\npeak allocated: graphstep {graph_alloc / mib:.1f} MiB, eager {eager_alloc / mib:.1f} MiB "
        f"({graph_alloc / eager_alloc:.2f}x); peak reserved: {graph_res / mib:.1f} vs {eager_res / mib:.1f} MiB "
        f"({graph_res / eager_res:.2f}x)\neach call's peak (allocated, reserved MiB), eager: "
        f"{eager_calls}, graphstep: {graph_calls}"
    )
    return step, (graph_alloc, eager_alloc), (graph_res, eager_res)


@pytest.mark.parametrize("late_break", [False, True], ids=["experts", "experts_and_head"])
def test_a_step_with_a_graph_break_peaks_within_1_1x_of_eagers_allocated_memory(late_break):
    """`experts_and_head`: the capture that finds the second break fails after the whole forward; its
    activations must be gone before that call warms up again (they were not: 1.69x on the MoE row). The
    segments' buffers live in the graphs' pool, unowned, and their results take the buffers' memory
    (1.22-1.24x before, on an H100)."""
    step, (graph, eager), _ = run_both(late_break)
    step.close()
    assert graph <= 1.1 * eager, f"graphstep peaked at {graph / eager:.2f}x eager's allocated memory"


@pytest.mark.xfail(
    strict=False,
    reason="issue 42's target, not met on reserved memory: on an H100 and an H200 (2026-11-27) 1.19-1.45x "
    "eager's (two pools: the graphs' scratch and the eager segments' memory cannot serve each other; "
    "docs/limits.md)",
)
@pytest.mark.parametrize("late_break", [False, True], ids=["experts", "experts_and_head"])
def test_a_step_with_a_graph_break_reserves_within_1_1x_of_eagers_memory(late_break):
    step, _, (graph, eager) = run_both(late_break)
    step.close()
    assert graph <= 1.1 * eager, f"graphstep's reserved memory peaked at {graph / eager:.2f}x eager's"


@pytest.mark.parametrize("late_break", [False, True], ids=["experts", "experts_and_head"])
def test_no_pool_is_left_behind_by_the_captures_that_found_the_breaks(late_break):
    """The warm-ups' optimizer state lived in the pool of the capture that stopped at the break; it moves
    out, and that pool goes back whole; a second failed capture (`experts_and_head`) leaves nothing of its
    own either: only the step's current pool and the default pool hold memory."""
    pools = lambda: {tuple(s.get("segment_pool_id", (0, 0))) for s in torch.cuda.memory_snapshot()}  # noqa: E731
    earlier = pools()  # other tests' steps
    step, _, _ = run_both(late_break)
    current = tuple(step._ctx.backend.pool)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    others = [
        (s["total_size"], s["allocated_size"])
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", (0, 0))) not in {(0, 0), current, *earlier}
    ]
    step.close()
    assert not others, f"segments (size, allocated) left in other pools: {others}"
