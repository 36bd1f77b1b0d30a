"""The micro scale the experiment tests play at (minutes of simulated time, a 48th of the
agents): the machinery, not the numbers."""

from __future__ import annotations

import msgspec

from evinfra.experiments.scale import QUICK

MICRO = msgspec.structs.replace(QUICK, name="micro", warmup=120.0, duration=120.0,
                                agents=1 / 48, t_learn=120.0, t_win=60.0, m=4, hold_off=10.0)
