"""CPU test fixtures."""

import pytest

from cpu_common import make_twins


@pytest.fixture
def twins():
    """(eager model, eager opt), (graphstep model, graphstep opt), identical at the start."""
    return make_twins()
