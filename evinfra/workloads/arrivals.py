"""When agents start: closed-loop schedules and open-loop arrival streams.

Closed loop (paper 6.1): a fixed number of agents per workload runs at once, each finished
agent replaced by a new one; a schedule is a list of :class:`Phase` (duration, agents per
workload), so a stationary run is one phase and the paper's shifting composition (6.3) three.
Open loop (paper D.3): agents arrive on their own clock (a Poisson process, or a trace's
timestamps) whether or not earlier ones finished, and an admission cap makes the excess wait.
"""

from __future__ import annotations

import math
from typing import Iterator, Mapping

import msgspec

from evinfra.core.types import NonNegInt
from evinfra.workloads.sampling import rng_for

__all__ = ["Arrival", "Phase", "poisson_arrivals"]


class Phase(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Run ``agents[w]`` agents of each workload ``w`` for ``duration`` seconds (may be inf).

    ``array_like`` lets a schedule be written as data: ``[[3600, {"putnam": 288}], ...]``.
    """

    duration: float
    agents: dict[str, NonNegInt]

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError(f"phase duration must be positive, got {self.duration}")


class Arrival(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An agent of ``workload`` arrives ``time`` seconds after the run starts."""

    time: float
    workload: str


def poisson_arrivals(rates: Mapping[str, float], seed: int = 0) -> Iterator[Arrival]:
    """Independent Poisson arrivals per workload (``rates`` in agents per second), merged.

    Drawn as one process of the total rate whose arrivals pick a workload in proportion to
    its rate (the superposition of Poisson processes is Poisson). Endless; the runner stops
    pulling at its stop time.
    """
    names = [w for w, r in rates.items() if r > 0]
    if any(r < 0 or not math.isfinite(r) for r in rates.values()):
        raise ValueError(f"arrival rates must be finite and non-negative: {dict(rates)}")
    if not names:
        return
    total = sum(rates[w] for w in names)
    weights = [rates[w] / total for w in names]
    rng = rng_for(seed, "arrivals", *names)
    t = 0.0
    while True:
        t += rng.exponential(1.0 / total)
        yield Arrival(t, names[int(rng.choice(len(names), p=weights))])
