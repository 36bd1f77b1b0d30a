"""Fixtures of the planner tests; the fakes themselves are in ``planner_fakes.py``."""

import pytest
from planner_fakes import Synth


@pytest.fixture
def synth() -> Synth:
    return Synth(seed=0)
