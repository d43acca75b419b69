"""The inputs users pass, on a GPU, bitwise against an eager twin: a transformers `BatchEncoding` as the
step's argument, packed-document training with a FlexAttention `BlockMask` built every batch (passed in
and set on the module) under compiled FlexAttention, and torchvision's Faster R-CNN whose targets hold
a box count per image that changes every batch. Deterministic mode; a model whose package is missing
is skipped, saying so."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from gpu_common import assert_same_params, deterministic, needs_cuda, transformers_capture_path

import graphstep
from graphstep.optim import make_capturable

pytestmark = needs_cuda
STEPS = 16


def twins(make_model, make_opt):
    torch.manual_seed(0)
    model = make_model().cuda()
    out = []
    for m in (model, copy.deepcopy(model)):
        opt = make_opt(m)
        make_capturable(opt, "cuda")  # the settings graphstep gives the captured one
        out.append((m, opt))
    return out


def side_by_side(pair, make_step, batches, before=None, config=None):
    """Train both twins on `batches` (each a tuple of arguments), comparing every loss bitwise.
    `before(i, model)`: set up call i on a model (a mask on a module)."""
    (m_e, o_e), (m_g, o_g) = pair
    eager = make_step(m_e, o_e)
    step = graphstep.capture(make_step(m_g, o_g), model=m_g, optimizer=o_g, config=config)
    for i, batch in enumerate(batches):
        losses = []
        for fn, model in ((eager, m_e), (step, m_g)):
            if before is not None:
                before(i, model)
            torch.manual_seed(i)
            losses.append(fn(*batch))
        assert torch.equal(losses[0], losses[1]), f"step {i}: eager {losses[0]!r} != graphstep {losses[1]!r}"
    assert_same_params(m_e, m_g)
    print(f"{step.__name__}: {step.stats}")
    return step


# -- a transformers BatchEncoding -------------------------------------------------------------------


def test_a_batch_encoding_argument_trains_a_bert_bitwise_with_one_capture():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )

    def make_step(model, opt):
        def step(batch):  # what a tokenizer returns, labels added: `model(**batch)`
            assert isinstance(batch, transformers.BatchEncoding)  # the user's type, rebuilt at capture
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(512, (4, 64), generator=g)
        mask = torch.ones(4, 64, dtype=torch.int64)
        mask[0, 40:] = 0  # padding in one row: the mask matters
        labels = torch.randint(2, (4,), generator=g)
        data = {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": labels.cuda()}
        batches.append((transformers.BatchEncoding(data),))
    pair = twins(
        lambda: transformers.BertForSequenceClassification(cfg),
        lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4),
    )
    with deterministic(), transformers_capture_path():
        step = side_by_side(pair, make_step, batches)
    assert step.stats.captures == 1 and step.stats.replays == STEPS - 3


# -- packed documents, a BlockMask per batch, compiled FlexAttention -----------------------------------

SEQ, DIM, HEADS, VOCAB = 512, 64, 4, 256


class PackedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM)
        )

    def forward(self, x, block_mask, flex):  # x: (B, SEQ, DIM)
        b = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(b, SEQ, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = flex(q, k, v, block_mask=block_mask).transpose(1, 2).reshape(b, SEQ, DIM)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class PackedLM(torch.nn.Module):
    """A tiny transformer over packed documents: attention stays inside each document (FlexAttention,
    compiled as users run it). The mask comes in as an argument, or is set on `self.block_mask`."""

    def __init__(self) -> None:
        super().__init__()
        from torch.nn.attention.flex_attention import flex_attention

        self.flex = torch.compile(flex_attention)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(PackedBlock() for _ in range(2))
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.block_mask = None

    def forward(self, ids, block_mask=None):  # ids: (B, SEQ)
        mask = block_mask if block_mask is not None else self.block_mask
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h, mask, self.flex)
        return self.head(h)


def document_mask(doc):  # doc: (SEQ,) the document id of each position, on the GPU
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b, h, q, kv):  # closes over this batch's document ids
        return (doc[q] == doc[kv]) & (q >= kv)

    return create_block_mask(document_causal, None, None, SEQ, SEQ, device="cuda")


def packed_batches(n):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        doc = torch.zeros(SEQ, dtype=torch.long)
        for cut in torch.randint(1, SEQ, (5,), generator=g).tolist():
            doc[cut:] += 1
        out.append((torch.randint(VOCAB, (2, SEQ), generator=g).cuda(), doc.cuda()))
    return out


@pytest.mark.parametrize("on_module", [False, True], ids=["passed_in", "on_module"])
def test_packed_documents_with_a_new_block_mask_every_batch_are_one_graph_bitwise(on_module):
    def make_step(model, opt):
        def step(ids, block_mask=None):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, block_mask)
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss

        return step

    data = packed_batches(STEPS)
    masks = [document_mask(doc) for _, doc in data]
    assert len({m.to_dense().sum().item() for m in masks}) > 1, "the batches pack their documents differently"
    if on_module:
        batches = [(ids,) for ids, _ in data]

        def before(i, model):
            model.block_mask = masks[i]
    else:
        batches = [(ids, mask) for (ids, _), mask in zip(data, masks)]
        before = None
    pair = twins(PackedLM, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    with deterministic():
        step = side_by_side(pair, make_step, batches, before=before)
    assert step.stats.captures == 1, step.stats
    assert step.stats.replays >= STEPS - 5, step.stats  # a warm-up that compiled is followed by another


# -- torchvision's Faster R-CNN, a box count per image that changes every batch -----------------------


def detection_batches(n, fixed=0, images=2, size=320, classes=5):
    """`n` batches of (images, targets); the first `fixed` keep one box count per image."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        counts = [3] * images if i < fixed else torch.randint(1, 8, (images,), generator=g).tolist()
        targets = []
        for k in counts:
            xy = torch.rand(k, 2, generator=g) * (size - 64)
            wh = 16 + torch.rand(k, 2, generator=g) * 48
            boxes = torch.cat([xy, xy + wh], dim=1)
            targets.append(
                {"boxes": boxes.cuda(), "labels": torch.randint(1, classes, (k,), generator=g).cuda()}
            )
        out.append(([torch.rand(3, size, size, generator=g).cuda() for _ in range(images)], targets))
    return out


