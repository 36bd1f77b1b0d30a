"""Hypothesis profiles. ``ci`` (default) is derandomized so every run checks the same cases;
``--hypothesis-profile=long`` explores ten times as many steps with fresh randomness."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,  # a local example database would make runs differ from a clean clone's
    max_examples=220,
    stateful_step_count=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile(
    "long",
    max_examples=2_200,
    stateful_step_count=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.load_profile("ci")

# The fewest stateful steps a profile's run must actually execute (checked by the tests).
MIN_STEPS = {"ci": 10_000, "long": 100_000}

# Tolerated-input warnings (bad KV events on purpose) would flood the captured output of the
# property tests; tests that assert on logs use the ``logs`` fixture.
import logging  # noqa: E402

import pytest  # noqa: E402
import structlog  # noqa: E402
from structlog.testing import capture_logs  # noqa: E402


def _quiet_logs() -> None:
    structlog.reset_defaults()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))


_quiet_logs()


@pytest.fixture(autouse=True)
def _logging_reset():
    """Tests that run the CLI in-process configure structlog for it; put it back after."""
    yield
    _quiet_logs()


@pytest.fixture
def logs():
    """Every structlog event emitted during the test, as dicts."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as captured:
            yield captured
    finally:
        _quiet_logs()
