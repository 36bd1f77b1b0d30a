"""A patched engine's own log of forward passes turned into the planner's
:class:`IterationReport` (pure; the driver polls ``GET /evinfra/iterations?after=N``).

The engine patch times every pass and says what it computed (``engine_patch/iterations.py``),
which ``/v1/loads``'s cumulative counters cannot (see ``loads``): with it, each prefill pass is
one report with its requests' ``(t_uc, t_c, t_rst)``, each decode pass one with its batch.
The tracker asks for the passes after the last one it saw; a log whose latest number is below
that is a new engine process (numbered from 0 again), and passes the engine no longer keeps
are counted as missed. Pass times are the engine's wall clock, moved onto the control
plane's clock by the age they have on this host's wall clock.
"""

from __future__ import annotations

from evinfra.core.events import IterationReport, PrefillItem
from evinfra.core.types import NodeId
from evinfra.engine_patch.wire import IterationLog

__all__ = ["IterationTracker"]


class IterationTracker:
    def __init__(self, node: NodeId) -> None:
        self.node = node
        self.after = -1
        """The number of the last pass reported (ask for the ones after it)."""
        self.missed = 0

    def take(self, log: IterationLog, now: float, wall_now: float) -> list[IterationReport]:
        """The reports of ``log``'s new passes; ``now`` is the control plane's clock,
        ``wall_now`` its wall clock."""
        if log.last < self.after:  # a new engine process: ask for its log from the start
            self.after = -1
            return []
        out = []
        first = self.after < 0  # what ran before we first asked is not missed
        for rec in log.records:
            if rec.seq <= self.after:
                continue
            if not first:
                self.missed += rec.seq - self.after - 1
            first = False
            self.after = rec.seq
            start = now - (wall_now - rec.start)
            if rec.prefill:
                out.append(IterationReport(self.node, start, rec.duration,
                                           [PrefillItem(*item) for item in rec.prefill]))
            elif rec.batch:
                out.append(IterationReport(self.node, start, rec.duration, batch=rec.batch,
                                           t_fwd=rec.t_fwd, accepted=rec.accepted))
        if log.last > self.after:  # all of them gone before we asked
            self.missed += log.last - self.after if self.after >= 0 else 0
            self.after = log.last
        return out
