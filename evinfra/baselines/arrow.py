"""Arrow (Wu et al., arXiv 2505.11916) on the symmetric engines, as the paper reimplements it
(paper 2.2, 3.1, 3.2, A.1: "Its code is not public, so Section 3 evaluates our
reimplementation of its planner and scheduler on the symmetric engines of Evolving Infra").

What the paper says Arrow does, and how each part is built here:

* nodes are stateless and move between the prefill and decode pools in place (the fake
  engine's in-place switch), but "each node keeps its KV in its own cache, so later prefills
  do not reuse the KV of a node that moves to the decode pool" (A.1): private host memory
  (``peer_fetch = "none"``) with plain LRU eviction;
* its scheduler "predicts TTFT from the full input length, which ignores KV reuse" and
  "ignores where KV is cached" (A.1, 3.2): :class:`FullInputRouter` sends each prefill to
  the node with the least TTFT predicted as if no token were cached, and books that full
  length in the node's queue;
* it "sizes the pools by TTFT and TPOT" and "reacts to short prefill bursts" (A.1, 3.2):
  :class:`SLOPlanner` checks every ``check_interval_s``: if the TTFT it predicts for a new
  request (the shortest predicted wait, from full input lengths, plus the full-input prefill
  time of the recent mean input) exceeds ``ttft_slo_s`` while the recent mean TPOT meets
  ``tpot_slo_s``, a decode node joins the prefill pool; if TPOT misses its SLO while TTFT
  meets its own, a prefill node joins the decode pool; then it waits ``cooldown_s``.

Arrow's offline profile of prefill time is stood in for by the iteration-time models the
symmetric engines fit during the collocated warm-up (E.3 line 1), evaluated with every
input token uncached. The paper gives neither the SLOs nor the cooldown of its runs; ours
are assumptions: TTFT 5 s (the P50 TTFT target of D.3), TPOT 50 ms (the ITL target Dynamo's
SLA planner defaults to), a 60 s cooldown, a 60 s window for the recent means.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

import msgspec

from evinfra.core.contracts import NodeLoad
from evinfra.core.events import IterationReport, NodeState, RequestDone
from evinfra.core.types import BranchId, NodeId, PosFloat
from evinfra.planner.itermodel import FitReport, NodeModel
from evinfra.planner.planner import Decision, Planner, PlannerConfig, Split
from evinfra.router.strategy import RouteView, Stateless
from evinfra.router.ttft import Prediction

__all__ = ["ArrowConfig", "FullInputRouter", "SLOPlanner"]


class ArrowConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Arrow's SLO-reactive resizing (module docstring: assumptions, not published values)."""

    ttft_slo_s: PosFloat = 5.0
    tpot_slo_s: PosFloat = 0.05
    check_interval_s: PosFloat = 10.0
    cooldown_s: PosFloat = 60.0
    window_s: PosFloat = 60.0
    """Recent requests: those finished in the last ``window_s`` seconds."""


class FullInputRouter(Stateless):
    """Arrow's prefill scheduling: least TTFT predicted from the full input length."""

    def choose(self, view: RouteView) -> Prediction:
        best = min(view.nodes, key=lambda n: (round(view.predict_full_input(n).t_hat, 9),
                                              view.last_chosen(n), n))
        return view.predict_full_input(best)


