"""Static splits: a config whose split stays fixed for the whole run (``planner.adapt =
false``), what the experiments sweep for the "best static split" (paper 6.1, Fig. 2a, D.1,
D.2; ``experiments/common.py``).
"""

from __future__ import annotations

import msgspec

from evinfra.baselines import resolve
from evinfra.config import Config

__all__ = ["fixed_split"]


def fixed_split(config: Config, prefill: int) -> Config:
    """``config`` at a fixed split of ``prefill`` prefill nodes (the first ones listed): its
    policy keeps its parts but its planner, which fits without adapting (evinfra's) or holds
    the split from the start (the baselines')."""
    cluster = msgspec.structs.replace(config.cluster, initial_prefill=prefill)
    planner = msgspec.structs.replace(config.planner, adapt=False)
    kind = resolve(config.policy).planner
    policy = msgspec.structs.replace(
        config.policy, planner="evinfra-fixed" if kind.startswith("evinfra") else "static")
    return msgspec.structs.replace(config, cluster=cluster, planner=planner, policy=policy)
