"""The pieces of the distributed vote that one process can test: watching a step's collectives
must not stop torch.compile, and how failures are classified and told apart when agreed.
(The votes themselves run across processes in test_distributed.py.)"""

from __future__ import annotations

import pytest
import torch

from graphstep.distributed import collectives
from graphstep.errors import CaptureError, HostSyncError


class _Alone:
    """A board for a single rank: the maximum of one rank's numbers is its own."""

    rank, size, name = 0, 1, "alone"

    def max(self, values):
        return list(values)

    def gather_text(self, text):
        return [text]


@pytest.mark.skipif(not collectives.WATCHABLE, reason="this torch cannot watch without disabling compile")
def test_watching_collectives_does_not_stop_torch_compile():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend)
    def f(x):
        return torch.sin(x) * 2

    x = torch.randn(4)
    with collectives.Together(_Alone(), "step", capturing=False) as together:
        out = f(x)
    assert together.end(None) is None
    assert len(graphs) == 1, "torch.compile skipped the function under graphstep's dispatch mode"
    assert torch.equal(out, torch.sin(x) * 2)


def test_a_single_rank_step_that_ends_agrees_with_itself():
    together = collectives.Together(_Alone(), "step", capturing=True)
    assert together.end(None) is None and together.ended


def test_failures_are_classified_for_the_other_ranks_message():
    assert collectives.failure_code(None) == 0
    assert collectives.failure_code(RuntimeError("boom")) == collectives.ERROR
    assert collectives.failure_code(HostSyncError("x")) == collectives.HOST_SYNC
    assert collectives.failure_code(RuntimeError("operation not permitted when stream is capturing")) == (
        collectives.HOST_SYNC
    )
    assert collectives.failure_code(torch.OutOfMemoryError("CUDA out of memory")) == collectives.OUT_OF_MEMORY
    assert collectives.failure_code(KeyboardInterrupt()) == collectives.INTERRUPTED


def test_an_agreed_error_is_recognised_through_the_error_that_wraps_it():
    inner = RuntimeError("boom")
    collectives.mark_agreed(inner)
    try:
        try:
            raise inner
        except RuntimeError as exc:
            raise CaptureError("capturing failed") from exc
    except CaptureError as outer:
        assert collectives.is_agreed(outer)
    assert not collectives.is_agreed(RuntimeError("another"))


def test_an_error_raised_while_the_caller_handles_an_agreed_one_is_reported_to_the_other_ranks():
    """Every rank raised `first` in one call; the caller handles it and calls again, and this rank alone
    raises `second` (its context is `first`). `second` is this rank's own: the next vote must carry it.
    Within one call, an error raised from an agreed one stays agreed."""
    from graphstep.distributed.collectives import is_agreed, mark_agreed
    from graphstep.distributed.ranks import Ranks

    ranks = object.__new__(Ranks)  # note_failure needs no process group
    ranks._failure = None
    first = RuntimeError("stopped on every rank")
    mark_agreed(first)
    ranks.note_failure(first)
    assert ranks._failure is None
    try:
        try:
            raise first
        except RuntimeError:
            raise ValueError("this rank only, in the next call")  # noqa: B904 (as a caller would)
    except ValueError as second:
        assert second.__context__ is first and not is_agreed(second)
        ranks.note_failure(second)
    assert ranks._failure is not None and "this rank only" in ranks._failure[1]

    third = RuntimeError("stopped on every rank")
    mark_agreed(third)
    try:
        try:
            raise third
        except RuntimeError as exc:
            raise KeyError("graphstep's own wrapping, same call") from exc
    except KeyError as wrapped:
        assert is_agreed(wrapped)