class SLOPlanner:
    """Arrow's pool resizing (module docstring). The collocated warm-up and the model fit are
    evinfra's :class:`~evinfra.planner.planner.Planner`'s (with adaptation off); the
    decisions are Arrow's."""

    def __init__(self, config: ArrowConfig, fit: PlannerConfig, nodes: Sequence[NodeId],
                 prefill: Iterable[NodeId], *, start: float) -> None:
        self.config = config
        self.nodes = list(nodes)
        self._inner = Planner(msgspec.structs.replace(fit, adapt=False), self.nodes, prefill,
                              start=start)
        self.split = self._inner.split
        self.draining: set[NodeId] = set()
        self._loads: list[NodeLoad] = []
        self._recent: deque[tuple[float, int, float | None]] = deque()  # (end, t_in, TPOT)
        self._next = start
        self._last_switch = -float("inf")

    # -- the warm-up and the models are the inner planner's ----------------------------------

    @property
    def models(self) -> dict[NodeId, NodeModel]:
        return self._inner.models

    @property
    def fits(self) -> dict[NodeId, FitReport]:
        return self._inner.fits

    @property
    def warmup_end(self) -> float:
        return self._inner.warmup_end

    @property
    def warming_up(self) -> bool:
        return self._inner.warming_up

    @property
    def window_end(self) -> float:
        return self._inner.warmup_end if self.warming_up else self._next

    @property
    def adapts(self) -> bool:
        return True

    def finish_warmup(self, now: float) -> list[FitReport]:
        self._next = now + self.config.check_interval_s
        return self._inner.finish_warmup(now)

    def observe_iteration(self, report: IterationReport) -> None:
        self._inner.observe_iteration(report)

    def observe_request(self, now: float, t_uc: float, t_c: float, t_out: float) -> None:
        pass

    def observe_population(self, now: float, q: float, n: float) -> None:
        pass

    def observe_state(self, state: NodeState) -> None:
        pass

    def observe_arrival(self, branch: BranchId, now: float) -> None:
        pass

    def observe_done(self, record: RequestDone) -> None:
        if record.status != "ok":
            return
        tpot = None
        if record.first_token is not None and record.output_tokens > 1:
            tpot = (record.end - record.first_token) / (record.output_tokens - 1)
        self._recent.append((record.end, record.prompt_tokens, tpot))

    def observe_loads(self, now: float, loads: list[NodeLoad]) -> None:
        self._loads = loads

    def drained(self, node: NodeId, now: float) -> None:
        self.draining.discard(node)

    def switch_to(self, split: Split, now: float) -> None:
        self.draining = set(split.prefill) ^ set(self.split.prefill)
        self.split = split
        self._inner.split = split
        self._last_switch = now

    # -- Arrow's decisions -----------------------------------------------------------------------

    def signals(self, now: float) -> tuple[float, float | None]:
        """``(predicted TTFT of a new request, recent mean TPOT)`` from the full input."""
        while self._recent and self._recent[0][0] < now - self.config.window_s:
            self._recent.popleft()
        inputs = [t_in for _, t_in, _ in self._recent]
        tpots = [x for _, _, x in self._recent if x is not None]
        t_in = sum(inputs) / len(inputs) if inputs else 0.0
        ttft = min((x.wait_s + self._prefill_time(x.node, t_in) for x in self._loads
                    if x.node in self.split.prefill), default=0.0)
        return ttft, (sum(tpots) / len(tpots) if tpots else None)

    def _prefill_time(self, node: NodeId, t_in: float) -> float:
        """Eq. 3 with every token uncached (Arrow's profile of prefill time by length)."""
        m = self.models.get(node)
        if m is None or not m.prefill_ok:
            return 0.0
        return m.c0 * t_in / max(m.t_bar, 1.0) + m.c1 * t_in + m.c2 * t_in * (t_in + 1) / 2

    def decide(self, now: float) -> Decision | None:
        self._next = now + self.config.check_interval_s
        c, split = self.config, self.split
        if self.draining or now < self._last_switch + c.cooldown_s:
            return None
        ttft, tpot = self.signals(now)
        if tpot is None:
            return None
        by = {x.node: x for x in self._loads}
        if ttft > c.ttft_slo_s and tpot <= c.tpot_slo_s and len(split.decode) > 1:
            moved = min(split.decode, key=lambda n: (by[n].decode_tokens if n in by else 0, n))
            chosen = Split.of(self.nodes, split.prefill + (moved,))
        elif tpot > c.tpot_slo_s and ttft <= c.ttft_slo_s and len(split.prefill) > 1:
            moved = min(split.prefill, key=lambda n: (by[n].queued_tokens if n in by else 0, n))
            chosen = Split.of(self.nodes, [n for n in split.prefill if n != moved])
        else:
            return None
        self.switch_to(chosen, now)
        return Decision(at=now, split=split, chosen=chosen, reason=(
            f"switch {split.label} -> {chosen.label}: predicted TTFT {ttft:.3g} s (SLO "
            f"{c.ttft_slo_s:g}), mean TPOT {tpot * 1e3:.3g} ms (SLO {c.tpot_slo_s * 1e3:g}); "
            f"Arrow moves {moved}"))