def detection_step(model, opt):
    def step(images, targets):
        losses = model(images, targets)
        loss = sum(losses.values())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def faster_rcnn(tv):
    return tv.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None, weights_backbone=None, num_classes=5
    )


def test_faster_rcnn_marked_as_a_segment_trains_with_a_changing_box_count_in_one_graph():
    tv = pytest.importorskip("torchvision")
    pair = twins(lambda: faster_rcnn(tv), lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    graphstep.eager_segment(pair[1][0])  # the detector runs eagerly; its targets are not part of the key
    batches = detection_batches(STEPS)
    assert len({tuple(len(t["boxes"]) for t in ts) for _, ts in batches}) > 8
    with deterministic():
        step = side_by_side(pair, detection_step, batches)
    # The first call keys the targets by shape; from the second on, those whose shape changed are not
    # keyed (one more graph if a count that held still at first changes later).
    assert step.stats.captures <= 2 and step.stats.replays >= STEPS - 6, step.stats


def test_faster_rcnn_with_automatic_breaks_trains_equal_to_eager_or_names_what_to_mark():
    """No marks: the capture (after calls with one box count) breaks where torchvision reads the host;
    a break in `model.transform` (it returns an ImageList) moves out to the model. Then the box count
    changes every batch: equal to eager with one more graph, or refused naming the tensors and the mark."""
    tv = pytest.importorskip("torchvision")
    pair = twins(lambda: faster_rcnn(tv), lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))
    batches = detection_batches(STEPS + 6, fixed=6)
    try:
        with deterministic():
            step = side_by_side(pair, detection_step, batches)
    except graphstep.errors.TooManyGraphsError as refused:
        assert "graphstep.eager_segment(module)" in str(refused) and "['boxes']" in str(refused), str(refused)
        return
    assert step.stats.graph_breaks >= 1 and step.stats.replays >= STEPS - 4, step.stats
