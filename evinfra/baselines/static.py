"""A fixed split with no warm-up: SGLang PD disaggregation at a static split (paper 6.1, D.1).

The base of the baselines' planners: the initial split serves from the first tick (the
service's first tick ends the "warm-up" at once), nothing is fitted, and the split never
changes. Planners that adapt (Dynamo's, Arrow's) extend it with a ``decide``.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from evinfra.core.contracts import NodeLoad
from evinfra.core.events import IterationReport, NodeState, RequestDone
from evinfra.core.types import BranchId, NodeId
from evinfra.planner.itermodel import FitReport, NodeModel
from evinfra.planner.planner import Decision, Split

__all__ = ["StaticPlanner"]


class StaticPlanner:
    """:class:`~evinfra.planner.planner.SplitPlanner` of a fixed split."""

    def __init__(self, nodes: Sequence[NodeId], prefill: Iterable[NodeId], *,
                 start: float) -> None:
        self.nodes = list(nodes)
        self.split = Split.of(self.nodes, prefill)
        if not self.split.prefill or not self.split.decode:
            raise ValueError(f"{self.split} needs a prefill and a decode node")
        self.models: dict[NodeId, NodeModel] = {}
        self.fits: dict[NodeId, FitReport] = {}
        self.warmup_end = start
        self.draining: set[NodeId] = set()
        self._warm = True

    @property
    def warming_up(self) -> bool:
        return self._warm

    @property
    def window_end(self) -> float:
        return self.warmup_end if self._warm else math.inf

    @property
    def adapts(self) -> bool:
        return False

    def observe_iteration(self, report: IterationReport) -> None:
        pass

    def observe_request(self, now: float, t_uc: float, t_c: float, t_out: float) -> None:
        pass

    def observe_population(self, now: float, q: float, n: float) -> None:
        pass

    def observe_state(self, state: NodeState) -> None:
        pass

    def observe_arrival(self, branch: BranchId, now: float) -> None:
        pass

    def observe_done(self, record: RequestDone) -> None:
        pass

    def observe_loads(self, now: float, loads: list[NodeLoad]) -> None:
        pass

    def drained(self, node: NodeId, now: float) -> None:
        self.draining.discard(node)

    def finish_warmup(self, now: float) -> list[FitReport]:
        self._warm = False
        return []

    def decide(self, now: float) -> Decision | None:
        return None

    def switch_to(self, split: Split, now: float) -> None:
        self.draining = set(split.prefill) ^ set(self.split.prefill)
        self.split = split
