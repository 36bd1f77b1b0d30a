"""ThunderAgent's program scheduler on the prefill choice (paper A.4, D.5).

Sources, read for behaviour, not copied: ThunderAgent's ``wiki/Scheduler.md`` (TR mode)
and ``ThunderAgent/scheduler/router.py`` (ThunderAgent-org/ThunderAgent); paper D.5: "we
port the program scheduler that Dynamo ships as a router plugin and keep its default
thresholds. Since the plugin targets aggregated serving, we apply it to the choice of the
prefill node and count host memory in the capacity of a node. ThunderAgent pauses agents
that wait for tools once the contexts of the active agents on a node exceed 95% of this
capacity. The harness marks the last request of each agent, so ThunderAgent releases
finished agents at once."

The port here:

* a *program* is a branch (the harness's id for a context and its requests, paper E.1);
  it is REASONING while a request of it is in flight and ACTING (waiting for a tool, a
  sub-agent or the user) between requests; its tokens are its last request's input plus
  output budget; it ends with its branch's final request;
* requests are routed by the wrapped strategy (the SGLang gateway's cache-aware routing, as
  in D.5), a program's node being where its last request went;
* every ``interval_s`` (checked as requests come and go): first paused programs resume,
  best-fit decreasing (those with a request waiting first, then by size, largest first)
  onto the node with the most room under the threshold; then, on each node whose use
  ``Σ reasoning + acting_weight · Σ acting + buffer · programs`` exceeds ``threshold`` of its
  capacity (GPU plus host KV), ACTING programs are paused, smallest first, until it fits,
  then REASONING ones are marked to pause when their request ends;
* a paused program's next request is held until the program resumes, and then goes to the
  node it resumed on; a program paused for ``force_resume_s`` resumes on the least used
  node. ThunderAgent also evicts a paused program's KV; here the engines' LRU eviction takes
  it once it goes cold.
"""

from __future__ import annotations

import msgspec

from evinfra.core.types import BranchId, NodeId, NonNegFloat, NonNegInt, PosFloat, RequestId
from evinfra.router.strategy import Hold, PrefillStrategy, RouteView
from evinfra.router.ttft import Prediction

__all__ = ["ProgramScheduler", "ThunderAgentConfig"]


class ThunderAgentConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """ThunderAgent's defaults (wiki "Scheduler"), the 95 % threshold of paper D.5."""

    threshold: NonNegFloat = 0.95
    acting_token_weight: NonNegFloat = 1.0
    buffer_per_program: NonNegInt = 100
    interval_s: PosFloat = 5.0
    force_resume_s: PosFloat = 1800.0


class _Program:
    __slots__ = ("id", "node", "tokens", "reasoning", "paused", "marked", "paused_at", "held",
                 "target")

    def __init__(self, branch: BranchId) -> None:
        self.id = branch
        self.node: NodeId | None = None
        self.tokens = 0
        self.reasoning = False
        self.paused = False
        self.marked = False
        self.paused_at = 0.0
        self.held: RequestId | None = None
        self.target: NodeId | None = None  # the node it resumed on, for its next request


