"""CPU test fixtures."""

from pathlib import Path

import pytest
import torch
from hypothesis import settings

from cpu_common import make_twins
from graphstep.guards import fastcheck, read_guard

# Without CUDA the GPU tests are not collected: importing their files imports the frameworks and
# packages they train with (Lightning, transformers, pytorch-optimizer, matplotlib), which was most of
# the CPU run's collection and doubled the live objects every full garbage collection walks.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/test_*.py"]


def pytest_terminal_summary(terminalreporter):
    if collect_ignore_glob:
        terminalreporter.write_line("tests/gpu: not collected, no CUDA GPU here")


# The files whose tests import a framework or a large package (the config libraries, pytorch-optimizer
# and with it transformers, matplotlib, Lightning) run last, in this order: an import stays for the rest
# of the process, and its objects stay too (until 2026-11-27 every capture's census listed them all; the
# collector's full collections still walk them). Their modules import none of it when collected. The order
# of the others is kept.
LAST = (
    "test_guards_configs",
    "test_optim_python_state",
    "test_optimizer_table",
    "test_bench",
    "test_inputs",
    "test_trusted",
    "test_integrations_accelerate",
    "test_integrations_huggingface",
    "test_integrations_lightning",
    "test_integrations_torchtitan",
)


def pytest_collection_modifyitems(items):
    rank = {name: i + 1 for i, name in enumerate(LAST)}
    items.sort(key=lambda item: rank.get(item.path.stem, 0))  # stable: the others keep their order


# The guards' tests run twice: with the C++ helper (where it is built) and on the pure-Python path
# (the fallback where it is not). Both in the one test session, so that the parallel workers share
# them out with everything else.
GUARD_PATH_MODULES = {
    "test_guards",
    "test_guards_reads",
    "test_guards_contents",
    "test_guards_configs",
    "test_variants",
    "test_churn",
}


def pytest_generate_tests(metafunc):
    if Path(metafunc.module.__file__).stem in GUARD_PATH_MODULES:
        metafunc.parametrize("guard_path", ["helper", "python"], indirect=True)


HELPER_BUILT = fastcheck.helper() is not None


@pytest.fixture
def random_examples(guard_path):
    """Hypothesis settings for the random call sequences of GUARD_PATH_MODULES: 25 examples on the
    C++ helper's path, 10 on the pure-Python one, whose only difference is how the guards read
    tensors (every other test of the module covers that on both); 25 where the helper is not built."""
    return settings(max_examples=10 if guard_path == "python" and HELPER_BUILT else 25, deadline=None)


@pytest.fixture(autouse=True)
def guard_path(request, monkeypatch):
    """Which path the guards read tensors on: "helper" (C++) or "python" (GRAPHSTEP_FASTCHECK=0), for
    the tests of GUARD_PATH_MODULES; nothing for the others."""
    if not hasattr(request, "param"):
        yield None
        return
    fastcheck.helper.cache_clear()
    read_guard._named.clear()  # what is named "once per process" is named once per variant here
    if request.param == "python":
        monkeypatch.setenv("GRAPHSTEP_FASTCHECK", "0")
        assert fastcheck.helper() is None
    elif fastcheck.helper() is None:
        pytest.skip("the C++ guard helper is not built here (the python variant covers this test)")
    yield request.param
    fastcheck.helper.cache_clear()


@pytest.fixture
def twins():
    """(eager model, eager opt), (graphstep model, graphstep opt), identical at the start."""
    return make_twins()
