"""Every optimizer of torch.optim, timm, pytorch-optimizer, schedule-free, prodigyopt and lion-pytorch
(those installed) on the GPU, in deterministic mode: bitwise equal to eager or refused at capture,
never silently different. With GRAPHSTEP_OPTIMIZER_TABLE=path the rows are written there (the table
of docs/optimizers.md). The schedule-free `train()`/`eval()` toggle between calls is tested on its own."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_common import deterministic, needs_cuda

import graphstep
import optimizer_zoo

pytestmark = needs_cuda


@pytest.fixture(scope="module")
def rows():
    found = []
    yield found
    optimizer_zoo.save_table(
        found, f"{torch.cuda.get_device_name()}, torch {torch.__version__}, deterministic mode"
    )


@pytest.mark.parametrize(
    "package, name, make",
    [pytest.param(p, n, m, id=f"{p}.{n}") for p, n, m in optimizer_zoo.everything()],
)
def test_every_optimizer_is_equal_to_eager_or_refused_on_the_gpu(package, name, make, rows):
    with deterministic():
        row = optimizer_zoo.run(package, name, make, "cuda")
    rows.append(row)
    assert not row.outcome.startswith("DIFFERS"), f"{package}.{name} trains silently wrong: {row}"


def test_schedulefree_train_eval_toggled_between_calls_on_the_gpu():
    schedulefree = pytest.importorskip("schedulefree")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).cuda()
    twin = copy.deepcopy(model)
    opts = [schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2, warmup_steps=5) for m in (model, twin)]

    def make(m, o):
        def step(x, y):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss

        return step

    eager = make(model, opts[0])
    captured = graphstep.capture(make(twin, opts[1]), model=twin, optimizer=opts[1])
    g = torch.Generator(device="cuda").manual_seed(1)
    probe = torch.randn(32, 16, device="cuda", generator=g)
    with deterministic():
        for i in range(30):
            x, y = (
                torch.randn(8, 16, device="cuda", generator=g),
                torch.randn(8, 4, device="cuda", generator=g),
            )
            for o in opts:
                o.train()
            assert torch.equal(eager(x, y), captured(x, y)), f"step {i}"
            if i % 5 == 4:
                for o in opts:
                    o.eval()
                with torch.no_grad():
                    assert torch.equal(model(probe), twin(probe)), f"evaluated weights after step {i}"
    assert captured.stats.captures == 1 and captured.stats.replays >= 25
    assert captured._ctx.modes.is_eager(opts[1])
