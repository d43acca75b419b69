"""Arguments used only inside eager segments, and graph breaks whose module returns no tensors: a
detector stand-in (a CPU mimic of torchvision's Faster R-CNN) whose targets hold a box count per
image that changes every batch, used only by the loss that runs as a segment, and a transform that
returns an `ImageList`-like object from an automatic break."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import graphstep
from graphstep.backends.loose import LooseMeta
from graphstep.errors import TooManyGraphsError

RECORDING = graphstep.Config(backend="recording", warmup_steps=2)


class MatchingLoss(torch.nn.Module):
    """Matches each anchor to a target box by the image's box count (a host read): eager-only code."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = torch.nn.Linear(8, 3)
        self.reg = torch.nn.Linear(8, 4)

    def forward(self, feats, targets):  # feats: (B, A, 8); targets: [{"boxes": (n, 4), "labels": (n,)}]
        losses = []
        for f, t in zip(feats, targets):
            match = torch.arange(f.shape[0]) % t["boxes"].shape[0]
            reg = torch.nn.functional.l1_loss(self.reg(f), t["boxes"][match])
            losses.append(reg + torch.nn.functional.cross_entropy(self.cls(f), t["labels"][match]))
        return torch.stack(losses).mean()


class Detector(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(4, 8)
        self.loss = MatchingLoss()

    def forward(self, images, targets):  # images: (B, A, 4)
        return self.loss(torch.relu(self.backbone(images)), targets)


def detection_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        counts = torch.randint(1, 6, (2,), generator=g).tolist()
        targets = [
            {"boxes": torch.rand(k, 4, generator=g), "labels": torch.randint(3, (k,), generator=g)}
            for k in counts
        ]
        out.append((torch.randn(2, 5, 4, generator=g), targets))
    return out


def detector_step(model, opt, *, normalise_outside=False):
    def step(images, targets):
        loss = model(images, targets)
        if normalise_outside:  # reads the targets outside the segment
            loss = loss / sum(len(t["boxes"]) for t in targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def twins(make):
    torch.manual_seed(0)
    model = make()
    twin = copy.deepcopy(model)
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (model, twin)]


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_targets_used_only_in_a_segment_are_not_keyed_and_go_to_it_every_call():
    (m_e, o_e), (m_g, o_g) = twins(Detector)
    graphstep.eager_segment(m_g.loss)
    verified = graphstep.Config(backend="recording", warmup_steps=2, verify_every=2)  # reference runs too
    eager = detector_step(m_e, o_e)
    step = graphstep.capture(detector_step(m_g, o_g), model=m_g, config=verified)
    data = detection_batches(10)
    assert len({tuple(len(t["boxes"]) for t in ts) for _, ts in data}) > 5, "box counts change every batch"
    for images, targets in data:
        assert torch.equal(eager(images, targets), step(images, targets))
    assert same_params(m_e, m_g)
    # The first call keyed the targets by shape; from the second on, one signature: 3 warm-ups in all.
    assert step.stats.captures == 1 and step.stats.replays == 6 and step.stats.warmup_calls == 3
    assert len({life.signature for life in step._lives.values() if life.graphs()}) == 1
    described = next(life for life in step._lives.values() if life.graphs()).signature.describe()
    assert "args[1][0]['boxes']: float32 of any shape on cpu (used in eager segments only)" in described
    assert "args[0]: float32[2, 5, 4]" in described, "the images the graph reads stay keyed and copied in"


@pytest.mark.filterwarnings("ignore:graphstep:UserWarning")  # signatures past max_graphs run eagerly
def test_an_argument_the_graph_also_reads_is_keyed_again_before_any_replay(caplog):
    (m_e, o_e), (m_g, o_g) = twins(Detector)
    graphstep.eager_segment(m_g.loss)
    eager = detector_step(m_e, o_e, normalise_outside=True)
    config = graphstep.Config(backend="recording", warmup_steps=2, on_too_many_graphs="eager")
    step = graphstep.capture(detector_step(m_g, o_g, normalise_outside=True), model=m_g, config=config)
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for images, targets in detection_batches(12):
            assert torch.equal(eager(images, targets), step(images, targets))
    assert same_params(m_e, m_g)
    graphed = [life.signature for life in step._lives.values() if life.graphs()]
    assert not any(isinstance(m, LooseMeta) for s in graphed for m in s.tensors), "keyed by shape again"
    text = caplog.text
    assert "args[1][0]['boxes'] changes shape from call to call" in text and "__len__" in text, text
    assert "normalise_outside" not in text and 'sum(len(t["boxes"]) for t in targets)' in text, text


def test_too_many_graphs_names_the_tensors_whose_shapes_change_and_the_segment_remedy():
    _, (m_g, o_g) = twins(Detector)  # no segment: the targets go into the graph
    step = graphstep.capture(
        detector_step(m_g, o_g), model=m_g, config=graphstep.Config(backend="recording", max_graphs=3)
    )
    with pytest.raises(TooManyGraphsError) as info:
        for images, targets in detection_batches(8, seed=5):
            step(images, targets)
    text = str(info.value)
    assert "The shapes of args[1][0]['boxes'], args[1][0]['labels']" in text, text
    assert "graphstep.eager_segment(module)" in text and "args[0]" not in text.split("The shapes")[1], text


# -- an automatic break whose module returns an ImageList ---------------------------------------------


class ImageList:
    """torchvision's: the batched images and their sizes, a class of its own (no tensor structure)."""

    def __init__(self, tensors, image_sizes):
        self.tensors, self.image_sizes = tensors, image_sizes


class Transform(torch.nn.Module):
    def forward(self, images):  # (B, A, 4)
        scale = images.abs().amax().item()  # a host read: no graph can record it
        return ImageList(images / scale, [tuple(images.shape[-2:])] * images.shape[0])


class TransformingDetector(Detector):
    def __init__(self) -> None:
        super().__init__()
        self.transform = Transform()

    def forward(self, images, targets):
        batch = self.transform(images)
        return self.loss(torch.relu(self.backbone(batch.tensors)), targets)


class Trainer(torch.nn.Module):
    """The detector inside a model, with graphed work around it: what moves out stays a part."""

    def __init__(self) -> None:
        super().__init__()
        self.detector = TransformingDetector()
        self.scale = torch.nn.Linear(1, 1)

    def forward(self, images, targets):
        return self.scale(self.detector(images, targets).reshape(1)).sum()


def test_a_break_whose_module_returns_an_image_list_moves_out_to_the_enclosing_module(caplog):
    (m_e, o_e), (m_g, o_g) = twins(Trainer)
    eager, step = (
        detector_step(m_e, o_e),
        graphstep.capture(detector_step(m_g, o_g), model=m_g, config=RECORDING),
    )
    # The break is found at a capture, which needs a few calls of one signature: the same box counts
    # first (the capture stops twice: the host read, then the moved break), then a count per image
    # that changes every batch.
    fixed = detection_batches(1, seed=3) * 4
    with caplog.at_level(logging.WARNING, logger="graphstep"):
        for images, targets in fixed + detection_batches(12, seed=4):
            assert torch.equal(eager(images, targets), step(images, targets))
    assert same_params(m_e, m_g)
    assert step.stats.graph_breaks == 1 and step.stats.captures == 1, step.stats
    assert "graph break: model.detector.transform runs eagerly" in caplog.text
    assert "model.detector.transform returns a ImageList" in caplog.text
    assert "the module around it, model.detector, runs eagerly" in caplog.text
    # The targets go to the moved break only: from the first changing batch on, one graph for all.
    assert step.stats.replays == 9, step.stats
    step.close()
    assert "forward" not in m_g.detector.__dict__ and "forward" not in m_g.detector.transform.__dict__


class _Anchors(torch.nn.Module):
    """torchvision's AnchorGenerator does this on every forward: a new list in an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = [torch.ones(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cell = [c.to(x.dtype) for c in self.cell]
        return x * self.cell[0]


class _Detector(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.anchors = _Anchors()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.anchors(self.lin(x))


def test_a_model_marked_whole_as_a_segment_may_rewrite_its_submodules_attributes_every_call():
    """The model itself is the segment: its submodules' attributes are its own business (it runs
    eagerly on every call), not state the graph of the rest of the step depends on."""
    torch.manual_seed(0)
    model = _Detector()
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    graphstep.eager_segment(model)

    def make(m, opt):
        def step(x):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    eager = make(twin, opts[1])
    step = graphstep.capture(make(model, opts[0]), model=model, optimizer=opts[0], config=RECORDING)
    for x in torch.randn(8, 2, 4):
        assert torch.equal(eager(x), step(x))
    assert step.stats.captures == 1 and step.stats.replays == 5, step.stats


def test_the_guards_watch_no_module_inside_a_model_marked_whole_as_a_segment():
    from graphstep.backends.autograd_segments import unmark
    from graphstep.guards.state_guard import named_modules

    model = _Detector()
    every = ["model", "model.lin", "model.anchors"]
    assert [n for n, _ in named_modules("model", model, graphed_only=True)] == every
    graphstep.eager_segment(model)
    assert list(named_modules("model", model, graphed_only=True)) == []
    unmark(model)
    graphstep.eager_segment(model.anchors)  # a segment below the root: the rest is watched
    assert [n for n, _ in named_modules("model", model, graphed_only=True)] == every[:2]
