"""PyTorch Lightning with `GraphStepCallback`: a few steps with and without it, equal on CPU.

The recording backend (a CPU stand-in for a CUDA graph that bakes Python like one) checks what a
replay needs from the callback: the closure's loss for Lightning, the logged values, the optimizer
step count. The optimizer is fused AdamW made capturable in both runs (what graphstep does to a
captured one), so the runs are bitwise comparable. The module, logger and `fit` are in
tests/lightning_cases.py (the `cases` fixture imports it: collecting the suite imports no Lightning).
"""

from __future__ import annotations

import pytest

import graphstep
from graphstep.errors import GraphStepError

pytestmark = pytest.mark.timeout(120)  # a wrong step count would train forever (max_steps never reached)
BACKENDS = ["recording", "eager"]


@pytest.fixture(scope="module")
def cases():
    pytest.importorskip(
        "pytorch_lightning", reason="needs pytorch-lightning (pip install graphstep[lightning])"
    )
    import lightning_cases

    return lightning_cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_callback_trains_like_plain_lightning(cases, backend, manual):
    clip = {} if manual else {"gradient_clip_val": 0.5}
    plain_module = cases.Net(manual=manual)
    plain = cases.fit(plain_module, [], **clip)
    callback = cases.GraphStepCallback(config=graphstep.Config(backend=backend))
    captured_module = cases.Net(manual=manual)
    captured = cases.fit(captured_module, [callback], **clip)
    cases.assert_same_runs(plain, captured, plain_module, captured_module)
    s = callback.stats
    if backend == "recording":  # 3 warm-ups, 1 capture, then replays: the callback's Python ran 4 times
        assert (s.warmup_calls, s.captures, s.replays) == (3, 1, cases.STEPS - 4), s
    assert callback.step is None and "training_step" not in captured_module.__dict__  # restored


def test_sgd_with_one_cycle_runs_its_update_as_a_segment_and_trains_like_plain_lightning(cases):
    """Lightning calls `optimizer.step(closure)`; OneCycleLR cycles SGD's baked momentum, so the
    update runs as an eager segment while the closure (forward, backward, clipping) is captured."""
    plain_module = cases.Net(recipe="sgd-one-cycle")
    plain = cases.fit(plain_module, [], gradient_clip_val=0.5)
    callback = cases.GraphStepCallback(config=graphstep.Config(backend="recording"))
    captured_module = cases.Net(recipe="sgd-one-cycle")
    captured = cases.fit(captured_module, [callback], gradient_clip_val=0.5)
    cases.assert_same_runs(plain, captured, plain_module, captured_module)
    s = callback.stats
    assert (s.warmup_calls, s.captures, s.replays) == (3, 1, cases.STEPS - 4), s


@pytest.mark.parametrize("recipe", ["adamw", "sgd-one-cycle"])
@pytest.mark.parametrize("accumulate", [2, 3])
def test_gradient_accumulation_trains_like_plain_lightning(cases, accumulate, recipe):
    """Micro-batches that only accumulate get their own graph (Lightning calls its closure itself),
    the one that steps another; the first of each window (zero_grad) its own too."""
    options = {"gradient_clip_val": 0.5, "accumulate_grad_batches": accumulate}
    plain_module = cases.Net(recipe=recipe)
    plain = cases.fit(plain_module, [], **options)
    callback = cases.GraphStepCallback(config=graphstep.Config(backend="recording"))
    captured_module = cases.Net(recipe=recipe)
    captured = cases.fit(captured_module, [callback], **options)
    cases.assert_same_runs(plain, captured, plain_module, captured_module, batches=cases.STEPS * accumulate)
    s = callback.stats
    kinds = 2 if accumulate == 2 else 3  # (accumulate, zero_grad), [(accumulate, none),] (step, none)
    assert s.captures == kinds and s.replays > 0, s
    # Every batch went through the captured step once: a warm-up, a capture or a replay.
    assert s.warmup_calls + s.captures + s.replays == cases.STEPS * accumulate, s


def test_gradient_accumulation_on_the_eager_backend_trains_like_plain_lightning(cases):
    options = {"gradient_clip_val": 0.5, "accumulate_grad_batches": 2}
    plain_module, captured_module = cases.Net(recipe="sgd-one-cycle"), cases.Net(recipe="sgd-one-cycle")
    plain = cases.fit(plain_module, [], **options)
    captured = cases.fit(
        captured_module, [cases.GraphStepCallback(config=graphstep.Config(backend="eager"))], **options
    )
    cases.assert_same_runs(plain, captured, plain_module, captured_module, batches=cases.STEPS * 2)


def test_scheduler_step_inside_a_manual_training_step_is_refused(cases):
    with pytest.raises(GraphStepError, match="on_train_batch_end"):
        cases.fit(cases.Net(manual=True, scheduler_inside=True), [cases.GraphStepCallback()])


def test_the_callback_is_a_callback_of_the_package_in_use(cases):
    assert issubclass(cases.callback_class("pytorch_lightning"), cases.pl.Callback)
