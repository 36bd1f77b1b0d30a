"""What the control plane did during a run: queueing per prefill node, switches, the split.

Read off the bus as the run goes (``RequestDone``, ``SplitChanged``, ``PhaseSwitched``, the
planner's ``Decision``s), and the service's public ``counters``, so it measures the service
without reaching into it. The phases it tracks are those the engines report serving
(``PhaseSwitched``): a switch's time runs from the decision to the node serving its new
phase, while the router routes by the new phase from the decision on:

* prefill queueing: from a request's arrival to the start of its prefill, per prefill node;
  per scored minute the busiest node's mean over the nodes' average (paper C.3, Table C.2);
* switches: node phase changes between prefill and decode in the scored window (leaving the
  collocated warm-up is not one), and each one's time from the decision to the node serving
  its new phase (paper C.1: "switch time");
* the split over time, and the planner's decisions with their reasons.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec
import numpy as np

from evinfra.core.bus import Bus
from evinfra.core.events import PhaseSwitched, RequestDone, SplitChanged
from evinfra.planner.planner import Decision
from evinfra.control import Service

__all__ = ["ControlRecorder", "ControlSummary"]


class ControlSummary(msgspec.Struct, frozen=True):
    mean_prefill_queueing: float
    """Seconds from arrival to prefill start, over scored requests."""
    queueing_imbalance: float
    """Per minute, the most loaded prefill node's mean queueing over the nodes' average,
    averaged over the scored minutes (paper C.3)."""
    queueing_by_node: dict[str, float]
    switches: int
    mean_switch_time: float
    """Seconds from the decision to the node serving its new phase (0 without switches)."""
    decisions: int
    final_split: str
    split_timeline: list[tuple[float, str]]
    """``(time, "xPyD")`` each time the split served changed."""
    decision_log: list[tuple[float, str]]
    """``(time, reason)`` of every planner decision."""
    branches_inferred: int = 0
    """Branches the service inferred for requests without hints (``--no-hints``), whole run."""
    requests_chained: int = 0
    """Requests without hints that joined an inferred branch, whole run."""
    branches_joined: int = 0
    """Inferred branches ended because another prompt took in their last answer, whole
    run."""
    compactions_inferred: int = 0
    """Requests without hints that restarted an inferred branch from its last answer (a
    compaction), whole run."""


def _r(x: float) -> float:
    return float(f"{float(x):.6g}")


class ControlRecorder:
    def __init__(self, service: Service, bus: Bus) -> None:
        self.service = service
        self._phase = {n: "collocated" for n in service.nodes}
        self._queue: list[tuple[float, str, float]] = []  # (prefill start, node, queueing)
        self._switches: list[tuple[float, float]] = []  # (served at, switch time)
        self._asked: dict[str, float] = {}  # node -> decision time of its pending switch
        self.timeline: list[tuple[float, str]] = []
        self.decisions: list[tuple[float, str]] = []
        bus.subscribe(RequestDone, self._on_done)
        bus.subscribe(SplitChanged, self._on_split)
        bus.subscribe(PhaseSwitched, self._on_switched)
        bus.subscribe(Decision, lambda d: self.decisions.append((_r(d.at), d.reason)))

    def _on_done(self, d: RequestDone) -> None:
        if d.prefill_start is not None and d.prefill_node is not None:
            self._queue.append((d.prefill_start, d.prefill_node, d.prefill_start - d.arrival))

    def _on_split(self, ev: SplitChanged) -> None:
        for node in ev.prefill:
            if self._phase[node] != "prefill":
                self._asked[node] = ev.time
        for node in ev.decode:
            if self._phase[node] != "decode":
                self._asked[node] = ev.time

    def _on_switched(self, ev: PhaseSwitched) -> None:
        old = self._phase.get(ev.node)
        self._phase[ev.node] = ev.phase
        asked = self._asked.pop(ev.node, None)
        if old in ("prefill", "decode") and old != ev.phase and asked is not None:
            self._switches.append((ev.time, ev.time - asked))
        self.timeline.append((_r(ev.time), self._label()))

    def _label(self) -> str:
        p = sum(1 for v in self._phase.values() if v == "prefill")
        d = sum(1 for v in self._phase.values() if v == "decode")
        c = len(self._phase) - p - d
        return f"{p}P{d}D" + (f"+{c}C" if c else "")

    def summarise(self, start: float, end: float) -> ControlSummary:
        q = [(t, n, w) for t, n, w in self._queue if start <= t < end]
        by_node: dict[str, list[float]] = defaultdict(list)
        per_minute: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for t, n, w in q:
            by_node[n].append(w)
            per_minute[int((t - start) // 60)][n].append(w)
        ratios = []
        for nodes in per_minute.values():
            means = [float(np.mean(v)) for v in nodes.values()]
            avg = float(np.mean(means))
            if len(means) > 1 and avg > 0:
                ratios.append(max(means) / avg)
        switches = [s for t, s in self._switches if start <= t < end]
        return ControlSummary(
            mean_prefill_queueing=_r(np.mean([w for _, _, w in q])) if q else 0.0,
            queueing_imbalance=_r(np.mean(ratios)) if ratios else 1.0,
            queueing_by_node={n: _r(np.mean(v)) for n, v in sorted(by_node.items())},
            switches=len(switches),
            mean_switch_time=_r(np.mean(switches)) if switches else 0.0,
            decisions=sum(1 for t, _ in self.decisions if start <= t < end),
            final_split=self._label(),
            split_timeline=list(self.timeline),
            decision_log=[(t, r) for t, r in self.decisions if start <= t < end],
            branches_inferred=self.service.counters.branches_inferred,
            requests_chained=self.service.counters.requests_chained,
            branches_joined=self.service.counters.branches_joined,
            compactions_inferred=self.service.counters.compactions_inferred)
