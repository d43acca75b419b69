"""CPU test fixtures."""

from pathlib import Path

import pytest

from cpu_common import make_twins
from graphstep.guards import fastcheck, read_guard

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
