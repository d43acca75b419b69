"""transformers' MoE experts backends on the CPU recording backend (which refuses host reads as a CUDA
capture does): where each one stops a capture, and that the break is the smallest piece, bitwise equal
to eager. About 12 s on two cores: three tiny Mixtrals, each warmed up, captured and replayed (a break
costs one more warm-up and capture). tests/gpu/test_moe_gpu.py asserts the break counts on a GPU, where only real device-to-host
reads stop a capture (results: benchmarks/results/cpu_2026-11-27_moe-break-causes.md)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import graphstep
from graphstep.backends import libraries

transformers = pytest.importorskip("transformers")
if not hasattr(transformers.MixtralConfig(), "_experts_implementation"):
    pytest.skip("this transformers has no experts implementations", allow_module_level=True)


def mixtral(implementation: str, aux: bool):
    config = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        output_router_logits=aux,
        router_aux_loss_coef=0.02,
        experts_implementation=implementation,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def lm_step(model, opt):
    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def train(implementation: str, aux: bool, calls: int = 6):
    """A captured Mixtral against its eager twin (on transformers' capture path, as graphstep's warm-ups
    and capture run it), bitwise: the step's stats."""
    model = mixtral(implementation, aux)
    twin = copy.deepcopy(model)
    opt, opt_twin = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin))
    config = graphstep.Config(backend="recording", warmup_steps=2, optimizer_mode="graph")
    step = graphstep.capture(lm_step(model, opt), model=model, optimizer=opt, config=config)
    eager = lm_step(twin, opt_twin)
    g = torch.Generator().manual_seed(0)
    torch.use_deterministic_algorithms(True)  # the backward's index_put accumulates in one order
    try:
        for i in range(calls):
            ids = torch.randint(0, 64, (2, 16), generator=g)
            with libraries.as_captured():
                want = eager(ids)
            got = step(ids)
            assert torch.equal(want, got), f"call {i}: {got} != eager {want}"
    finally:
        torch.use_deterministic_algorithms(False)
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    step.close()
    return step.stats


def test_batched_mm_experts_and_the_auxiliary_loss_are_captured_whole():
    """`batched_mm` gathers each token's expert weights (no data-dependent shape) and the auxiliary loss
    counts tokens per expert with `histc` (transformers 5.24; 5.17 used `bincount`, which reads the
    largest index on the host): nothing stops the capture."""
    stats = train("batched_mm", aux=True, calls=4)
    assert stats.graph_breaks == 0 and stats.captures == 1, stats


def test_eager_experts_break_at_the_experts_module(caplog):
    """The loop over the experts that got tokens (`nonzero`, then `torch.where`) has data-dependent
    shapes: the experts module (not the decoder layer) runs eagerly."""
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        stats = train("eager", aux=True)
    assert stats.graph_breaks == 1 and stats.captures == 1, stats
    assert "model.model.layers.0.mlp.experts (and the 1 other MixtralExperts" in caplog.text


def test_grouped_mm_reading_its_offsets_on_the_host_breaks_one_matmul(monkeypatch, caplog):
    """On CUDA, torch's `grouped_mm` has a sync-free kernel only for bf16 on sm90/sm100; otherwise (float32
    weights under autocast, say) it copies the offsets to the host and loops over the groups. Stood in
    for here: the break is transformers' `_grouped_mm` (one grouped matmul), while routing, sort, `histc`
    and the gather around it stay in the graph."""
    real = torch.nn.functional.grouped_mm

    def host_offsets(a, b, offs=None, **kwargs):
        [int(o) for o in offs]  # the fallback's `offs.cpu()`
        return real(a, b, offs=offs, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", host_offsets)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        stats = train("grouped_mm", aux=True)
    assert stats.graph_breaks == 1 and stats.captures == 1, stats
    assert "transformers.integrations.moe._grouped_mm runs eagerly" in caplog.text
    import transformers.integrations.moe as moe

    assert moe._grouped_mm.__name__ == "_grouped_mm"  # put back when the step closed
