"""accelerate's own gradient accumulation (`with accelerator.accumulate(model):`) through
`capture_accelerated`, against the same loop run eagerly, on the recording backend (which bakes
Python like a CUDA graph): parameters bitwise, the optimizer's step count after every call, accelerate's
counter, with and without `accelerator.clip_grad_norm_`, and with a prepared DataLoader whose last
batch forces a sync. A plain `graphstep.capture` around such a step is refused, naming accumulate.
"""

from __future__ import annotations

import pytest
import torch

import graphstep
from graphstep.errors import GraphStepError, PythonWriteError


def fresh_accelerator(steps: int):
    """accelerate imported here, not when the file is collected (an import stays for the rest of the
    process and makes every later capture's census larger: conftest.LAST), its shared state reset."""
    accelerate = pytest.importorskip("accelerate", reason="needs accelerate")
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerate.state.GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=steps)


CALLS = 10  # 10 batches: with accumulation 4 the last one syncs because the loader ends


def batches(n: int = CALLS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def run(steps: int, *, clip: bool, captured: bool, loader: bool = False, scaled: bool = False):
    """One accelerate loop; returns (step counts after each call, accelerator.step after each call,
    the model). `scaled`: a GradScaler as fp16 has (on the CPU, fp32 numbers with a scale so large
    that the first steps overflow and are skipped); then the counters are `step_was_skipped`."""
    accelerator = fresh_accelerator(steps)
    if scaled:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**115)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=not scaled)
    graphstep.optim.make_capturable(opt, "cpu")  # what graphstep does to the captured one
    data = batches()
    if loader:
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*map(torch.cat, zip(*data))), 4)
        model, opt, data = accelerator.prepare(model, opt, data)
    else:
        model, opt = accelerator.prepare(model, opt)

    def step(x, y):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y) * (1e4 if scaled else 1.0)
            accelerator.backward(loss)
            if clip and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
        return loss

    if captured:
        from graphstep.integrations.huggingface import capture_accelerated

        config = graphstep.Config(backend="recording", warmup_steps=1)
        step = capture_accelerated(accelerator, step, model=model, optimizer=opt, config=config)
    counts, counters = [], []
    first = next(iter(model.parameters()))
    for x, y in data:
        step(x, y)
        counts.append(int(opt.optimizer.state[first]["step"]) if opt.optimizer.state else 0)
        counters.append(opt.step_was_skipped if scaled else accelerator.step)
    if captured:
        assert step.stats.replays > 0, step.stats
        step.close()
    return counts, counters, model


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clip"])
@pytest.mark.parametrize("steps", [2, 4])
def test_accumulate_trains_like_the_eager_accelerate_loop(steps, clip):
    counts, counters, model = run(steps, clip=clip, captured=False)
    g_counts, g_counters, g_model = run(steps, clip=clip, captured=True)
    assert counts == [(i + 1) // steps for i in range(CALLS)], counts  # 0, 1, 1, 2, ... for 2
    assert (g_counts, g_counters) == (counts, counters)
    for (name, p), q in zip(model.named_parameters(), g_model.parameters()):
        assert torch.equal(p, q), name


def test_accumulate_with_a_prepared_loader_syncs_at_its_end_like_eager():
    counts, counters, model = run(4, clip=True, captured=False, loader=True)
    g_counts, g_counters, g_model = run(4, clip=True, captured=True, loader=True)
    assert counts[-1] == 3 and counters[-1] == 0, (counts, counters)  # the 10th batch synced: loader's end
    assert (g_counts, g_counters) == (counts, counters)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), g_model.parameters()))


def test_accumulate_entered_twice_in_one_call_is_refused():
    accelerator = fresh_accelerator(2)
    model = accelerator.prepare(torch.nn.Linear(8, 1))
    from graphstep.integrations.huggingface import capture_accelerated

    def step(x):
        for half in x.chunk(2):
            with accelerator.accumulate(model):
                model(half).sum().backward()

    captured = capture_accelerated(
        accelerator, step, model=model, config=graphstep.Config(backend="recording")
    )
    with pytest.raises(GraphStepError, match=r"accumulate\(\) 2 times in one call"):
        captured(torch.randn(4, 8))


def test_a_plain_capture_around_accumulate_is_refused_naming_capture_accelerated():
    accelerator = fresh_accelerator(2)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(8, 1))

    def step(x, y):  # accumulates gradients only (graphstep cannot prepare an AcceleratedOptimizer)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
        return loss

    config = graphstep.Config(backend="recording", warmup_steps=2)
    captured = graphstep.capture(step, model=model, config=config)
    data = batches(3)
    for x, y in data[:2]:
        captured(x, y)
    with pytest.raises(PythonWriteError) as info:
        captured(*data[2])
    text = str(info.value)
    assert "_do_sync" in text and "accelerator.accumulate" in text and "capture_accelerated" in text, text
    assert accelerator.step == 2, "accelerate's counter was put back as the two warm-ups left it"


def test_a_step_the_grad_scaler_skips_is_reported_skipped_after_replays_too():
    """fp16's GradScaler skips a step with inf gradients, and `step_was_skipped` says so (a prepared
    scheduler reads it); with the inf check in an eager segment, it is set after each graph's call."""
    counts, skipped, model = run(1, clip=False, captured=False, scaled=True)
    g_counts, g_skipped, g_model = run(1, clip=False, captured=True, scaled=True)
    assert True in skipped and False in skipped, skipped
    assert (g_counts, g_skipped) == (counts, skipped)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), g_model.parameters()))
