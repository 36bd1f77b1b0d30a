"""Phase switches (paper 4.2; E.3 line 1 and the outer loop): the warm-up's end, the planner's
windows, an operator's split or cordon, and each node's drain before its engine switches.

The router is the one writer of a node's phase: it stops routing a switching node's old
phase, withdraws its queued requests, says when it has drained (:meth:`Router.take_drained`)
and takes the new phase when the engine reports it (``PhaseSwitched``). This module decides
*when* and tells the engines.
"""

from __future__ import annotations

from typing import Callable

import msgspec
import structlog

from evinfra.control.counters import Counters
from evinfra.control.engines import Engines
from evinfra.core.bus import Bus
from evinfra.core.clock import Clock, Timer
from evinfra.core.events import PhaseSwitched, SplitChanged
from evinfra.core.types import NodeId, Phase, RequestId
from evinfra.errors import RequestError
from evinfra.planner.planner import Decision, Split
from evinfra.router.router import Router

__all__ = ["Switching"]

log = structlog.get_logger(__name__)


class Switching:
    def __init__(self, nodes: list[NodeId], initial_prefill: list[NodeId], planner,
                 router: Router, engines: Engines, bus: Bus, clock: Clock, counters: Counters,
                 relaunch: bool, at: Callable[..., Timer]) -> None:
        self.nodes = nodes
        self.initial_prefill = initial_prefill
        self.planner = planner
        self.router = router
        self.engines = engines
        self.bus = bus
        self.clock = clock
        self.counters = counters
        self.relaunch = relaunch
        """The engines switch by relaunching (Dynamo): they lose their KV."""
        self._at = at
        self.last_decision: Decision | None = None
        self._tick: Timer | None = None

    def start(self) -> None:
        if self.planner.warming_up and self.planner.warmup_end <= self.clock.now():
            self.tick()  # no warm-up: the initial split serves from the start
        else:
            self._schedule()

    def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()

    # -- the planner -----------------------------------------------------------------------

    def _schedule(self) -> None:
        when = max(self.planner.window_end, self.clock.now() + 1e-3)
        self._tick = self._at(when, self.tick)

    def tick(self) -> None:
        now = self.clock.now()
        try:
            if self.planner.warming_up:
                self._finish_warmup(now, Split.of(self.nodes, self.initial_prefill),
                                    "warm-up over: initial split")
            elif not self.planner.adapts:
                return  # a fixed split: no window, no decision, no further tick
            else:
                self.planner.observe_loads(now, self.router.loads(now))
                decision = self.planner.decide(now)
                if decision is None:
                    return
                self.last_decision = decision
                self.bus.publish(decision)
                self.router.set_models(self.planner.models.values())
                if decision.chosen is not None:
                    self._apply(decision.chosen, now, decision.reason)
        finally:
            if self.planner.warming_up or self.planner.adapts:
                self._schedule()

    def _finish_warmup(self, now: float, split: Split, reason: str) -> None:
        """E.3 line 1: fit and freeze the models, then leave the collocated mode."""
        reports = self.planner.finish_warmup(now)
        self.router.set_models(self.planner.models.values())
        if split != self.planner.split:
            self.planner.switch_to(split, now)
        self._apply(split, now, reason, warmup_end=True)
        log.info("warmup_finished", usable=[r.node for r in reports if r.usable],
                 unusable={r.node: r.problems for r in reports if not r.usable})

    # -- operators -------------------------------------------------------------------------

    def force_split(self, prefill: list[NodeId]) -> Split:
        """An operator's split; during the warm-up it ends the warm-up now."""
        unknown = sorted(set(prefill) - set(self.nodes))
        if unknown:
            raise RequestError(f"unknown nodes {unknown}", param="prefill")
        split = Split.of(self.nodes, prefill)
        if not split.prefill or not split.decode:
            raise RequestError("a split needs at least one prefill and one decode node",
                               param="prefill")
        switching = self.router.switching()
        if switching:
            raise RequestError(f"{sorted(switching)} still switching: try again when "
                               "they are done", status=409)
        now = self.clock.now()
        if self.planner.warming_up:
            self._finish_warmup(now, split, "forced by an operator")
        else:
            self.planner.switch_to(split, now)
            self._apply(split, now, "forced by an operator")
        return split

    def cordon(self, node: NodeId, cordoned: bool) -> list[RequestId]:
        if node not in self.nodes:
            raise RequestError(f"unknown node {node!r}", param="node", status=404)
        withdrawn = self.router.cordon(node, cordoned)
        for rid in withdrawn:
            self.engines[node].withdraw(rid)
        log.info("node_cordoned" if cordoned else "node_uncordoned", node=node,
                 withdrawn=len(withdrawn))
        return withdrawn

    # -- switches --------------------------------------------------------------------------

    def _apply(self, split: Split, now: float, reason: str, *, warmup_end: bool = False) -> None:
        """Switch the nodes whose phase differs (paper 4.2): stop routing their old phase,
        withdraw their queued requests, and switch each engine once it has drained."""
        if not warmup_end:
            self.counters.splits += 1
        self.bus.publish(SplitChanged(now, list(split.prefill), list(split.decode), reason))
        log.info("split_change", split=split.label, reason=reason)
        for node in self.nodes:
            phase = Phase.PREFILL if node in split.prefill else Phase.DECODE
            if self.router.phase(node) is phase and self.router.draining(node) is None:
                continue
            collocated = self.router.phase(node) is Phase.COLLOCATED
            at_once = collocated or self.relaunch
            for rid in self.router.begin_switch(node, phase, drain=not at_once):
                self.engines[node].withdraw(rid)
            if at_once:
                # Collocated: serving both phases already, the engine finishes its
                # other-phase work and switches by itself, routed by its new phase at once.
                # Relaunch: Dynamo terminates the worker without waiting for its in-flight
                # requests (paper A.1); its queued ones were withdrawn just now.
                self.engines[node].switch_phase(phase)
            # Otherwise (in place) the node first finishes its running requests.
        self.check_drains()

    def check_drains(self) -> None:
        """Tell each drained node's engine to switch (in place: it keeps its KV)."""
        for node, phase in self.router.take_drained():
            self.engines[node].switch_phase(phase)

    def switched(self, ev: PhaseSwitched) -> None:
        if self.router.draining(ev.node) is not None:  # (leaving the warm-up drains nothing)
            self.counters.switches += 1
        self.router.switched(ev.node, Phase(ev.phase))
        self.planner.drained(ev.node, self.clock.now())
        self.engines.flush_hints()
        log.info("node_switched", node=ev.node, phase=ev.phase)

    def status(self) -> dict[str, object]:
        return {
            "last_decision": msgspec.to_builtins(self.last_decision)
            if self.last_decision else None,
            "fits": {n: msgspec.to_builtins(r) for n, r in self.planner.fits.items()},
        }
