"""Every optimizer of the packages users bring, trained eagerly and with graphstep side by side: the
rows of the table in docs/optimizers.md.

Each optimizer comes from its package's own registry (timm's `list_optimizers`, pytorch-optimizer's
`get_supported_optimizers`) or its public classes, built with default arguments on a small MLP. One
that does not train eagerly that way (it needs a closure, an argument without a default, a Hessian)
is left out, with the reason. For the rest a row says where graphstep runs its step (in the graph or
an eager segment), whether the results are bitwise equal to eager or the capture was refused, and the
time per step of both. A result that differs from eager is the one outcome the tests fail on.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterator

import torch

import graphstep
from cpu_common import plain_step
from graphstep.errors import GraphStepError

STEPS = 10
WARMUPS = 3


@dataclasses.dataclass
class Row:
    package: str
    name: str
    mode: str = "-"
    """"graph", "segment", or "-" where graphstep never captured."""
    outcome: str = ""
    """"equal", "refused: ...", "DIFFERS: ...", or "left out: ..." (does not train eagerly with defaults)."""
    eager_ms: float | None = None
    graphstep_ms: float | None = None

    def markdown(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        return f"| {self.package} | {self.name} | {self.mode} | {self.outcome} | {ms(self.eager_ms)} | {ms(self.graphstep_ms)} |"


HEADER = (
    "| package | optimizer | step runs | result vs eager | eager ms/step | graphstep ms/step |\n"
    "|---|---|---|---|---|---|"
)


def _mlp(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    ).to(device)


def _data(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device))
        for _ in range(STEPS)
    ]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prepare(opt: torch.optim.Optimizer) -> None:
    if hasattr(opt, "train") and callable(opt.train):  # schedule-free: its step needs train mode
        opt.train()


def run(
    package: str, name: str, make: Callable[[torch.nn.Module], torch.optim.Optimizer], device: str
) -> Row:
    """One optimizer, eager and captured from the same start on the same data."""
    row = Row(package, name)
    data = _data(device)
    model = _mlp(device)
    twin = copy.deepcopy(model)
    try:
        opt = make(model)
        _prepare(opt)
        eager = plain_step(model, opt)
        eager(*data[0])  # does it train eagerly with its defaults at all?
    except Exception as exc:
        row.outcome = f"left out: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        return row
    model = copy.deepcopy(twin)
    opt = make(model)
    twin_opt = make(twin)
    if device == "cuda":  # graphstep's own choices (capturable, fused) on the eager twin too
        graphstep.optim.make_capturable(opt)
    for o in (opt, twin_opt):
        _prepare(o)
    eager = plain_step(model, opt)
    captured = graphstep.capture(
        plain_step(twin, twin_opt),
        model=twin,
        optimizer=twin_opt,
        config=graphstep.Config(backend="cuda" if device == "cuda" else "recording", warmup_steps=WARMUPS),
    )
    eager_s, graph_s = [], []
    try:
        for i, (x, y) in enumerate(data):
            for fn, times in ((eager, eager_s), (captured, graph_s)):
                torch.manual_seed(i)
                _sync(device)
                start = time.perf_counter()
                loss = fn(x, y)
                _sync(device)
                times.append(time.perf_counter() - start)
                if fn is eager:
                    want = loss
            if not torch.equal(want, loss):
                row.outcome = f"DIFFERS: loss at step {i}"
                break
    except GraphStepError as exc:
        row.outcome = f"refused: {type(exc).__name__}: {_first_words(exc)}"
    else:
        if not row.outcome:
            same = all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
            row.outcome = "equal" if same else "DIFFERS: parameters"
    ctx = captured._ctx
    if ctx is not None and captured.stats.captures:
        row.mode = "segment" if ctx.modes.is_eager(twin_opt) else "graph"
    steady = slice(WARMUPS + 1, None)  # past the warm-ups and the capturing call
    if row.outcome == "equal" and len(graph_s[steady]) > 0:
        row.eager_ms = 1e3 * sorted(eager_s[steady])[len(eager_s[steady]) // 2]
        row.graphstep_ms = 1e3 * sorted(graph_s[steady])[len(graph_s[steady]) // 2]
    captured.close()
    return row


def _first_words(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return text[:100] + ("..." if len(text) > 100 else "")


# -- the packages ------------------------------------------------------------------------------------

Maker = Callable[[torch.nn.Module], torch.optim.Optimizer]


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _installed(name: str) -> bool:
    """Whether `name` can be found, without importing it: listing rows imports no package (pytest
    collects them in every test process); a row imports its package when it runs."""
    return importlib.util.find_spec(name) is not None


def torch_optimizers() -> Iterator[tuple[str, Maker]]:
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "Adadelta",
        "Adamax",
        "ASGD",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Rprop",
    ):
        cls = getattr(torch.optim, name)
        yield (
            name,
            lambda m, cls=cls: (
                cls(m.parameters(), lr=1e-3) if cls is torch.optim.SGD else cls(m.parameters())
            ),
        )
    if hasattr(torch.optim, "Adafactor"):
        yield "Adafactor", lambda m: torch.optim.Adafactor(m.parameters())


def timm_optimizers() -> Iterator[tuple[str, Maker]]:
    optim = _module("timm.optim")
    if optim is None:
        return
    for name in optim.list_optimizers():
        yield name, lambda m, name=name: optim.create_optimizer_v2(m, opt=name, lr=1e-3)


SAMPLE = frozenset(
    {"ranger", "adabelief", "adopt", "lamb", "adan", "lion", "sgd", "rmsprop", "madgrad", "magma", "spam"}
)
"""The pytorch-optimizer rows a quick run keeps: the issue's five, one of each kind the full run found
(in the graph, a segment, state under a non-parameter key, a wrapper that skips Optimizer.__init__)."""


def pytorch_optimizer_optimizers(full: bool = True) -> Iterator[tuple[str, Maker]]:
    if not full:  # the names of SAMPLE, the package imported when a row runs
        if _installed("pytorch_optimizer"):
            for name in sorted(SAMPLE):
                yield (
                    name,
                    lambda m, name=name: _load("pytorch_optimizer").load_optimizer(name)(m.parameters()),
                )
        return
    package = _module("pytorch_optimizer")
    if package is None:
        return
    for name in package.get_supported_optimizers():
        cls = package.load_optimizer(name)
        yield name, lambda m, cls=cls: cls(m.parameters())


def schedulefree_optimizers() -> Iterator[tuple[str, Maker]]:
    if not _installed("schedulefree"):
        return
    for name in ("AdamWScheduleFree", "SGDScheduleFree", "RAdamScheduleFree"):
        yield name, lambda m, name=name: getattr(_load("schedulefree"), name)(m.parameters(), lr=1e-3)


def small_packages() -> Iterator[tuple[str, str, Maker]]:
    if _installed("prodigyopt"):
        yield "prodigyopt", "Prodigy", lambda m: _load("prodigyopt").Prodigy(m.parameters())
    if _installed("lion_pytorch"):
        yield "lion-pytorch", "Lion", lambda m: _load("lion_pytorch").Lion(m.parameters())


def _load(name: str):
    return importlib.import_module(name)


def everything(full: bool = True) -> Iterator[tuple[str, str, Maker]]:
    """Every optimizer of every package installed; `full=False`: pytorch-optimizer's `SAMPLE` only."""
    for name, make in torch_optimizers():
        yield "torch.optim", name, make
    for name, make in timm_optimizers():
        yield "timm", name, make
    for name, make in pytorch_optimizer_optimizers(full):
        yield "pytorch_optimizer", name, make
    for name, make in schedulefree_optimizers():
        yield "schedulefree", name, make
    yield from small_packages()


def table(rows: list[Row], device_line: str) -> str:
    return "\n".join([device_line, "", HEADER, *(r.markdown() for r in rows)]) + "\n"


def save_table(rows: list[Row], device_line: str) -> None:
    """Write the rows where GRAPHSTEP_OPTIMIZER_TABLE says (the fixture of both table tests ends so)."""
    path = os.environ.get("GRAPHSTEP_OPTIMIZER_TABLE")
    if path and rows:
        with open(path, "w") as f:
            f.write(table(rows, device_line))
