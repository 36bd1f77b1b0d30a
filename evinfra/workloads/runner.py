"""The runner: plays agents' programs against a backend, in closed or open loop.

It is an interpreter of the ops of ``program.py`` driven by callbacks: a branch advances until
it blocks (a request in flight, a pause, a join), and resumes when the backend answers or the
clock fires. Nothing here awaits or reads the time but through ``backend.clock``, so the same
runner drives the simulator (virtual clock) and the replay client (wall clock). A branch keeps
its context as a base array and a list of pieces appended since, concatenated once per request
(numpy); it knows how much of the next prompt repeats its last path, so ``h*`` hashes only the
new pages (``reuse.py``). No Python loop runs over the context's tokens.

Identifiers are deterministic and independent of timing: an agent is ``{workload}-{index}``,
its root branch ``{agent}:0``, child ``k`` of branch ``b`` (by start order in ``b``'s
program) is ``{b}.{k}``, and request ``n`` of branch ``b`` is ``{b}#{n}``. With a
deterministic backend, the same seed gives the same request stream.

A stop time ends the run for the workload: after it no agent starts, no pause is scheduled and
no request is sent; requests in flight finish (their records complete if the backend answers)
or stay ``pending``. Every pause and arrival time is divided by ``speedup`` (replays that
compress time); phase durations too.
"""

from __future__ import annotations

import math
from collections import deque
from functools import partial
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import msgspec
import numpy as np

from evinfra.workloads.arrivals import Arrival, Phase
from evinfra.workloads.backend import AgentRequest, Backend, Outcome, RequestRecord
from evinfra.workloads.program import (
    Agent, Call, Compact, Fork, Join, Op, Pause, Program, Reset, Spawn, Workload,
)
from evinfra.workloads.reuse import NO_PATH, IdealCache
from evinfra.workloads.tokens import EMPTY

__all__ = ["Runner", "RunnerStats"]


class RunnerStats(msgspec.Struct):
    """Counts over the run. ``arrived - admitted`` agents were still waiting (open loop)."""

    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    sent: int = 0
    answered: int = 0
    errors: int = 0


class _AgentState:
    __slots__ = ("agent", "arrival", "queued", "live")

    def __init__(self, agent: Agent, arrival: float, queued: float) -> None:
        self.agent = agent
        self.arrival = arrival
        self.queued = queued  # admission wait, handed to the agent's first request
        self.live = 0  # branches started and not ended


class _Branch:
    __slots__ = ("id", "agent", "parent", "report_parent", "ops", "ahead", "base", "tail",
                 "system", "path", "known", "sent", "children", "joined", "waiting", "result",
                 "ended")

    def __init__(self, bid: str, agent: _AgentState, parent: "_Branch | None", ops: Program,
                 base: np.ndarray, tail: list[np.ndarray], system: np.ndarray,
                 path: np.ndarray, known: int) -> None:
        self.id = bid
        self.agent = agent
        self.parent = parent
        # The parent's id, sent with this branch's first request only (then cleared).
        self.report_parent = parent.id if parent is not None else None
        self.ops = ops
        self.ahead: deque[Op] = deque()  # ops pulled early to see whether a Call is the last
        # The context is base + tail, concatenated when the next request is sent.
        self.base = base
        self.tail = tail
        self.system = system
        self.path = path  # page hashes of the last sequence sent or produced (reuse.py)
        self.known = known  # leading context tokens known to equal that sequence's
        self.sent = 0
        self.children: list[_Branch] = []
        self.joined: list[bool] = []
        self.waiting: tuple[int, ...] | None = None  # children a Join waits for
        self.result = EMPTY  # visible output of the last call
        self.ended = False


