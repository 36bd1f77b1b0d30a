"""How large an experiment runs: the paper's sizes, or a quick version for CI.

``full`` follows the paper (6.1): the cluster of the config (nine nodes), a 30-minute warm-up
excluded from scoring, one scored hour, the paper's agent counts, the config's planner.
``quick`` keeps the cluster and every mechanism but divides the agent counts and shortens the
windows, so that each experiment plays in a few minutes on two cores; its planner windows
shrink with it (the collocated warm-up is the warm-up window, decisions every 150 s in
30-s slices). Quick results show the machinery, not the paper's numbers: with a 300-s scored
window a Dynamo relaunch (666-831 s) never completes inside it. Every table says which
scale produced it.
"""

from __future__ import annotations

import math

import msgspec

from evinfra.config import Config

__all__ = ["FULL", "QUICK", "Scale"]


class Scale(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    warmup: float
    """Seconds played before scoring (paper 6.1: 30 minutes)."""
    duration: float
    """Seconds scored (paper 6.1: one hour; D.3-D.6 score minutes 30 to 85 or 90)."""
    agents: float
    """Factor on the paper's agent counts."""
    t_learn: float | None = None
    """The planner's collocated warm-up; None keeps the config's."""
    t_win: float | None = None
    m: int | None = None
    hold_off: float | None = None
    sweep: tuple[int, ...] | None = None
    """Prefill counts a best-static sweep tries; None: every split."""

    def count(self, paper: int) -> int:
        """The agent count standing for the paper's ``paper`` agents (at least one)."""
        return max(1, math.ceil(paper * self.agents))

    def configure(self, config: Config) -> Config:
        """``config`` with this scale's planner windows."""
        changes = {k: getattr(self, k) for k in ("t_learn", "t_win", "m", "hold_off")
                   if getattr(self, k) is not None}
        if not changes:
            return config
        return msgspec.structs.replace(
            config, planner=msgspec.structs.replace(config.planner, **changes))

    def describe(self) -> str:
        s = (f"{self.name} scale: warm-up {self.warmup:g} s, scored {self.duration:g} s, "
             f"agents x{self.agents:g} of the paper's")
        if self.t_learn is not None:
            s += (f"; planner warm-up {self.t_learn:g} s, window {self.t_win:g} s in "
                  f"{self.m} slices, hold-off {self.hold_off:g} s")
        if self.sweep is not None:
            s += f"; static sweep over {', '.join(f'{p}P' for p in self.sweep)}"
        return s


FULL = Scale(name="full", warmup=1800.0, duration=3600.0, agents=1.0)
QUICK = Scale(name="quick", warmup=300.0, duration=300.0, agents=1 / 16, t_learn=300.0,
              t_win=150.0, m=5, hold_off=30.0, sweep=(2, 4, 6))
