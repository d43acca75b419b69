"""The eager backend (what runs without CUDA) equals plain eager, bitwise: losses, gradients and
parameters, for every model of the CPU suite.

A Python dispatch mode around the step changes results (ATen treats every tensor as a subclass
while one is active, and some backward formulas take another path: `prod`'s, for one), so these
models include one that meets such a path (`GatedConvNet`); the test fails if the eager backend
runs any call of the step under a dispatch mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import break_models as bm
import graphstep
from cpu_common import TinyNet, batches
from graphstep.demo.gpt import GPT, GPTConfig, make_batches

STEPS = 5  # three warm-ups, the capture, one replay


class GatedConvNet(torch.nn.Module):
    """Conv + batch norm (one training, one frozen) + interpolate + a product over channels."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.frozen = torch.nn.BatchNorm2d(8).eval().requires_grad_(False)
        self.head = torch.nn.Linear(8, 2)

    def train(self, mode: bool = True) -> GatedConvNet:
        super().train(mode)
        self.frozen.eval()  # as torchvision's FrozenBatchNorm2d
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 3, 16, 16)
        h = F.relu(self.bn(self.conv1(x)))
        h = self.frozen(self.conv2(h))
        h = F.interpolate(h, scale_factor=2, mode="nearest") + F.interpolate(
            h, size=(16, 16), mode="bilinear"
        )
        gate = torch.sigmoid(h.mean((2, 3))).prod(-1, keepdim=True)  # (B, 1): `prod`'s backward
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1)) * gate


def _tiny():
    model = TinyNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), batches(STEPS), _mse


def _mse(model, x, y):
    return F.mse_loss(model(x), y)


def _conv():
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(4, 3, 16, 16, generator=g), torch.randn(4, 2, generator=g)) for _ in range(STEPS)]
    model = GatedConvNet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, _mse


def _moe():
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 1, generator=g)) for _ in range(STEPS)]
    model = bm.MoENet()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), data, _mse


def _ctc():
    model = torch.nn.ModuleDict({"net": bm.CTCNet(), "loss": bm.CTCHead()})

    def loss(m, x, targets, input_lengths, target_lengths):
        return m["loss"](m["net"](x), targets, input_lengths, target_lengths)

    return model, torch.optim.Adam(model.parameters(), lr=1e-2), bm.ctc_batches(STEPS), loss


def _detr():
    g = torch.Generator().manual_seed(5)
    data = [
        (
            torch.randn(2, 16, generator=g),
            torch.randint(0, 3, (2, 3), generator=g),
            torch.rand(2, 3, 4, generator=g),
        )
        for _ in range(STEPS)
    ]
    model = torch.nn.ModuleDict({"net": bm.TinyDETR(queries=3), "loss": bm.SetCriterion(3)})

    def loss(m, x, labels, boxes):
        logits, pred = m["net"](x)
        return m["loss"](logits, pred, labels, boxes)

    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), data, loss


def _gpt():
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    model = GPT(cfg)
    data = make_batches(cfg, batch_size=2, n_batches=STEPS)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), data, lambda m, x, y: m(x, y)


MODELS = {"tiny": _tiny, "conv_bn_interp_prod": _conv, "moe": _moe, "ctc": _ctc, "detr": _detr, "gpt": _gpt}


def _train(make, *, captured: bool):
    torch.manual_seed(0)
    model, opt, data, loss_of = make()  # the same start either way: made under the same seed

    def step(*batch):
        opt.zero_grad()
        loss = loss_of(model, *batch)
        loss.backward()
        opt.step()
        return loss.detach()

    if captured:
        step = graphstep.capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="eager"))
    torch.manual_seed(1)  # dropout draws the same masks in both runs
    seen = []
    for batch in data:
        loss = step(*batch)
        grads = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
        seen.append((loss, grads))
    return seen, [p.detach().clone() for p in model.parameters()]


def _equal(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_eager_backend_equals_plain_eager(name):
    eager_steps, eager_params = _train(MODELS[name], captured=False)
    steps, params = _train(MODELS[name], captured=True)
    for i, ((loss, grads), (want, wanted)) in enumerate(zip(steps, eager_steps)):
        assert torch.equal(loss, want), f"{name}: loss of step {i}: {loss} vs eager {want}"
        differ = [j for j, (g, w) in enumerate(zip(grads, wanted)) if not _equal(g, w)]
        assert not differ, f"{name}: step {i}: gradients of parameters {differ} differ from eager"
    assert all(torch.equal(p, q) for p, q in zip(params, eager_params)), f"{name}: parameters differ"


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_would_change_the_conv_model():
    """The models above can tell: a pass-through dispatch mode changes GatedConvNet's gradients."""
    torch.manual_seed(0)
    model = GatedConvNet()
    x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 2)

    def grads(mode: bool):
        model.zero_grad(set_to_none=True)
        with _PassThrough() if mode else torch.enable_grad():
            _mse(model, x, y).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain, moded = grads(False), grads(True)
    assert not all(torch.equal(a, b) for a, b in zip(plain, moded))


def test_an_error_in_the_eager_backends_capture_call_is_raised_once_as_eager_raises_it():
    """The eager backend's capture is an eager step under no undo log: an out-of-memory error there is
    not retried as another warm-up (which would repeat what the failed step wrote), it is raised."""
    torch.manual_seed(0)
    model, opt, data, loss_of = _tiny()
    seen = []
    calls = iter(range(100))

    def step(x, y):
        seen.append(x)  # a write eager makes once per call (the eager backend watches none)
        if next(calls) == 3:  # calls 0-2 warm up, call 3 is the capture
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()

    captured = graphstep.capture(step, model=model, optimizer=opt, config=graphstep.Config(backend="eager"))
    for x, y in data[:3]:
        captured(x, y)
    with pytest.raises(graphstep.errors.GraphStepError, match="out of memory"):
        captured(*data[3])
    assert len(seen) == 4, "the failed call ran once"
