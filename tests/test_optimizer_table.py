"""Every optimizer of torch.optim, timm, pytorch-optimizer, schedule-free, prodigyopt and lion-pytorch
(where installed) trains equal to eager on the CPU recording backend, or is refused at capture: never
silently different. `make test` runs pytorch-optimizer's `optimizer_zoo.SAMPLE` (the full registry takes
minutes on two cores); GRAPHSTEP_ALL_OPTIMIZERS=1 runs all of it, and GRAPHSTEP_OPTIMIZER_TABLE=path
also writes the rows there as a table (tests/gpu/test_optimizer_table_gpu.py writes the GPU one, which
docs/optimizers.md shows)."""

from __future__ import annotations

import os
import platform

import pytest
import torch

import optimizer_zoo

FULL = bool(os.environ.get("GRAPHSTEP_ALL_OPTIMIZERS") or os.environ.get("GRAPHSTEP_OPTIMIZER_TABLE"))


@pytest.fixture(scope="module")
def rows():
    found = []
    yield found
    optimizer_zoo.save_table(
        found,
        f"CPU ({platform.processor() or platform.machine()}), recording backend, torch {torch.__version__}",
    )


@pytest.mark.parametrize(
    "package, name, make",
    [pytest.param(p, n, m, id=f"{p}.{n}") for p, n, m in optimizer_zoo.everything(FULL)],
)
def test_every_optimizer_is_equal_to_eager_or_refused(package, name, make, rows):
    row = optimizer_zoo.run(package, name, make, "cpu")
    rows.append(row)
    assert not row.outcome.startswith("DIFFERS"), f"{package}.{name} trains silently wrong: {row}"
    if row.outcome == "equal":
        assert row.mode in ("graph", "segment")


def test_the_table_covers_the_packages_installed():
    listed = {p for p, _, _ in optimizer_zoo.everything()}
    run_here = {p for p, _, _ in optimizer_zoo.everything(FULL)}  # the rows above
    for packages in (listed, run_here):
        assert "torch.optim" in packages
        for module, package in (("schedulefree", "schedulefree"), ("pytorch_optimizer", "pytorch_optimizer")):
            try:
                __import__(module)
            except ImportError:
                continue
            assert package in packages
