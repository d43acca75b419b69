"""transformers' MoE families on a GPU, per experts backend, with and without the auxiliary loss: trained
bitwise against an eager twin, with the number of graph breaks each must make (0 where the library's
code has no device-to-host read) and the peak memory of the step against eager's, printed.

Where a capture stops on CUDA (benchmarks/results/cpu_2026-11-27_moe-break-causes.md):
- `"eager"` experts: `nonzero` over the experts hit, then `torch.where` per expert (data-dependent
  shapes): the experts module breaks, every layer's, one break.
- `"grouped_mm"`: torch's sync-free grouped matmul takes bf16 operands on sm90/sm100 only; float32
  expert weights (autocast leaves parameters float32) take its fallback, which copies the offsets to the
  host: transformers' `_grouped_mm` breaks (one matmul, not the experts module). With bf16 weights on an
  H100: no break.
- `"batched_mm"`: no break.
- the auxiliary loss: none. transformers 5.24 counts with `histc`; 5.17 calls
  `torch.bincount(..., minlength=num_experts)`, which reads the largest index on the host, and graphstep
  counts that on the device while it captures (backends/sync_free.py; it broke there before).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from gpu_common import deterministic, lm_step, needs_cuda, transformers_capture_path

import graphstep

pytestmark = needs_cuda
transformers = pytest.importorskip("transformers")

FAMILIES = {
    "mixtral": ("Mixtral", dict(num_local_experts=4, intermediate_size=64)),
    "qwen3_moe": (
        "Qwen3Moe",
        dict(num_experts=4, moe_intermediate_size=32, intermediate_size=64, head_dim=16),
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(
            num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=64
        ),
    ),
    "olmoe": ("Olmoe", dict(num_experts=4, intermediate_size=64)),
    "deepseek_v3": (
        "DeepseekV3",
        dict(
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            moe_intermediate_size=32,
            intermediate_size=64,
            first_k_dense_replace=0,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            n_shared_experts=1,
            num_key_value_heads=4,
        ),
    ),
    "gpt_oss": ("GptOss", dict(num_local_experts=4, intermediate_size=64, head_dim=16, sliding_window=16)),
}
VOCAB = 128


def build(family: str, implementation: str, aux: bool) -> torch.nn.Module:
    prefix, extra = FAMILIES[family]
    options = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        experts_implementation=implementation,
        output_router_logits=aux,
        router_aux_loss_coef=0.02,
    )
    options.update(extra)
    config = getattr(transformers, f"{prefix}Config")(**options)
    torch.manual_seed(0)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).cuda()


def has_aux_loss(family: str) -> bool:
    return hasattr(sys.modules[build_class(family).__module__], "load_balancing_loss_func")


def build_class(family: str):
    prefix, _ = FAMILIES[family]
    return getattr(transformers, f"{prefix}ForCausalLM")


def grouped_mm_without_host_read(weights: torch.dtype) -> bool:
    """torch's grouped matmul has a kernel that reads no offsets on the host: bf16, sm90/sm100."""
    return weights == torch.bfloat16 and torch.cuda.get_device_capability()[0] in (9, 10)


def expected_breaks(implementation: str, weights: torch.dtype) -> int:
    experts = {
        "eager": 1,
        "batched_mm": 0,
        "grouped_mm": 0 if grouped_mm_without_host_read(weights) else 1,
    }[implementation]
    return experts  # the auxiliary loss: none (histc, or bincount counted on the device: sync_free.py)


def peak_of(run) -> tuple[list, int]:
    """`run()`'s results and the most memory it allocated above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    results = run()
    torch.cuda.synchronize()
    return results, torch.cuda.max_memory_allocated() - before


def check(family: str, implementation: str, aux: bool, weights: torch.dtype = torch.float32, calls: int = 8):
    if aux and not has_aux_loss(family):
        pytest.skip(f"{family} has no auxiliary loss in this transformers")
    model = build(family, implementation, aux).to(weights)
    twin = copy.deepcopy(model)
    opts = []
    for m in (model, twin):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        graphstep.optim.make_capturable(opt, "cuda")
        opts.append(opt)
    g = torch.Generator().manual_seed(0)
    data = [ids.cuda() for ids in torch.randint(0, VOCAB, (calls, 4, 32), generator=g)]
    step = graphstep.capture(lm_step(model, opts[0]), model=model, optimizer=opts[0])
    eager = lm_step(twin, opts[1])
    if family == "gpt_oss":
        # On CUDA its capture stops outside the experts too (in the model's sliding-window mask), so
        # the break moves out to the whole model, whose output holds a DynamicCache: refused, clearly
        # (seen on an H100 with transformers 5.17 and 5.24, every backend). A known limit.
        with pytest.raises(graphstep.GraphStepError, match="returns a DynamicCache"), deterministic():
            for ids in data:
                step(ids)
        step.close()
        return
    with deterministic():
        with transformers_capture_path():  # the eager twin takes the path a capture takes
            want, eager_peak = peak_of(lambda: [eager(ids) for ids in data])
        got, graph_peak = peak_of(lambda: [step(ids) for ids in data])
    step.close()
    for i, (w, o) in enumerate(zip(want, got)):
        assert torch.equal(w, o), f"call {i}: loss {o.item()} != eager {w.item()}"
    for (name, p), q in zip(twin.named_parameters(), model.parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"
    print(
        f"\n{family} {implementation} aux={aux} {weights}: {step.stats.graph_breaks} breaks, peak above the "
        f"models {graph_peak / 2**20:.1f} MiB vs eager {eager_peak / 2**20:.1f} MiB "
        f"({graph_peak / max(eager_peak, 1):.2f}x)"
    )
    want_breaks = expected_breaks(implementation, weights)
    assert step.stats.graph_breaks == want_breaks and step.stats.captures == 1, step.stats


@pytest.mark.parametrize("aux", [False, True], ids=["no_aux", "aux"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_family_trains_bitwise_with_the_breaks_its_code_needs(family, implementation, aux):
    check(family, implementation, aux)


@pytest.mark.parametrize("aux", [False, True], ids=["no_aux", "aux"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_grouped_mm_with_bf16_weights_is_captured_whole_on_hopper(family, aux):
    """bf16 expert weights take torch's sync-free grouped matmul on sm90/sm100: no break there."""
    check(family, "grouped_mm", aux, weights=torch.bfloat16)


def test_a_break_leaves_no_pool_of_cached_blocks_behind():
    """A graph break is a capture that failed inside CUDA; its pool held the warm-ups' cached blocks (an
    eager step's peak) and, before issue 42, stayed reserved for good: a step with a break reserved
    about twice eager's memory. After the break, every wholly free segment of that pool can go back."""
    model = build("mixtral", "eager", aux=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = graphstep.capture(lm_step(model, opt), model=model, optimizer=opt)
    g = torch.Generator().manual_seed(0)
    first = None
    for ids in torch.randint(0, VOCAB, (8, 4, 32), generator=g):
        step(ids.cuda())
        first = first or tuple(step._ctx.backend.pool)  # the warm-ups' pool, abandoned at the break
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1, step.stats
    assert tuple(step._ctx.backend.pool) != first
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # a pool no graph holds a reference to gives its free segments back here
    left = [
        (s["total_size"], s["allocated_size"])
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", (0, 0))) == first
    ]
    step.close()
    print(
        f"\nthe abandoned pool keeps {len(left)} segments, {sum(t for t, _ in left) / 2**20:.1f} MiB: {left}"
    )
    assert all(allocated > 0 for _, allocated in left), (
        f"wholly free segments left in the abandoned pool: {left}"
    )
