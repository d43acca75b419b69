"""Random numbers drawn on the host inside a step: refused at capture with the line and the fix,
state put back; the same step drawing on the device is bitwise equal to eager.

On the recording backend CPU tensors stand for device tensors, and torch's default CPU generator
for the device's generator (a replay draws from it again, as a CUDA graph advances its generator):
drawing there is the device-side way; a coin drawn there and read in a Python `if` is not.
"""

from __future__ import annotations

import copy
import random
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

import graphstep
from cpu_common import each_tracer  # noqa: F401  (each test under each tracer this Python has)
from graphstep.effects.host_random import HostRandomWatch
from graphstep.errors import HostRandomError

STEPS = 30
RECORDING = graphstep.Config(backend="recording")


class LayerDropNet(nn.Module):
    """Layers skipped at random, as transformers' LayerDrop does (on the host) or on the device."""

    def __init__(self, on_device: bool, layerdrop: float = 0.3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)
        self.layerdrop = layerdrop
        self.on_device = on_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8)
        for layer in self.layers:
            if self.on_device:
                keep = torch.rand((), device=x.device) >= self.layerdrop
                x = torch.where(keep, layer(x), x)
            else:  # as older transformers do: a draw per layer, even with LayerDrop at 0
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:
                    continue
                x = layer(x)
        return self.head(x)


def net(on_device: bool = True, layerdrop: float = 0.3) -> nn.Module:
    torch.manual_seed(0)
    return LayerDropNet(on_device, layerdrop)


def data(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def twins(on_device: bool = True, layerdrop: float = 0.3):
    model = net(on_device, layerdrop)
    twin = copy.deepcopy(model)
    return (model, torch.optim.SGD(model.parameters(), lr=0.05)), (
        twin,
        torch.optim.SGD(twin.parameters(), lr=0.05),
    )


def host_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].tobytes(), torch.get_rng_state()