class ProgramScheduler:
    """ThunderAgent's TR mode around a prefill strategy (module docstring)."""

    def __init__(self, config: ThunderAgentConfig, inner: PrefillStrategy) -> None:
        self.config = config
        self.inner = inner
        self.programs: dict[BranchId, _Program] = {}
        self.capacity: dict[NodeId, int] = {}
        self.pauses = 0
        """Programs paused so far."""
        self.peak_use = 0.0
        """The highest use over capacity a check saw on a node (D.5: "by its own estimate")."""
        self._use = [0.0, 0]  # sum and count of use over capacity, per node and check
        self._req: dict[RequestId, tuple[_Program, bool]] = {}  # request -> (program, final)
        self._released: list[RequestId] = []
        self._next = 0.0

    # -- the prefill strategy ----------------------------------------------------------------

    def choose(self, view: RouteView) -> Prediction | Hold:
        for node in view.nodes:
            cap = view.capacity(node)
            if cap is not None:
                self.capacity[node] = cap
        self._check(view.now)
        p = self.programs.get(view.branch)
        if p is not None and p.paused:
            p.held = view.request
            return Hold(f"program {p.id} paused")
        if p is not None and p.target is not None:
            target, p.target = p.target, None
            if target in view.nodes:
                return view.predict(target)
        return self.inner.choose(view)

    def routed(self, request: RequestId, node: NodeId, view: RouteView) -> None:
        p = self.programs.get(view.branch)
        if p is None:
            p = self.programs[view.branch] = _Program(view.branch)
        p.node, p.tokens, p.reasoning = node, view.need, True
        self._req[request] = (p, view.final)
        self.inner.routed(request, node, view)

    def prefill_done(self, request: RequestId, node: NodeId) -> None:
        self.inner.prefill_done(request, node)

    def finished(self, request: RequestId, now: float) -> None:
        self.inner.finished(request, now)
        entry = self._req.pop(request, None)
        if entry is None:
            return
        p, final = entry
        if final:
            self.programs.pop(p.id, None)  # the harness marked the program's last request
            return
        p.reasoning = False
        if p.marked:
            self._pause(p, now)

    def released(self, now: float) -> list[RequestId]:
        self._check(now)
        out, self._released = self._released, []
        return out

    # -- the periodic check ------------------------------------------------------------------

    def used(self, node: NodeId, *, marked: bool = True) -> float:
        """The node's capacity use; ``marked=False`` leaves out the programs marked to pause
        (ThunderAgent's "future paused tokens", so it does not pause too many)."""
        c, total = self.config, 0.0
        for p in self.programs.values():
            if p.node == node and not p.paused and (marked or not p.marked):
                total += (p.tokens if p.reasoning else c.acting_token_weight * p.tokens)
                total += c.buffer_per_program
        return total

    def _check(self, now: float) -> None:
        if now < self._next:
            return
        self._next = now + self.config.interval_s
        self._resume(now)
        for node in sorted(self.capacity):
            use = self.used(node) / self.capacity[node]
            if any(p.node == node for p in self.programs.values()):
                self.peak_use = max(self.peak_use, use)
                self._use[0] += use
                self._use[1] += 1
            self._pause_until_safe(node, now)

    @property
    def mean_use(self) -> float:
        """Mean use over capacity of the nodes with programs, over the checks."""
        return self._use[0] / self._use[1] if self._use[1] else 0.0

    def _limit(self, node: NodeId) -> float:
        return self.config.threshold * self.capacity[node]

    def _resume(self, now: float) -> None:
        paused = [p for p in self.programs.values() if p.paused]
        if not paused or not self.capacity:
            return
        room = {n: self._limit(n) - self.used(n) for n in self.capacity}
        paused.sort(key=lambda p: (p.held is None, -p.tokens, p.id))
        for p in paused:
            node = max(room, key=lambda n: (room[n], n))
            forced = now - p.paused_at >= self.config.force_resume_s
            if room[node] < p.tokens + self.config.buffer_per_program and not forced:
                continue
            p.paused, p.node, p.target = False, node, node
            room[node] -= p.tokens + self.config.buffer_per_program
            if p.held is not None:
                self._released.append(p.held)
                p.held = None

    def _pause_until_safe(self, node: NodeId, now: float) -> None:
        excess = self.used(node, marked=False) - self._limit(node)
        if excess <= 0:
            return
        mine = [p for p in self.programs.values()
                if p.node == node and not p.paused and not p.marked]
        acting = sorted((p for p in mine if not p.reasoning), key=lambda p: (p.tokens, p.id))
        reasoning = sorted((p for p in mine if p.reasoning), key=lambda p: (p.tokens, p.id))
        for p in acting + reasoning:
            if excess <= 0:
                break
            if p.reasoning:
                p.marked = True  # paused when its request ends
            else:
                self._pause(p, now)
            excess -= p.tokens + self.config.buffer_per_program

    def _pause(self, p: _Program, now: float) -> None:
        p.paused, p.marked, p.paused_at = True, False, now
        self.pauses += 1
