"""Shared pieces of the GPU tests: a deterministic GPT set-up and an eager-vs-graphstep runner."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import pytest
import torch

import graphstep
from graphstep.demo.gpt import GPT, GPTConfig, make_batches
from graphstep.demo.train import deterministic  # noqa: F401  (the GPU tests import it from here)

needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMALL = GPTConfig(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)


def gpt_pair(cfg: GPTConfig = SMALL, **adamw) -> tuple[tuple, tuple]:
    """Two identical (model, AdamW) pairs on the GPU: one for eager, one for graphstep."""
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    twin = copy.deepcopy(model)
    options = {"lr": 1e-3, **adamw}
    pairs = []
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), **options)
        graphstep.optim.make_capturable(opt, "cuda")  # what graphstep does to the captured one
        pairs.append((m, opt))
    return pairs[0], pairs[1]


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def lm_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable:
    """`train_step` for a transformers causal LM: `step(ids)` predicts the ids themselves, `step(ids,
    labels)` the labels."""

    def step(ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids if labels is None else labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def batches(n: int, batch_size: int = 4, cfg: GPTConfig = SMALL, seed: int = 0) -> list:
    return make_batches(cfg, batch_size=batch_size, n_batches=n, seed=seed, device="cuda")


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs: max |diff| {(p - q).abs().max().item():.3g}"


def assert_same_losses(eager: list, graphed: list) -> None:
    for i, (e, g) in enumerate(zip(eager, graphed, strict=True)):
        assert torch.equal(e, g), f"step {i}: eager loss {e.item()!r} != graphstep loss {g.item()!r}"


def run(step: Callable, data: list) -> list[torch.Tensor]:
    return [step(x, y) for x, y in data]


__all__ = ["graphstep"]


@contextlib.contextmanager
def transformers_capture_path() -> Iterator[None]:
    """Run transformers' code as it runs while a stream captures (explicit masks, no host
    checks), so an eager twin is comparable bitwise with the captured step."""
    from transformers.utils import import_utils  # is_tracing() asks this module's function

    original = import_utils.is_cuda_stream_capturing
    import_utils.is_cuda_stream_capturing = lambda: True
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = original
