"""The few distributions the generators draw from, and how their per-agent streams are seeded.

Lengths and pauses in agent traces are heavy-tailed, so the generators use log-normals named by
their median and by a range that holds a given share of the mass, clipped to hard limits; counts
are uniform integers. Each generator (and each sub-agent it starts) owns a
``numpy.random.Generator`` seeded from a stable key, so its draws do not depend on how the
runner interleaves branches.
"""

from __future__ import annotations

import math

import numpy as np

from evinfra.workloads.tokens import stable_seed

__all__ = ["LogNormal", "rng_for", "uniform_int"]

_Z90 = 1.6448536269514722
"""The standard normal quantile of 0.95: a central range holding 90 % of the mass."""


class LogNormal:
    """A log-normal with 90 % of its mass in ``[lo90, hi90]``, clipped to ``[lo, hi]``."""

    __slots__ = ("mu", "sigma", "lo", "hi")

    def __init__(self, lo90: float, hi90: float, lo: float, hi: float) -> None:
        if not 0 < lo90 < hi90 or not lo <= lo90 or not hi >= hi90:
            raise ValueError(f"bad log-normal range [{lo90}, {hi90}] within [{lo}, {hi}]")
        self.mu = (math.log(lo90) + math.log(hi90)) / 2
        self.sigma = (math.log(hi90) - math.log(lo90)) / (2 * _Z90)
        self.lo = lo
        self.hi = hi

    @property
    def median(self) -> float:
        return math.exp(self.mu)

    def draw(self, rng: np.random.Generator) -> float:
        return min(self.hi, max(self.lo, math.exp(self.mu + self.sigma * rng.standard_normal())))

    def tokens(self, rng: np.random.Generator) -> int:
        return int(round(self.draw(rng)))


def uniform_int(rng: np.random.Generator, lo: int, hi: int) -> int:
    """A uniform integer in ``[lo, hi]`` (both ends included). Drawn from ``random()``: a
    scalar ``integers`` call costs ten times more, and generators draw per step."""
    return lo + int(rng.random() * (hi - lo + 1))


def rng_for(*key: int | str) -> np.random.Generator:
    """The generator of one agent or branch, seeded from a stable key."""
    return np.random.default_rng(stable_seed(*key))
