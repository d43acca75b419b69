"""Shared pieces of the CPU tests: a small model trained with SGD, and its eager twin."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from graphstep.guards import tracing


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 8)
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def make_training(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def sgd_step(model, opt):
    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def plain_step(model, opt):
    """The training step most tests capture: loss, backward, the optimizer's step, zero_grad."""

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def make_twins():
    """(eager model, eager opt), (graphstep model, graphstep opt), identical at the start."""
    model, opt = make_training()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    return (model, opt), (twin, twin_opt)


def batches(n: int, batch_size: int = 4, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 1, generator=g)) for _ in range(n)
    ]


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module", autouse=True, params=tracing.available())
def each_tracer(request):
    """The watches' tracer (guards/tracing.py), each one this Python offers: `sys.settrace` and
    `sys.setprofile`, and on Python >= 3.12 `sys.monitoring` too. Imported by the test files of the
    watches (writes, reads, host draws) to run them under each; module-scoped (hypothesis refuses
    function-scoped fixtures)."""
    before = os.environ.get("GRAPHSTEP_TRACER")
    os.environ["GRAPHSTEP_TRACER"] = request.param
    yield request.param
    if before is None:
        del os.environ["GRAPHSTEP_TRACER"]
    else:
        os.environ["GRAPHSTEP_TRACER"] = before
