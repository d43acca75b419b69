"""`graphstep.explain`: a dry run that reports inputs, state and hazards, and changes nothing."""

from __future__ import annotations

import torch

import graphstep
from cpu_common import batches, sgd_step


def test_explain_reports_inputs_state_and_host_syncs_without_changing_anything(twins):
    (_, _), (model, opt) = twins
    inner = sgd_step(model, opt)

    def fn(x, y, scale):
        loss = inner(x, y) * scale
        print(loss.item())
        return loss

    model.fc1.register_forward_hook(lambda *a: None)
    step = graphstep.capture(fn, model=model, optimizer=opt, config=graphstep.Config(backend="recording"))
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    report = graphstep.explain(step, x, y, 0.5)
    text = str(report)
    assert report.backend == "recording"
    assert "args[0] (float32[4, 8] on cpu)" in text
    assert "args[2]=0.5" in text and "args[2] is a Python float in the key" in text
    assert any("print(loss.item())" in h for h in report.hazards), report.hazards
    assert any("model.fc1 has forward_hooks" in h for h in report.hazards), report.hazards
    assert (
        report.guarded["parameters and buffers"] == 4
        and report.guarded["optimizers (param groups, hyperparameters)"] == 1
    )
    # The dry run left no trace.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert torch.equal(torch.get_rng_state(), rng)
    assert step.stats.warmup_calls == 0


def test_explain_finds_nothing_wrong_with_a_clean_step(twins):
    (_, _), (model, opt) = twins
    step = graphstep.capture(
        sgd_step(model, opt), model=model, optimizer=opt, config=graphstep.Config(backend="recording")
    )
    report = graphstep.explain(step, *batches(1)[0])
    assert report.hazards == [], report.hazards
    assert "hazards: none found" in str(report)


def test_explain_names_an_optimizer_that_will_run_eagerly_and_not_one_graphstep_makes_capturable(twins):
    """graphstep makes AdamW capturable itself: no advice to construct it so. Adafactor's step reads the
    host every time: explain says it will be an eager segment, and why."""
    (_, _), (model, _) = twins
    for opt, expected in (
        (torch.optim.AdamW(model.parameters(), lr=1e-3), None),
        (torch.optim.Adafactor(model.parameters(), lr=1e-2), "Adafactor.step() will run as an eager segment"),
    ):
        step = graphstep.capture(
            sgd_step(model, opt), model=model, optimizer=opt, config=graphstep.Config(backend="recording")
        )
        hazards = graphstep.explain(step, *batches(1)[0]).hazards
        assert not any("capturable=True" in h for h in hazards), hazards
        if expected is None:
            assert not any("eager segment" in h for h in hazards), hazards
        else:
            assert any(expected in h and ".item()" in h for h in hazards), hazards
        step.close()


HISTORY: list[int] = []


def test_explain_lists_the_writes_a_capture_would_refuse_and_takes_them_back():
    """A module attribute counted up in forward and a global list appended to: explain names each once,
    with its line, and leaves both as they were."""
    from test_effects_writes import Counting

    model = Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fn(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        HISTORY.append(1)  # write: history
        return loss

    step = graphstep.capture(fn, model=model, optimizer=opt, config=graphstep.Config(backend="recording"))
    hazards = graphstep.explain(step, *batches(1)[0]).hazards
    writes = [h for h in hazards if "PythonWriteError" in h]
    assert len(writes) == 2, hazards
    assert any("self.seen += 1" in h and "0 -> 1" in h for h in writes), writes
    assert any("HISTORY.append(1)" in h for h in writes), writes
    assert not any(h.startswith("model.seen is written") for h in hazards), hazards  # named once
    assert model.seen == 0 and HISTORY == []  # taken back
    assert step.stats.warmup_calls == 0
    step.close()