def same_host_states(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def refused_at_capture(step, model, opt, batches, *extra):
    """Warm up (eager calls draw freely), then the capturing call: it must raise and leave the
    model, optimizer and every generator as they were."""
    for x, y in batches[:3]:
        step(x, y, *extra)
    params = [p.detach().clone() for p in model.parameters()]
    opt_state = copy.deepcopy(opt.state_dict())
    states = host_states()
    x, y = batches[3]
    with pytest.raises(HostRandomError) as info:
        step(x, y, *extra)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert opt.state_dict() == opt_state
    assert same_host_states(states, host_states())
    assert step.stats.captures == 0
    return str(info.value)


def equal_to_eager(make_step, eager_pair, graph_pair, arguments=lambda i: ()) -> None:
    """30 calls eagerly, then 30 through graphstep (3 warm-ups, a capture that performs its step, 26 replays), from the same
    generator states: parameters equal bitwise after every call."""
    (model, opt), (twin, twin_opt) = eager_pair, graph_pair
    batches = data()
    torch.manual_seed(7)
    eager_fn = make_step(model, opt)
    eager = []
    for i, (x, y) in enumerate(batches):
        eager_fn(x, y, *arguments(i))
        eager.append([p.detach().clone() for p in model.parameters()])
    eager_rng = torch.get_rng_state()
    torch.manual_seed(7)
    step = graphstep.capture(make_step(twin, twin_opt), model=twin, optimizer=twin_opt, config=RECORDING)
    for i, (x, y) in enumerate(batches):
        step(x, y, *arguments(i))
        assert all(torch.equal(a, b) for a, b in zip(eager[i], twin.parameters())), f"differs at call {i}"
    # The capturing call performs its step; the generator advanced as in eager.
    assert step.stats.captures == 1 and step.stats.replays == STEPS - 4
    assert torch.equal(torch.get_rng_state(), eager_rng)


# -- LayerDrop: a coin drawn with torch.rand([]) and tested in Python -------------------------------


def test_layerdrop_style_host_coin_is_refused_with_its_line_and_the_layerdrop_fix():
    (model, opt), _ = twins(on_device=False)
    step = graphstep.capture(
        lambda x, y: train(model, opt, x, y), model=model, optimizer=opt, config=RECORDING
    )
    message = refused_at_capture(step, model, opt, data(4))
    assert "dropout_probability = torch.rand([])" in message and "test_host_random.py" in message
    assert "LayerDropNet.layerdrop=0.3" in message and "layerdrop=0" in message
    assert 'Config(backend="eager")' in message


def test_layerdrop_on_the_device_with_torch_where_equals_eager():
    equal_to_eager(lambda m, o: lambda x, y: train(m, o, x, y), *twins(on_device=True))


def test_on_cuda_layerdrop_at_zero_is_redrawn_after_each_replay_and_above_zero_refused():
    """The CUDA backend's view, on a CPU: the draws of a LayerDrop at 0 are not refused; they are
    taken back at capture (the graph does not execute) and made again after each replay, so
    torch's CPU generator advances exactly as in eager."""
    x = torch.randn(2, 8)
    model = net(on_device=False, layerdrop=0.0)
    torch.manual_seed(0)
    model(x)
    eager = torch.get_rng_state()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with HostRandomWatch("step", "cuda", executes=False) as watch:
        model(x)
    assert watch.draws == [] and len(watch.redone_draws()) == 3  # one per layer
    assert torch.equal(torch.get_rng_state(), before)
    for draw in watch.redone_draws():  # what PartsRecording.replay does after the graph
        draw()
    assert torch.equal(torch.get_rng_state(), eager)

    model.layerdrop = 0.3
    before = torch.get_rng_state()
    with (
        pytest.raises(HostRandomError, match=r"LayerDropNet\.layerdrop=0\.3") as info,
        HostRandomWatch("step", "cuda"),
    ):
        model(x)
    assert "dropout_probability = torch.rand([])" in str(info.value)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_recording_redoes_its_host_draws_after_every_replay():
    from graphstep.backends.base import PartsRecording

    ran = []
    recording = PartsRecording([lambda: ran.append("graph")], lambda: None)
    recording.host_draws = [lambda: ran.append("draw")]
    recording.replay((), {})
    recording.replay((), {})
    assert ran == ["graph", "draw", "graph", "draw"]


def test_a_cpu_draw_is_a_host_draw_when_the_graph_runs_on_cuda():
    """The CUDA backend's view, on a CPU: torch's default CPU generator is a host generator there
    (transformers' `torch.rand([])` is refused even before anything reads it), found by the
    profile function with its line, and put back."""
    before = torch.get_rng_state()
    with pytest.raises(HostRandomError) as info, HostRandomWatch("step", "cuda"):
        dropout_probability = torch.rand([])
        if dropout_probability < 0.1:
            pass
    message = str(info.value)
    assert "torch's default CPU generator at" in message and "dropout_probability = torch.rand([])" in message
    assert "torch.where" in message  # the draw decides an `if` two lines later
    assert torch.equal(torch.get_rng_state(), before)


# -- Python's random: an augmentation --------------------------------------------------------------


def augment_on_host(model, opt):
    def step(x, y):
        if random.random() < 0.5:
            x = x.flip(1)
        return train(model, opt, x, y)

    return step


def augment_on_device(model, opt):
    def step(x, y):
        flip = torch.rand((), device=x.device) < 0.5
        x = torch.where(flip, x.flip(1), x)
        return train(model, opt, x, y)

    return step


def test_python_random_augmentation_is_refused_with_its_line():
    (model, opt), _ = twins()
    step = graphstep.capture(augment_on_host(model, opt), model=model, optimizer=opt, config=RECORDING)
    message = refused_at_capture(step, model, opt, data(4))
    assert "Python's `random` at" in message and "if random.random() < 0.5:" in message
    assert "torch.where" in message and "Nothing was lost" in message


def test_augmentation_drawn_on_the_device_equals_eager():
    equal_to_eager(augment_on_device, *twins())


# -- NumPy: mixup's λ --------------------------------------------------------------------------------


def mixup(model, opt, lam):
    x_mix = lambda x: lam * x + (1 - lam) * x.flip(0)  # noqa: E731
    return lambda x, y: train(model, opt, x_mix(x), x_mix(y))


def test_numpy_mixup_lambda_is_refused_with_its_line_and_the_pass_it_in_fix():
    (model, opt), _ = twins()

    def step(x, y):
        lam = np.random.beta(0.4, 0.4)
        return mixup(model, opt, lam)(x, y)

    np.random.seed(3)
    captured = graphstep.capture(step, model=model, optimizer=opt, config=RECORDING)
    message = refused_at_capture(captured, model, opt, data(4))
    assert "NumPy's global generator (`np.random`) at" in message
    assert "lam = np.random.beta(0.4, 0.4)" in message and "0-d tensor on the device" in message


def test_mixup_lambda_passed_in_as_a_tensor_equals_eager():
    rng = np.random.default_rng(5)
    lams = [torch.tensor(rng.beta(0.4, 0.4), dtype=torch.float32) for _ in range(STEPS)]
    equal_to_eager(
        lambda m, o: lambda x, y, lam: mixup(m, o, lam)(x, y), *twins(), arguments=lambda i: (lams[i],)
    )


# -- a CPU torch.Generator passed in -----------------------------------------------------------------


def noisy(model, opt):
    def step(x, y, g):
        noise = torch.randn(x.shape, generator=g)
        return train(model, opt, x + 0.1 * noise, y)

    return step


def test_a_cpu_generator_passed_in_is_refused_with_its_line_and_put_back():
    (model, opt), _ = twins()
    g = torch.Generator().manual_seed(11)
    step = graphstep.capture(noisy(model, opt), model=model, optimizer=opt, config=RECORDING)
    for x, y in data(3):
        step(x, y, g)
    g_state = g.get_state()
    x, y = data(4)[3]
    with pytest.raises(HostRandomError) as info:
        step(x, y, g)
    message = str(info.value)
    assert "a CPU torch.Generator (passed in as an argument) at" in message
    assert "noise = torch.randn(x.shape, generator=g)" in message
    assert torch.equal(g.get_state(), g_state)


def test_a_tensor_methods_draw_and_a_later_functions_draw_are_each_refused_with_their_lines():
    """A method's c_call and c_return come with two bound-method objects on Python >= 3.12 (equal,
    not the same): matched by equality, the method's draw is named, and the draws after it too."""
    (model, opt), _ = twins()
    g = torch.Generator().manual_seed(11)

    def step(x, y):
        noise = torch.empty(x.shape).normal_(generator=g)
        scale = torch.rand((), generator=g)
        return train(model, opt, x + scale * noise, y)

    captured = graphstep.capture(step, model=model, optimizer=opt, config=RECORDING)
    for x, y in data(3):
        captured(x, y)
    with pytest.raises(HostRandomError) as info:
        captured(*data(4)[3])
    message = str(info.value)
    assert "noise = torch.empty(x.shape).normal_(generator=g)" in message, message
    assert "scale = torch.rand((), generator=g)" in message, message


def test_noise_drawn_from_the_device_generator_equals_eager():
    def noisy_on_device(model, opt):
        def step(x, y):
            noise = torch.randn(x.shape, device=x.device)
            return train(model, opt, x + 0.1 * noise, y)

        return step

    equal_to_eager(noisy_on_device, *twins())


# -- what may draw, and living with other watchers ------------------------------------------------


def test_an_eager_segment_may_draw_on_the_host_and_does_on_every_replay():
    (model, opt), _ = twins()
    flips = []

    @graphstep.eager_segment
    def augment(x):
        flip = random.random() < 0.5
        flips.append(flip)
        return x.flip(1) if flip else x

    step = graphstep.capture(
        lambda x, y: train(model, opt, augment(x), y), model=model, optimizer=opt, config=RECORDING
    )
    random.seed(0)
    for x, y in data(8):
        step(x, y)
    assert step.stats.captures == 1 and len(flips) == 8
    random.seed(0)
    assert flips == [random.random() < 0.5 for _ in range(8)]


def test_a_profile_function_installed_before_keeps_its_events_and_is_put_back():
    (model, opt), _ = twins()
    seen = []

    def profiler(frame, event, arg):
        seen.append(event)

    step = graphstep.capture(augment_on_host(model, opt), model=model, optimizer=opt, config=RECORDING)
    batches = data(4)
    for x, y in batches[:3]:
        step(x, y)
    sys.setprofile(profiler)
    try:
        with pytest.raises(HostRandomError):
            step(*batches[3])
        assert sys.getprofile() is profiler
    finally:
        sys.setprofile(None)
    assert "c_call" in seen and "call" in seen


def test_explain_reports_host_draws_before_any_capture_and_puts_the_generators_back():
    (model, opt), _ = twins()
    step = graphstep.capture(augment_on_host(model, opt), model=model, optimizer=opt, config=RECORDING)
    states = host_states()
    report = graphstep.explain(step, *data(1)[0])
    assert any(
        "host random draw: Python's `random` at" in h and "if random.random() < 0.5:" in h
        for h in report.hazards
    )
    assert same_host_states(states, host_states())
    assert step.stats.warmup_calls == 0

    clean = graphstep.capture(augment_on_device(model, opt), model=model, optimizer=opt, config=RECORDING)
    assert not any("host random" in h for h in graphstep.explain(clean, *data(1)[0]).hazards)


def test_a_librarys_private_random_instance_is_its_own_business_but_one_the_user_calls_is_not():
    import tempfile

    with HostRandomWatch("step", "cpu") as watch:
        next(tempfile._get_candidate_names())  # tempfile's own random.Random names files
    assert watch.draws == []

    holder = types.SimpleNamespace(rng=random.Random(0))  # reached through an attribute only
    before = holder.rng.getstate()
    with (
        pytest.raises(HostRandomError, match=r"holder\.rng\.uniform\(0, 1\)"),
        HostRandomWatch("step", "cpu"),
    ):
        holder.rng.uniform(0, 1)
    assert holder.rng.getstate() == before


def test_a_numpy_generator_the_step_holds_is_caught_by_its_state_and_put_back():
    """NumPy `Generator` methods are invisible to a profiler: the state comparison at the end of
    the call catches the draw (without a line) and the generator is put back."""
    (model, opt), _ = twins()
    rng = np.random.default_rng(0)

    def step(x, y):
        return train(model, opt, x * float(rng.uniform(0.9, 1.1)), y)

    captured = graphstep.capture(step, model=model, optimizer=opt, config=RECORDING)
    for x, y in data(3):
        captured(x, y)
    before = rng.bit_generator.state
    with pytest.raises(
        HostRandomError, match=r"numpy\.random\._generator\.Generator \(closure variable 'rng'\)"
    ):
        captured(*data(4)[3])
    assert rng.bit_generator.state == before
