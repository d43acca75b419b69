"""Graph breaks on a GPU: pieces no CUDA graph can record (token dispatch, CTC loss, a matcher on the
host) run eagerly, forward and backward, between the graphs of the rest of the step; bitwise equal to
eager in deterministic mode."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from gpu_common import deterministic, lm_step, needs_cuda

import graphstep

sys.path.insert(0, str(Path(__file__).parents[1]))
from break_models import CTCHead, CTCNet, MoENet, SetCriterion, SharedNet, TiedLM, TinyDETR, ctc_batches

pytestmark = needs_cuda


def twins(make, opt=lambda ps: torch.optim.AdamW(ps, lr=1e-3)):
    """Two identical (model, optimizer) pairs; both optimizers made capturable as graphstep makes the
    captured one (lr as a device tensor), so that eager computes the same update."""
    torch.manual_seed(0)
    model = make().cuda()
    twin = copy.deepcopy(model)
    pairs = []
    for m in (model, twin):
        o = opt(m.parameters())
        graphstep.optim.make_capturable(o, "cuda")
        pairs.append((m, o))
    return pairs[0], pairs[1]


def moe_step(model, opt, *, amp=True):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return loss

    return step


def compare(eager, step, data, models, seeds=True):
    with deterministic():
        for i, batch in enumerate(data):
            torch.manual_seed(i)
            want = eager(*batch)
            torch.manual_seed(i)
            got = step(*batch)
            assert torch.equal(want, got), f"step {i}: loss {got.item()} != eager {want.item()}"
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p, q), f"parameter {name} differs"


def moe_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 32, 16, generator=g).cuda(), torch.randn(8, 32, 1, generator=g).cuda())
        for _ in range(n)
    ]


def test_a_marked_moe_layer_runs_eagerly_between_graphs_and_trains_bitwise():
    (m_e, o_e), (m_g, o_g) = twins(MoENet)
    for block in m_g.blocks:
        graphstep.eager_segment(block.experts)
    step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g)
    compare(moe_step(m_e, o_e), step, moe_data(8), (m_e, m_g))
    assert step.stats.captures == 1 and step.stats.replays == 8 - step.stats.warmup_calls


def test_a_moe_layer_with_token_dispatch_breaks_the_graph_by_itself_and_trains_bitwise():
    (m_e, o_e), (m_g, o_g) = twins(MoENet)
    step = graphstep.capture(moe_step(m_g, o_g), model=m_g, optimizer=o_g)
    compare(moe_step(m_e, o_e), step, moe_data(10), (m_e, m_g))
    assert step.stats.graph_breaks == 1  # both layers' Experts: one class, one break
    assert step.stats.captures == 1 and step.stats.replays == 10 - step.stats.warmup_calls


def test_breaks_off_refuses_as_before():
    (_, _), (m_g, o_g) = twins(MoENet)
    step = graphstep.capture(
        moe_step(m_g, o_g), model=m_g, optimizer=o_g, config=graphstep.Config(graph_breaks="off")
    )
    data = moe_data(5)
    with deterministic(), pytest.raises(graphstep.errors.HostSyncError, match=r"torch\.where"):
        for x, y in data:
            step(x, y)


def mixtral(implementation):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        experts_implementation=implementation,
    )
    return lambda: transformers.MixtralForCausalLM(config)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_mixtral_with_its_auxiliary_loss_trains_bitwise_with_graph_breaks(implementation):
    from gpu_common import transformers_capture_path

    (m_e, o_e), (m_g, o_g) = twins(mixtral(implementation))
    step = graphstep.capture(lm_step(m_g, o_g), model=m_g, optimizer=o_g)
    g = torch.Generator().manual_seed(0)
    data = [(ids.cuda(), ids.cuda()) for ids in torch.randint(0, 128, (10, 4, 32), generator=g)]
    with transformers_capture_path():  # the eager twin takes the path a capture takes
        compare(lm_step(m_e, o_e), step, data, (m_e, m_g))
    step.close()  # takes the breaks off: the auxiliary loss function is transformers' again
    # the experts module ("eager": nonzero) or one grouped matmul (float32 weights: torch's fallback reads
    # the offsets on the host); the auxiliary loss none (5.24 counts with histc; 5.17's bincount is counted
    # on the device while capturing, backends/sync_free.py)
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1, step.stats


def test_ctc_loss_with_host_lengths_that_change_every_batch_trains_bitwise():
    head = CTCHead()

    def make_step(model, opt):
        def step(x, targets, input_lengths, target_lengths):
            loss = head(model(x), targets, input_lengths, target_lengths)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss

        return step

    (m_e, o_e), (m_g, o_g) = twins(CTCNet)
    step = graphstep.capture(make_step(m_g, o_g), model=m_g, optimizer=o_g)
    data = [(x.cuda(), t, i, n) for x, t, i, n in ctc_batches(10)]
    compare(make_step(m_e, o_e), step, data, (m_e, m_g))
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1, step.stats


def test_a_detr_matcher_on_the_host_trains_bitwise():
    criterion_e, criterion_g = SetCriterion(3), SetCriterion(3)

    def make_step(model, opt, criterion):
        def step(x, labels, boxes):
            logits, pred = model(x)
            loss = criterion(logits, pred, labels, boxes)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    (m_e, o_e), (m_g, o_g) = twins(TinyDETR)
    step = graphstep.capture(make_step(m_g, o_g, criterion_g), model=m_g, optimizer=o_g)
    g = torch.Generator().manual_seed(0)
    data = [
        (
            torch.randn(4, 16, generator=g).cuda(),
            torch.randint(0, 3, (4, 3), generator=g).cuda(),
            torch.rand(4, 3, 4, generator=g).cuda(),
        )
        for _ in range(10)
    ]
    compare(make_step(m_e, o_e, criterion_e), step, data, (m_e, m_g))
    # the matcher, then the loss around it (the matcher hands host tensors to what follows)
    assert step.stats.graph_breaks == 2 and step.stats.captures == 1, step.stats


def test_fp16_with_a_grad_scaler_and_accumulation_around_breaks_trains_bitwise():
    def make_step(model, opt, scaler):
        def step(x, y):
            for xs, ys in zip(x.chunk(2), y.chunk(2)):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(xs).float(), ys) / 2
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss.detach()

        return step

    (m_e, o_e), (m_g, o_g) = twins(MoENet)
    s_e, s_g = torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")
    step = graphstep.capture(make_step(m_g, o_g, s_g), model=m_g, optimizer=o_g)
    compare(make_step(m_e, o_e, s_e), step, moe_data(10), (m_e, m_g))
    assert s_e.get_scale() == s_g.get_scale()
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1, step.stats


def test_a_compiled_model_around_a_marked_segment_trains_bitwise():
    (m_e, o_e), (m_g, o_g) = twins(MoENet)
    for block in m_g.blocks:  # dynamo breaks its own graph at the segment and runs it eagerly
        graphstep.eager_segment(block.experts)
    c_e, c_g = torch.compile(m_e), torch.compile(m_g)
    step = graphstep.capture(moe_step(c_g, o_g), model=m_g, optimizer=o_g)
    compare(moe_step(c_e, o_e), step, moe_data(10), (m_e, m_g))
    assert step.stats.captures == 1, step.stats


def test_a_torchmetrics_update_with_its_checks_runs_as_a_break():
    torchmetrics = pytest.importorskip("torchmetrics")
    metrics = [
        torchmetrics.classification.MulticlassAccuracy(num_classes=4, validate_args=True).cuda()
        for _ in range(2)
    ]

    def make(model, opt, metric):
        def step(x, labels):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            metric(logits.detach(), labels)  # forward: update, with its argument checks (host reads)
            return loss

        return step

    (m_e, o_e), (m_g, o_g) = twins(
        lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    )
    step = graphstep.capture(make(m_g, o_g, metrics[1]), model=m_g, optimizer=o_g)
    g = torch.Generator().manual_seed(0)
    data = [
        (torch.randn(16, 8, generator=g).cuda(), torch.randint(0, 4, (16,), generator=g).cuda())
        for _ in range(8)
    ]
    compare(make(m_e, o_e, metrics[0]), step, data, (m_e, m_g))
    assert torch.equal(metrics[0].compute(), metrics[1].compute())
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1, step.stats


# -- data flow around a break: a tensor used inside the break and outside it (grad_order.py) ----------


def shared_step(model, opt, loss_fn=torch.nn.functional.mse_loss):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):  # bf16 sums: any other order shows at once
            loss = loss_fn(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def token_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-2, 1, 12)
    return [
        ((torch.randn(64, 12, generator=g) * spread).cuda(), torch.randn(64, 1, generator=g).cuda())
        for _ in range(n)
    ]


@pytest.mark.parametrize("stream", ["bf16", "fp32"])
@pytest.mark.parametrize("breaks", ["auto", "marked"])
@pytest.mark.parametrize("kind", ["residual", "postnorm", "chain"])
def test_a_break_whose_input_is_used_outside_it_trains_bitwise(kind, breaks, stream):
    """`h + mix(h)` (the residual reads the break's own input), BERT's `norm(h + mix(h))`, two breaks
    in a row reading `h`: each use's gradient is added in eager's order. Where the break's input is a
    float32 activation (a norm's result, a float32 residual stream: `stream`), autocast casts it anew
    at each Linear inside, and each cast's gradient is added in float32 on its own."""
    make = lambda: SharedNet(kind, sync=breaks == "auto", stream32=stream == "fp32")  # noqa: E731
    (m_e, o_e), (m_g, o_g) = twins(make)
    if breaks == "marked":
        for mix in [*m_g.mix, *m_g.mix2]:
            graphstep.eager_segment(mix)
    step = graphstep.capture(shared_step(m_g, o_g), model=m_g, optimizer=o_g)
    compare(shared_step(m_e, o_e), step, token_data(20), (m_e, m_g))
    assert step.stats.captures == 1 and step.stats.graph_breaks == (breaks == "auto"), step.stats


@pytest.mark.parametrize("breaks", ["auto", "marked"])
def test_tied_embedding_weights_used_inside_a_break_and_by_the_head_train_bitwise(breaks):
    """The table is looked up twice inside the break and read by the head after it (cast by autocast
    there, not inside: embedding lookups take it as it is)."""
    (m_e, o_e), (m_g, o_g) = twins(TiedLM)
    if breaks == "marked":
        graphstep.eager_segment(m_g.embed)
    loss_fn = torch.nn.functional.cross_entropy
    step = graphstep.capture(shared_step(m_g, o_g, loss_fn), model=m_g, optimizer=o_g)
    g = torch.Generator().manual_seed(0)
    data = [(ids.cuda(), ids.roll(1).cuda()) for ids in torch.randint(0, 24, (20, 64), generator=g)]
    compare(shared_step(m_e, o_e, loss_fn), step, data, (m_e, m_g))
    assert step.stats.captures == 1 and step.stats.graph_breaks == (breaks == "auto"), step.stats


def test_a_segment_replays_transformers_code_on_the_path_its_warm_ups_took():
    """transformers builds an explicit causal mask while a stream captures, and with an all-ones
    `attention_mask` none otherwise (SDPA's `is_causal`): two kernels, two results. graphstep's warm-ups
    take the capture path; a segment holding that code must take it at replay too (before issue 42 it took
    the other path there, and its replays computed another function than its warm-ups)."""
    transformers = pytest.importorskip("transformers")
    from gpu_common import transformers_capture_path

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    (m_e, o_e), (m_g, o_g) = twins(lambda: transformers.LlamaForCausalLM(config))
    graphstep.eager_segment(m_g.model)  # the decoder (mask, layers, norm) eagerly; the head in graphs

    def make(model, opt):
        def step(ids, mask):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    step = graphstep.capture(make(m_g, o_g), model=m_g, optimizer=o_g)
    g = torch.Generator().manual_seed(0)
    data = [
        (ids.cuda(), torch.ones_like(ids).cuda()) for ids in torch.randint(0, 128, (8, 4, 32), generator=g)
    ]
    with transformers_capture_path():  # the eager twin takes the path a capture takes
        compare(make(m_e, o_e), step, data, (m_e, m_g))
    assert step.stats.captures == 1 and step.stats.replays == 8 - step.stats.warmup_calls, step.stats
