"""Fixtures shared by the experiment tests."""

from __future__ import annotations

import msgspec
import pytest
from micro import MICRO

from evinfra.config import load_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.runs import run_plans


@pytest.fixture(scope="module")
def template():
    """One micro outcome, to stand for a sweep's outcomes with made-up throughputs."""
    config = load_config("etc/cluster.toml")
    plan = EXPERIMENTS["fig2a"].plans(config, msgspec.structs.replace(MICRO, sweep=(2,)), 1)[0]
    return run_plans([plan], jobs=1)[plan.key]