class Runner:
    """Plays agents of ``workloads`` (by name) against ``backend``; see the module docstring.

    Start it with :meth:`closed_loop` or :meth:`open_loop` (once), then run the clock. Each
    request leaves a :class:`RequestRecord` in ``records`` (filled in when it is answered);
    ``on_record`` is called with each record as it completes.
    """

    def __init__(
        self,
        backend: Backend,
        workloads: Mapping[str, Workload],
        *,
        page_size: int = 64,
        stop_at: float | None = None,
        speedup: float = 1.0,
        on_record: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        self.backend = backend
        self.clock = backend.clock
        self.workloads = dict(workloads)
        self.stop_at = math.inf if stop_at is None else stop_at
        self.speedup = speedup
        self.on_record = on_record
        self.ideal = IdealCache(page_size)
        self.records: list[RequestRecord] = []
        self.stats = RunnerStats()
        self.in_flight = 0
        self._next_index = {w: 0 for w in self.workloads}
        self.active = {w: 0 for w in self.workloads}  # running agents per workload (read only)
        self._targets: dict[str, int] = {}
        self._closed = False
        self._cap: int | None = None
        self._waiting: deque[tuple[Agent, float]] = deque()
        self._arrivals: Iterator[Arrival] | None = None
        self._start: float | None = None

    @property
    def active_agents(self) -> int:
        """Agents admitted and not finished."""
        return sum(self.active.values())

    @property
    def waiting_agents(self) -> int:
        """Agents that arrived and wait for admission (open loop with a cap)."""
        return len(self._waiting)

    # ---- arrival policies ------------------------------------------------------------------

    def closed_loop(self, schedule: Sequence[Phase]) -> None:
        """Keep ``phase.agents[w]`` agents of each workload running through each phase; a
        finished agent is replaced while its workload is under its target. After the last
        phase the targets stay."""
        self._begin()
        self._closed = True
        t = self._start
        for phase in schedule:
            self._check_names(phase.agents)
            if t >= self.stop_at:
                break
            self.clock.call_at(t, self._set_targets, phase.agents)
            t += phase.duration / self.speedup

    def open_loop(self, arrivals: Iterable[Arrival], max_active: int | None = None) -> None:
        """Start an agent at each arrival (times from now, in order); beyond ``max_active``
        running agents, arrivals wait first-come first-served."""
        self._begin()
        self._cap = max_active
        self._arrivals = iter(arrivals)
        self._schedule_arrival()

    def _begin(self) -> None:
        if self._start is not None:
            raise RuntimeError("a runner is started once")
        self._start = self.clock.now()

    def _check_names(self, names: Iterable[str]) -> None:
        unknown = [w for w in names if w not in self.workloads]
        if unknown:
            raise KeyError(f"unknown workloads {unknown}; have {sorted(self.workloads)}")

    def _set_targets(self, agents: Mapping[str, int]) -> None:
        self._targets = dict(agents)
        for w, n in agents.items():
            while self.active[w] < n and self._new_agent(w, self.clock.now(), 0.0):
                pass

    def _schedule_arrival(self) -> None:
        arrival = next(self._arrivals, None)
        if arrival is None:
            return
        self._check_names((arrival.workload,))
        when = self._start + arrival.time / self.speedup
        if when < self.stop_at:
            self.clock.call_at(when, self._arrive, arrival.workload)

    def _arrive(self, workload: str) -> None:
        self._schedule_arrival()
        agent = self._make(workload)
        if agent is None:
            return
        self.stats.arrived += 1
        now = self.clock.now()
        if self._cap is None or self.active_agents < self._cap:
            self._admit(agent, now, 0.0)
        else:
            self._waiting.append((agent, now))

    def _make(self, workload: str) -> Agent | None:
        index = self._next_index[workload]
        agent = self.workloads[workload].agent(index)
        if agent is not None:
            self._next_index[workload] = index + 1
        return agent

    def _new_agent(self, workload: str, arrival: float, queued: float) -> bool:
        if self.clock.now() >= self.stop_at:
            return False
        agent = self._make(workload)
        if agent is None:
            return False
        self.stats.arrived += 1
        self._admit(agent, arrival, queued)
        return True

    def _admit(self, agent: Agent, arrival: float, queued: float) -> None:
        self.stats.admitted += 1
        self.active[agent.workload] += 1
        state = _AgentState(agent, arrival, queued)
        root = agent.root
        self._start_branch(f"{agent.agent_id}:0", state, None, root.program, root.system,
                           [root.task], root.system, NO_PATH, 0)

    def _agent_done(self, state: _AgentState) -> None:
        w = state.agent.workload
        self.active[w] -= 1
        self.stats.finished += 1
        now = self.clock.now()
        if now >= self.stop_at:
            return
        if self._closed:
            if self.active[w] < self._targets.get(w, 0):
                self._new_agent(w, now, 0.0)
        elif self._waiting and (self._cap is None or self.active_agents < self._cap):
            agent, arrived = self._waiting.popleft()
            self._admit(agent, arrived, now - arrived)

    # ---- the interpreter -------------------------------------------------------------------

    def _start_branch(self, bid: str, state: _AgentState, parent: _Branch | None,
                      ops: Program, base: np.ndarray, tail: list[np.ndarray],
                      system: np.ndarray, path: np.ndarray, known: int) -> None:
        branch = _Branch(bid, state, parent, ops, base, tail, system, path, known)
        if parent is not None:
            parent.children.append(branch)
            parent.joined.append(False)
        state.live += 1
        self._advance(branch)

    def _next_op(self, branch: _Branch) -> Op | None:
        if branch.ahead:
            return branch.ahead.popleft()
        return next(branch.ops, None)

    def _call_ahead(self, branch: _Branch) -> bool:
        """Whether the program has another Call (pulling ops into ``ahead`` until it knows)."""
        for op in branch.ahead:
            if type(op) is Call:
                return True
        for op in branch.ops:
            branch.ahead.append(op)
            if type(op) is Call:
                return True
        return False

    def _advance(self, branch: _Branch) -> None:
        """Run ``branch``'s ops until one blocks or the program ends."""
        while True:
            now = self.clock.now()
            if now >= self.stop_at:
                return
            op = self._next_op(branch)
            if op is None:
                self._end(branch)
                return
            kind = type(op)
            if kind is Call:
                self._send(branch, op, now)
                return
            if kind is Pause:
                delay = op.seconds / self.speedup
                if now + delay < self.stop_at:
                    self.clock.call_later(delay, self._advance, branch)
                return
            if kind is Join:
                if any(i >= len(branch.children) for i in op.children):
                    raise IndexError(f"{branch.id} joins {op.children} of "
                                     f"{len(branch.children)} children")
                branch.waiting = op.children or tuple(
                    i for i, done in enumerate(branch.joined) if not done)
                if not self._join_ready(branch):
                    return
                self._join(branch)
            elif kind is Compact:
                branch.base, branch.tail, branch.known = branch.system, [branch.result,
                                                                         op.append], 0
            elif kind is Reset:
                branch.base, branch.tail, branch.known = op.tokens, [], 0
            elif kind is Fork or kind is Spawn:
                cid = f"{branch.id}.{len(branch.children)}"
                if kind is Fork:
                    self._start_branch(cid, branch.agent, branch, op.program, branch.base,
                                       list(branch.tail), branch.system, branch.path,
                                       branch.known)
                else:
                    self._start_branch(cid, branch.agent, branch, op.program, op.system,
                                       [op.task], op.system, NO_PATH, 0)
            else:
                raise TypeError(f"not an op: {op!r}")

    def _join_ready(self, branch: _Branch) -> bool:
        children = branch.children
        return all(children[i].ended for i in branch.waiting)

    def _join(self, branch: _Branch) -> None:
        for i in branch.waiting:
            branch.tail.append(branch.children[i].result)
            branch.joined[i] = True
        branch.waiting = None

    def _end(self, branch: _Branch) -> None:
        branch.ended = True
        parent = branch.parent
        if parent is not None and parent.waiting is not None and self._join_ready(parent):
            self._join(parent)
            self._advance(parent)
        state = branch.agent
        state.live -= 1
        if state.live == 0:
            self._agent_done(state)

    def _send(self, branch: _Branch, call: Call, now: float) -> None:
        tokens = _cat(branch.base, *branch.tail, call.append)
        final = not self._call_ahead(branch)
        branch.sent += 1
        rid = f"{branch.id}#{branch.sent}"
        path, ideal = self.ideal.admit(tokens, branch.path, branch.known)
        state = branch.agent
        agent = state.agent
        record = RequestRecord(rid, agent.agent_id, agent.workload, branch.id,
                               branch.report_parent, call.tag, final, now, int(tokens.size),
                               call.output, ideal, state.queued)
        state.queued = 0.0
        self.records.append(record)
        request = AgentRequest(rid, agent.agent_id, agent.workload, branch.id,
                               branch.report_parent, final, tokens, call.output, call.tag)
        branch.report_parent = None
        branch.path = path
        self.in_flight += 1
        self.stats.sent += 1
        self.backend.send(request, partial(self._done, branch, call, tokens, record))

    def _done(self, branch: _Branch, call: Call, tokens: np.ndarray, record: RequestRecord,
              outcome: Outcome) -> None:
        self.in_flight -= 1
        self.stats.answered += 1
        record.done_time = self.clock.now()
        record.ttft = outcome.ttft
        record.cached_tokens = outcome.cached_tokens
        if outcome.error is None:
            out = np.asarray(outcome.tokens, dtype=np.uint32)
            record.status = "ok"
            record.output_tokens = int(out.size)
        else:
            out = EMPTY
            record.status = "error"
            record.error = outcome.error
            self.stats.errors += 1
        keep = out.size if call.keep is None else min(call.keep, out.size)
        visible = out[out.size - keep:] if keep else EMPTY
        # The next prompt repeats what this request produced (input, output but its last
        # token) only as far as the output stays whole in the context.
        branch.known = tokens.size + (out.size - 1 if out.size and keep == out.size else 0)
        branch.base, branch.tail = tokens, [visible]
        branch.result = visible
        if self.on_record is not None:
            self.on_record(record)
        self._advance(branch)


def _cat(*parts: np.ndarray) -> np.ndarray:
    """Concatenate token arrays, without copying when at most one is non-empty."""
    nonempty = [p for p in parts if p.size]
    if len(nonempty) == 1:
        return nonempty[0]
    if not nonempty:
        return EMPTY
    return np.concatenate(nonempty)
