"""``shift``: a workload composition that changes over time, as a closed-loop schedule.

Source: paper 6.3 and 6.1: after a 30-minute warmup, 288 concurrent Putnam agents, then 144
Putnam and 72 OSWorld agents, then 144 OSWorld agents, one hour each, shifting demand toward
prefill. The warmup serves the first composition (the paper does not say otherwise), so the
first phase lasts 1.5 h. Any other schedule is data: a list of ``[duration_s, {workload:
agents}]`` pairs (:func:`schedule_from_data`), played by :meth:`Runner.closed_loop
<evinfra.workloads.runner.Runner.closed_loop>`: when a phase lowers a workload's count, its
running agents finish and are not replaced; when it raises it, new agents start at once.
"""

from __future__ import annotations

from typing import Any

import msgspec

from evinfra.errors import ConfigError
from evinfra.workloads.arrivals import Phase

__all__ = ["PAPER_SHIFT", "paper_shift", "schedule_from_data"]

PAPER_SHIFT = [
    Phase(3600.0, {"putnam": 288}),
    Phase(3600.0, {"putnam": 144, "osworld": 72}),
    Phase(3600.0, {"osworld": 144}),
]


def paper_shift(warmup: float = 1800.0) -> list[Phase]:
    """The paper's three hours, the first lengthened by ``warmup`` seconds."""
    first, *rest = PAPER_SHIFT
    return [Phase(first.duration + warmup, first.agents), *rest] if warmup else list(PAPER_SHIFT)


def schedule_from_data(data: Any, source: str | None = None) -> list[Phase]:
    """A schedule from decoded JSON/TOML data (``[[3600, {"putnam": 288}], ...]``)."""
    try:
        phases = msgspec.convert(data, list[Phase])
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad schedule: {exc}", path=source) from exc
    if not phases:
        raise ConfigError("a schedule needs at least one phase", path=source)
    return phases
