"""The trusted list on a GPU: torch code it names runs inside a captured step and equals eager
bitwise — activation checkpointing with dropout (the RNG state it stashes and puts back), module hooks
with a full backward hook, and fp16's GradScaler with an unfused optimizer (its inf check an eager
segment)."""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_common import assert_same_params, deterministic, needs_cuda

import graphstep
from graphstep.optim import make_capturable

pytestmark = needs_cuda
STEPS = 10


class Block(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        # reentrant checkpointing recomputes only when an input needs a gradient: feed it a layer's output
        self.pre = torch.nn.Linear(64, 64)
        self.inner = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.2))
        self.out = torch.nn.Linear(128, 1)
        self.out.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 0.5,))

    def forward(self, x):  # (B, 64) -> (B, 1)
        h = torch.utils.checkpoint.checkpoint(self.inner, self.pre(x), use_reentrant=self.reentrant)
        return self.out(h)


def _run(model, opt, scaler, data, captured: bool):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16 if scaler is not None else torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if scaler is None:
            loss.backward()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
        return loss

    if captured:
        step = graphstep.capture(step, model=model, optimizer=opt)
    torch.manual_seed(1)
    torch.cuda.manual_seed(1)
    with deterministic():
        losses = [step(x, y) for x, y in data]
    if captured:
        assert step.stats.replays == STEPS - 3, step.stats  # 3 warm-ups; the capturing call replays too
        step.close()
    return losses


@pytest.mark.parametrize("scaled", [False, True], ids=["bf16", "fp16-gradscaler"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_with_dropout_hooks_and_grad_scaler_bitwise_equal_to_eager(reentrant, scaled):
    torch.manual_seed(0)
    model = Block(reentrant).cuda()
    twin = copy.deepcopy(model)
    runs = []
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)  # not fused: GradScaler's segment
        make_capturable(opt, "cuda")
        runs.append((m, opt, torch.amp.GradScaler("cuda") if scaled else None))
    g = torch.Generator(device="cuda").manual_seed(2)
    data = [(torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 1, device="cuda", generator=g))]
    data = data * STEPS
    eager = _run(*runs[0], data, captured=False)
    graphed = _run(*runs[1], data, captured=True)
    for i, (a, b) in enumerate(zip(eager, graphed, strict=True)):
        assert torch.equal(a, b), f"call {i}: {a.item()} != {b.item()}"
    assert_same_params(model, twin)
