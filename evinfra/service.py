"""The control-plane process: config -> bus, directory, router, planner, drivers; run.

One :class:`Service` runs in ``evinfra serve`` (wall clock, asyncio, HTTP in front) and in
``evinfra simulate`` (virtual clock, workload in front): the same object, the same handlers.
It is the glue of DESIGN.md's "one request's walk": it hands requests to the router, turns
the router's decisions into driver orders, and turns the engines' events (on the bus) back
into router, directory and planner updates and into output for the client. Every handler is
synchronous; nothing here awaits except start and stop.

The system it runs is the ``[policy]`` of the config (``evinfra.baselines``): evinfra, or a
baseline's prefill strategy, decode binding, planner and switch, built once here; the
handlers below are the same for all of them.

Clients see a request through a :class:`RequestSink`: output tokens as they come, then
either the finish or an error. Nothing in a handler raises into the bus for one bad request:
a request that cannot go on fails on its own sink.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Callable, Mapping, NamedTuple, Protocol, Sequence

import msgspec
import numpy as np
import structlog

from evinfra.baselines import build as build_policy
from evinfra.baselines import engine_overrides
from evinfra.config import Config
from evinfra.core.bus import Bus
from evinfra.core.clock import Clock, Timer
from evinfra.core.contracts import DecodeOrder, PrefillOrder, Sampling
from evinfra.core.events import (IterationReport, NodeDown, NodeKVEvents, NodeState, NodeUp,
                                 PhaseSwitched, PrefillDone, PrefillStarted, RequestDone,
                                 RequestFailed, SplitChanged, TokenLogprobs, TokensOut,
                                 Withdrawn)
from evinfra.core.types import BranchId, NodeId, Phase, RequestId
from evinfra.directory import Answer, CarryIndex, ChainIndex, Directory
from evinfra.drivers.base import EngineDriver
from evinfra.errors import EngineError, EvinfraError, NoNodeError, RequestError, UnknownBranchError
from evinfra.planner.planner import Decision, Split
from evinfra.router.router import DecodeBinding, Held, Refusal, Route, RouteRequest, Router

__all__ = ["RequestSink", "Service", "Submission"]

log = structlog.get_logger(__name__)


class RequestSink(Protocol):
    """Where a request's output goes (an HTTP response, a simulated agent)."""

    def tokens(self, tokens: Sequence[int], logprobs: TokenLogprobs | None) -> None:
        """New output tokens (a list or a uint32 numpy array, read only) and their
        log-probabilities if the request asked for them."""

    def prompt_logprobs(self, logprobs: TokenLogprobs) -> None:
        """The prompt's log-probabilities (``Sampling.prompt_logprobs``), before any
        output."""

    def done(self, record: RequestDone, error: EvinfraError | None) -> None:
        """The request is over: finished (``error`` None, ``record.finish`` set) or failed."""


class Submission(msgspec.Struct, frozen=True, gc=False):
    """A request as the front end hands it over: tokenized, validated."""

    tokens: object
    """uint32 numpy array."""
    sampling: Sampling
    branch: BranchId | None = None
    """None: no hint; the branch is inferred (``server.infer_branches``) or a branch of one."""
    parent: BranchId | None = None
    final: bool = False
    """The branch ends after this request (the harness said so)."""
    request: RequestId | None = None


class _Inference(NamedTuple):
    """A hint-less request's branch as its prompt tells it (:meth:`Service._infer`)."""

    branch: BranchId
    parent: BranchId | None
    final: bool
    tip: int | None = None
    """The key its prompt leaves for the next one to extend (None: no inference)."""
    answer: Answer | None = None
    """Where its answer's fingerprints collect, if its branch lives on after it."""
    joined: Sequence[BranchId] = ()
    """Sub-agents whose reports its prompt takes in: they are over."""
    compacts: bool = False
    """It restarts its branch from a summary (a rewrite)."""


class _Flight:
    __slots__ = ("id", "branch", "end_branch", "tokens", "sampling", "sink", "arrival", "first",
                 "prefill", "decode", "prefill_start", "cached", "fetched", "computed", "out",
                 "admitted", "timer", "progress", "reroutes", "path", "finish", "answer")

    def __init__(self, rid: RequestId, branch: BranchId, end_branch: bool, tokens: np.ndarray,
                 sampling: Sampling, sink: RequestSink, now: float) -> None:
        self.id = rid
        self.branch = branch
        self.end_branch = end_branch
        self.tokens = tokens
        self.sampling = sampling
        self.sink = sink
        self.arrival = now
        self.first: float | None = None
        self.prefill: NodeId | None = None
        self.decode: NodeId | None = None
        self.prefill_start: float | None = None
        self.cached = self.fetched = self.computed = self.out = 0
        self.admitted = False
        self.timer: Timer | None = None
        self.progress = now
        self.reroutes = 0
        self.path: list[int] = []
        self.finish: str | None = None
        self.answer: Answer | None = None


class Service:
    """Router, directory and planner around the bus, driving the engines."""

    def __init__(self, config: Config, clock: Clock, bus: Bus,
                 drivers: Mapping[NodeId, EngineDriver]) -> None:
        self.config = config
        self.clock = clock
        self.bus = bus
        self.drivers = dict(drivers)
        nodes = [n.name for n in config.cluster.nodes]
        if sorted(self.drivers) != sorted(nodes):
            raise EvinfraError(f"drivers for {sorted(self.drivers)} but nodes {sorted(nodes)}")
        self.nodes = nodes
        self.initial_prefill = nodes[: config.cluster.initial_prefill]
        self.directory = Directory({n: Phase.COLLOCATED for n in nodes}, config.cluster.page_size)
        parts = build_policy(config.policy, config.planner, nodes, self.initial_prefill,
                             start=clock.now(), page_size=config.cluster.page_size,
                             context_length=config.model.max_context_tokens)
        self.policy = parts.spec
        self.router = Router(self.directory, config.router, prefill=parts.prefill,
                             decode=parts.decode, pool=parts.pool)
        self.planner = parts.planner
        self.last_decision: Decision | None = None
        self.accepting = True
        self._stopping = False
        self._flights: dict[RequestId, _Flight] = {}
        self._held: dict[RequestId, _Flight] = {}
        self._ids = itertools.count()
        self._switching: dict[NodeId, Phase] = {}
        self._decoding = 0
        self._tick: Timer | None = None
        # Branches of requests without hints, inferred from their prompts.
        self.chains = (ChainIndex(config.cluster.page_size) if config.server.infer_branches
                       else None)
        self.carry = CarryIndex()
        # Branches by the time they were last active, least recent first: named ones
        # (``server.branch_idle_s``) and inferred ones (``server.inferred_branch_idle_s``).
        # And every branch's requests in flight.
        self._idle_since: dict[BranchId, float] = {}
        self._inferred_idle_since: dict[BranchId, float] = {}
        self._active: Counter[BranchId] = Counter()
        self._sweep: Timer | None = None
        self.fake_cluster = None  # the fake engines, when from_config built them
        # submitted = ok + failed + aborted + rejected (refused: never submitted)
        self.counters = {"submitted": 0, "ok": 0, "failed": 0, "aborted": 0, "rejected": 0,
                         "refused": 0, "rerouted": 0, "timeouts": 0, "switches": 0,
                         "branches_expired": 0, "branches_inferred": 0, "requests_chained": 0,
                         "branches_joined": 0, "compactions_inferred": 0}
        self._subscribe()

    @classmethod
    def from_config(cls, config: Config, clock: Clock, bus: Bus | None = None,
                    stream: str = "iteration") -> "Service":
        """A service on the configured engines: real SGLang engines, or the fake cluster
        (``stream`` its output mode: ``"iteration"`` to serve, ``"batched"`` to simulate)."""
        bus = bus or Bus()
        if config.cluster.driver == "sglang":
            from evinfra.drivers.sglang import build_drivers

            urls = {n.name: n.url for n in config.cluster.nodes}
            return cls(config, clock, bus,
                       build_drivers(urls, config.cluster.page_size, clock, bus))
        from evinfra.drivers.fake import FakeCluster

        fake = msgspec.structs.replace(config.fake, streaming=stream,
                                       page_size=config.cluster.page_size,
                                       **engine_overrides(config.policy))
        cluster = FakeCluster([(n.name, Phase.COLLOCATED) for n in config.cluster.nodes], fake,
                              clock, bus, seed=config.cluster.seed)
        service = cls(config, clock, bus, {n.name: cluster.driver(n.name)
                                           for n in config.cluster.nodes})
        service.fake_cluster = cluster
        return service

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        for d in self.drivers.values():
            await d.start()
        with self.bus.running():
            # Engines may hold count marks from an earlier control plane: this one has none.
            for node, d in self.drivers.items():
                d.push_hints(self.directory.full_hints(node))
            if self.planner.warming_up and self.planner.warmup_end <= self.clock.now():
                self._on_tick()  # no warm-up: the initial split serves from the start
            else:
                self._schedule_tick()
        if self._idle_limits():
            self._schedule_sweep()
        log.info("service_started", nodes=len(self.nodes), policy=self.config.policy.name,
                 warmup_until=self.planner.warmup_end,
                 initial_split=f"{len(self.initial_prefill)}P{len(self.nodes) - len(self.initial_prefill)}D")

    async def stop(self) -> None:
        """Fail what is still in flight and stop the drivers (call after draining clients)."""
        self.accepting = False
        self._stopping = True
        if self._tick is not None:
            self._tick.cancel()
        if self._sweep is not None:
            self._sweep.cancel()
        with self.bus.running():
            for f in list(self._flights.values()):
                self._fail(f, EngineError(f.prefill or "-", "the service is shutting down"))
        for d in self.drivers.values():
            await d.stop()

    def in_flight(self) -> int:
        return len(self._flights)

    def _at(self, when: float, fn: Callable[..., None], *args: object) -> Timer:
        """A timer of the service's own (a timeout, a sweep, a planner tick): a command, run
        to completion on the bus like any other."""
        return self.clock.call_at(when, self._command, fn, *args)

    def _command(self, fn: Callable[..., None], *args: object) -> None:
        with self.bus.running():
            fn(*args)

    def constrains_output(self) -> bool:
        """Every engine holds an output to a grammar (``Sampling.json_schema``...): a request
        may go to any of them."""
        return all(d.constrains_output for d in self.drivers.values())

    # -- requests --------------------------------------------------------------------------

    def submit(self, sub: Submission, sink: RequestSink) -> RequestId:
        """Route a request; its output goes to ``sink``. Raises :class:`NoNodeError` (no node
        can take it now) or :class:`RequestError` before anything is accepted."""
        with self.bus.running():
            return self._submit(sub, sink)

    def _submit(self, sub: Submission, sink: RequestSink) -> RequestId:
        if not self.accepting:
            raise NoNodeError("prefill", "the service is shutting down")
        now = self.clock.now()
        rid = sub.request or f"req-{next(self._ids)}"
        if rid in self._flights:
            raise RequestError(f"request id {rid!r} is already in flight", status=409)
        tokens = np.asarray(sub.tokens, dtype=np.uint32)
        if tokens.size == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if sub.branch is not None:
            guess = _Inference(sub.branch, sub.parent, sub.final)
        else:
            guess = self._infer(rid, tokens, sub.parent, sub.final)
        branch, parent, final, tip = guess.branch, guess.parent, guess.final, guess.tip
        # A hint-less request's branch is its own if this request starts it (nothing else
        # knows it then).
        own = sub.branch is None and branch not in self.directory.branches
        f = _Flight(rid, branch, final, tokens, sub.sampling, sink, now)
        decision = self.router.route(
            RouteRequest(rid, branch, tokens, sub.sampling.max_tokens, parent, final,
                         reuse=not sub.sampling.prompt_logprobs), now)
        if isinstance(decision, Refusal):
            self.counters["refused"] += 1
            self.router.finished(rid, now)
            if branch in self.directory.branches:
                if own:
                    self.directory.end(branch)
                elif not self._active[branch]:
                    self._idle_from(branch, now)
            raise NoNodeError(decision.phase, decision.reason)
        if tip is not None:
            assert self.chains is not None
            self.chains.record(tip, None if final else branch)
            if not final:
                self.counters["requests_chained"] += 1
                self.counters["branches_inferred"] += own
            for done in guess.joined:
                self._end(done)
            self.counters["branches_joined"] += len(guess.joined)
            self.counters["compactions_inferred"] += guess.compacts
        self.carry.forget(branch)  # in flight again: its last answer is not its last
        f.answer = guess.answer
        self.counters["submitted"] += 1
        self._flights[rid] = f
        self._active[branch] += 1
        if isinstance(decision, Held):
            self._held[rid] = f
        else:
            self._dispatch(f, decision)
        self._arm_timer(f)
        self._release_held()
        self._flush_hints()
        return rid

    def _infer(self, rid: RequestId, tokens: np.ndarray, parent: BranchId | None,
               final: bool) -> _Inference:
        """The branch of a request without one (see :mod:`evinfra.directory.chains` and
        :mod:`evinfra.directory.carryover`), first that applies:

        - the live inferred branch whose latest tip its prompt extends;
        - the idle branch whose last answer its prompt holds after the same first page,
          past the tip it extends if any (a compaction, or a context edited after an
          earlier turn): that branch goes on, rewritten;
        - a fork of the live branch whose earlier tip it extends;
        - a new branch if it extends some other tip, a branch of one if none.

        A prompt that extends a tip and takes in other idle branches' last answers
        (sub-agents' reports) ends those branches. A request that names a parent, or ends
        its branch, is a branch of one, as is any without inference."""
        one = f"~{rid}"
        if self.chains is None or parent is not None or final:
            return _Inference(one, parent, True)
        keys = self.chains.keys(tokens)
        tip = self.chains.tip(keys, int(tokens.size))
        if tip is None:
            return _Inference(one, None, True)
        found = self.chains.find(keys, self.directory.branches)
        carried = self.carry.find(tokens, found.pages * self.chains.page_size, keys[0],
                                  (found.continues,))
        answer = Answer(keys[0])
        if found.continues is not None:
            return _Inference(found.continues, None, False, tip, answer, carried.branches)
        for branch, same_start in zip(*carried):
            if same_start and found.fork_of in (None, branch):
                others = [b for b in carried.branches if b != branch] if found.chained else []
                return _Inference(branch, None, False, tip, answer, others, compacts=True)
        if found.chained:
            return _Inference(one, found.fork_of, False, tip, answer, carried.branches)
        return _Inference(one, None, True, tip)

    def abort(self, request: RequestId) -> None:
        """The client went away: stop the request everywhere, quietly (its sink has its
        record when this returns)."""
        f = self._flights.get(request)
        if f is None:
            return
        with self.bus.running():
            for node in {f.prefill, f.decode} - {None}:
                self.drivers[node].abort(request)
            self._close(f, "aborted", EngineError(f.prefill or "-", "aborted by the client"))

    def end_branch(self, branch: BranchId) -> None:
        """The harness says the branch is over (``POST /v1/branches/{id}/end``)."""
        if self._active[branch]:
            self._end_after(branch)
            return
        with self.bus.running():
            self._end(branch)
            self._flush_hints()

    def _end_after(self, branch: BranchId) -> None:
        """End ``branch`` when its requests in flight are done: their counts must outlive
        them (a harness's parallel calls on one branch, or an end reported meanwhile)."""
        for f in self._flights.values():
            if f.branch == branch:
                f.end_branch = True

    def _dispatch(self, f: _Flight, route: Route) -> None:
        f.prefill = route.node
        f.decode = None
        f.path = route.path.hashes
        self.drivers[route.node].submit_prefill(PrefillOrder(
            f.id, f.tokens, route.path.hashes, route.fetch, f.sampling,
            cached_tokens=route.prediction.t_c, branch=f.branch, final=f.end_branch))
        if route.decode is not None:
            self._submit_decode(f, route.decode)

    def _submit_decode(self, f: _Flight, binding: DecodeBinding) -> None:
        f.decode = binding.node
        self.drivers[binding.node].submit_decode(DecodeOrder(
            f.id, binding.source, f.tokens, f.path, f.sampling, branch=f.branch,
            final=f.end_branch))

    def _reroute(self, f: _Flight, decision: Route | Refusal | Held | None, why: str) -> None:
        """Carry out a second routing of a request whose prefill had not started. A decode
        node bound at submit was let go by the router; its order is aborted here."""
        if f.decode is not None:
            self.drivers[f.decode].abort(f.id)
            f.decode = None
        if isinstance(decision, Route):
            f.reroutes += 1
            self._dispatch(f, decision)
        elif isinstance(decision, Held):
            f.prefill = None
            self._held[f.id] = f
        else:
            self._fail(f, NoNodeError("prefill", decision.reason if decision else why))

    def _release_held(self) -> None:
        """Route the held requests the prefill strategy lets go now."""
        if not self._held:
            return
        now = self.clock.now()
        for rid in self.router.take_released(now):
            f = self._held.pop(rid, None)
            if f is not None:
                self._reroute(f, self.router.route(RouteRequest(rid, f.branch, None, 0), now),
                              "released")

    # -- engine events ---------------------------------------------------------------------

    def _subscribe(self) -> None:
        sub = self.bus.subscribe
        sub(NodeKVEvents, self._on_kv)
        sub(NodeState, self._on_state)
        sub(IterationReport, self.planner.observe_iteration)
        sub(PrefillStarted, self._on_prefill_started)
        sub(PrefillDone, self._on_prefill_done)
        sub(TokensOut, self._on_tokens)
        sub(RequestFailed, self._on_failed)
        sub(Withdrawn, self._on_withdrawn)
        sub(PhaseSwitched, self._on_switched)
        sub(NodeDown, self._on_node_down)
        sub(NodeUp, self._on_node_up)

    def _on_kv(self, ev: NodeKVEvents) -> None:
        self.directory.apply_batch(ev.node, ev.batch)
        self._flush_hints()

    def _on_state(self, ev: NodeState) -> None:
        self.router.on_state(ev)
        self.planner.observe_state(ev)

    def _on_prefill_started(self, ev: PrefillStarted) -> None:
        f = self._flights.get(ev.request)
        if f is None or f.prefill != ev.node:
            return
        f.prefill_start = ev.time
        binding = self.router.prefill_started(ev.request, ev.node, ev.time)
        if isinstance(binding, Refusal):
            self.drivers[ev.node].abort(ev.request)
            self._fail(f, NoNodeError(binding.phase, binding.reason))
        elif isinstance(binding, DecodeBinding):
            self._submit_decode(f, binding)
            self._flush_hints()

    def _on_prefill_done(self, ev: PrefillDone) -> None:
        f = self._flights.get(ev.request)
        if f is None or f.prefill != ev.node:
            return
        f.cached, f.fetched, f.computed = ev.cached, ev.fetched, ev.computed
        if ev.prompt_logprobs is not None:
            f.sink.prompt_logprobs(ev.prompt_logprobs)
        self.router.prefill_done(ev.request, ev.node)
        self._flush_hints()
        self._check_drains()

    def _on_tokens(self, ev: TokensOut) -> None:
        f = self._flights.get(ev.request)
        if f is None or f.decode != ev.node:
            return
        now = self.clock.now()
        f.progress = now
        if not f.admitted:
            f.admitted = True
            f.first = ev.time
            self.router.decode_admitted(ev.request, ev.node)
            self._set_decoding(self._decoding + 1)
            self._flush_hints()
            if self._switching:
                self._check_drains()
        f.out += len(ev.tokens)
        if len(ev.tokens):
            f.sink.tokens(ev.tokens, ev.logprobs)
            if f.answer is not None:
                f.answer.add(np.asarray(ev.tokens, np.uint32))
        if ev.finish is not None:
            f.finish = ev.finish
            self._close(f, "ok", None)

    def _on_failed(self, ev: RequestFailed) -> None:
        f = self._flights.get(ev.request)
        if f is None or ev.node not in (f.prefill, f.decode):
            return
        # A request the engine refused itself would be refused anywhere: not routed again.
        if (not ev.rejected and ev.node == f.prefill and not ev.started
                and f.prefill_start is None):
            again = self.router.failed(ev.request, ev.node, False, self.clock.now())
            if isinstance(again, (Route, Held)):
                self.counters["rerouted"] += 1
                log.info("request_rerouted", request=f.id, failed_on=ev.node,
                         to=getattr(again, "node", "held"), error=ev.error)
                self._reroute(f, again, "rerouted")
                self._flush_hints()
                return
        for node in {f.prefill, f.decode} - {None, ev.node}:
            self.drivers[node].abort(ev.request)
        self._fail(f, RequestError(f"the engine refused the request: {ev.error}")
                   if ev.rejected else EngineError(ev.node, ev.error))

    def _on_withdrawn(self, ev: Withdrawn) -> None:
        f = self._flights.get(ev.request)
        if f is None or f.prefill != ev.node:
            return
        self._reroute(f, self.router.withdrawn(ev.request, ev.node, self.clock.now()),
                      "withdrawn")
        self._flush_hints()
        self._check_drains()

    def _on_switched(self, ev: PhaseSwitched) -> None:
        phase = Phase(ev.phase)
        self.router.switched(ev.node, phase)
        if self._switching.get(ev.node) is phase:
            del self._switching[ev.node]
        self.planner.drained(ev.node, self.clock.now())
        self._flush_hints()
        log.info("node_switched", node=ev.node, phase=ev.phase)

    def _on_node_up(self, ev: NodeUp) -> None:
        """A restarted engine serves again (its phase follows): route to it again. Its count
        marks are reset to the directory's, which released the node's counts when it went
        down: an engine that was only out of reach still holds marks of those."""
        log.info("node_up", node=ev.node)
        self.router.node_up(ev.node)
        self.drivers[ev.node].push_hints(self.directory.full_hints(ev.node))

    def _on_node_down(self, ev: NodeDown) -> None:
        (log.info if self._stopping else log.error)("node_down", node=ev.node, reason=ev.reason)
        self.router.node_down(ev.node)
        self._switching.pop(ev.node, None)
        # A dead engine may not report its requests: settle them here (re-route the ones
        # whose prefill had not started, fail the rest); late reports are then ignored.
        for f in [f for f in self._flights.values() if ev.node in (f.prefill, f.decode)]:
            self._on_failed(RequestFailed(f.id, ev.node, ev.time, f"node {ev.node} down: "
                                          f"{ev.reason}", f.prefill_start is not None))

    # -- finishing -------------------------------------------------------------------------

    def _fail(self, f: _Flight, error: EvinfraError) -> None:
        self._close(f, type(error).__name__, error)

    def _close(self, f: _Flight, status: str, error: EvinfraError | None) -> None:
        if self._flights.pop(f.id, None) is None:
            return
        now = self.clock.now()
        if f.timer is not None:
            f.timer.cancel()
        if f.admitted:
            self._set_decoding(self._decoding - 1)
        self._held.pop(f.id, None)
        self.router.finished(f.id, now)
        self._active[f.branch] -= 1
        if not self._active[f.branch]:
            del self._active[f.branch]
        if status == "ok":
            self.counters["ok"] += 1
            self.planner.observe_request(now, f.computed, f.cached, f.out)
        else:  # a client that went away, or a bad request, is not a failure of the cluster
            self.counters[{"aborted": "aborted", "RequestError": "rejected"}.get(
                status, "failed")] += 1
        if f.end_branch and self._active[f.branch]:
            self._end_after(f.branch)
        elif f.end_branch:
            if f.branch in self.directory.branches:
                self._end(f.branch)
        elif f.branch in self.directory.branches:
            self._idle_from(f.branch, now)
            if f.answer is not None and status == "ok" and not self._active[f.branch]:
                self.carry.answered(f.branch, f.answer)
        self._flush_hints()
        self._check_drains()
        record = RequestDone(
            f.id, f.branch, f.arrival, now, status, int(f.tokens.size), f.out, f.cached,
            f.fetched, f.first, f.prefill_start, f.prefill, f.decode,
            error.message if error is not None else "", f.reroutes, f.finish)
        self.planner.observe_done(record)
        f.sink.done(record, error)
        self.bus.publish(record)
        self._release_held()

    def _set_decoding(self, q: int) -> None:
        self._decoding = q
        self.planner.observe_decode(self.clock.now(), q)

    # -- timeouts --------------------------------------------------------------------------

    def _arm_timer(self, f: _Flight) -> None:
        limit = self._limit(f)
        if limit is not None:
            f.timer = self._at(f.progress + limit, self._check_timeout, f)

    def _limit(self, f: _Flight) -> float | None:
        s = self.config.server
        return s.first_token_timeout_s if f.first is None else s.token_timeout_s

    def _check_timeout(self, f: _Flight) -> None:
        if f.id not in self._flights:
            return
        limit = self._limit(f)
        if limit is None:
            return
        now = self.clock.now()
        if now < f.progress + limit:
            f.timer = self._at(f.progress + limit, self._check_timeout, f)
            return
        self.counters["timeouts"] += 1
        node = (f.decode if f.first is not None else f.prefill) or "-"
        what = "no output" if f.first is not None else "no first token"
        log.warning("request_timeout", request=f.id, node=node, waited=limit, what=what)
        for n in {f.prefill, f.decode} - {None}:
            self.drivers[n].abort(f.id)
        self._fail(f, EngineError(node, f"{what} within {limit:g} s", timeout=True))

    # -- hints -----------------------------------------------------------------------------

    def _flush_hints(self) -> None:
        for node, delta in self.directory.take_all_hints():
            self.drivers[node].push_hints(delta)

    # -- branches their harness forgot ----------------------------------------------------

    def _end(self, branch: BranchId) -> None:
        """E.2 line 13 for a branch the service ends: it leaves the idle orders too."""
        self.directory.end(branch)
        self._idle_since.pop(branch, None)
        self._inferred_idle_since.pop(branch, None)
        if self.chains is not None:
            self.chains.forget(branch)
        self.carry.forget(branch)

    def _idle_limits(self) -> list[tuple[dict[BranchId, float], float]]:
        """Each idle order and how long its branches may idle (orders never swept left out:
        named branches when ``branch_idle_s`` is unset, as in the simulator)."""
        server = self.config.server
        out = []
        if server.branch_idle_s is not None:
            out.append((self._idle_since, server.branch_idle_s))
        if self.chains is not None:
            out.append((self._inferred_idle_since, server.inferred_branch_idle_s))
        return out

    def _idle_from(self, branch: BranchId, now: float) -> None:
        """``branch`` has nothing in flight since ``now``: it goes to the back of its idle
        order (not kept at all when its kind of branch is never ended for being idle)."""
        inferred = self.chains is not None and branch in self.chains
        if inferred or self.config.server.branch_idle_s is not None:
            order = self._inferred_idle_since if inferred else self._idle_since
            order.pop(branch, None)
            order[branch] = now

    def _schedule_sweep(self) -> None:
        every = min(limit for _, limit in self._idle_limits()) / 8
        self._sweep = self._at(self.clock.now() + every, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """End the branches idle for their limit (E.2 line 13, on their harness's behalf);
        a branch is idle from the end of its last request, so one in flight is never ended."""
        now = self.clock.now()
        ended = False
        for order, limit in self._idle_limits():
            cutoff = now - limit
            due = []
            for branch, since in order.items():
                if since > cutoff:
                    break
                due.append((branch, since))
            for branch, since in due:
                del order[branch]
                if not self._active[branch] and branch in self.directory.branches:
                    self._end(branch)
                    ended = True
                    self.counters["branches_expired"] += 1
                    log.info("branch_expired", branch=branch, idle_s=round(now - since, 3))
        if ended:
            self._flush_hints()
        self._schedule_sweep()

    # -- the planner and phase switches -----------------------------------------------------

    def _schedule_tick(self) -> None:
        when = max(self.planner.window_end, self.clock.now() + 1e-3)
        self._tick = self._at(when, self._on_tick)

    def _on_tick(self) -> None:
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
                self._schedule_tick()

    def _finish_warmup(self, now: float, split: Split, reason: str) -> None:
        """E.3 line 1: fit and freeze the models, then leave the collocated mode."""
        reports = self.planner.finish_warmup(now)
        self.router.set_models(self.planner.models.values())
        if split != self.planner.split:
            self.planner.switch_to(split, now)
        self._apply(split, now, reason)
        log.info("warmup_finished", usable=[r.node for r in reports if r.usable],
                 unusable={r.node: r.problems for r in reports if not r.usable})

    def force_split(self, prefill: list[NodeId]) -> Split:
        """An operator's split (``POST /v1/evinfra/split``); during the warm-up it ends the
        warm-up now. Raises :class:`RequestError` for a split the cluster cannot take."""
        unknown = sorted(set(prefill) - set(self.nodes))
        if unknown:
            raise RequestError(f"unknown nodes {unknown}", param="prefill")
        split = Split.of(self.nodes, prefill)
        if not split.prefill or not split.decode:
            raise RequestError("a split needs at least one prefill and one decode node",
                               param="prefill")
        if self._switching:
            raise RequestError(f"{sorted(self._switching)} still switching: try again when "
                               "they are done", status=409)
        now = self.clock.now()
        with self.bus.running():
            if self.planner.warming_up:
                self._finish_warmup(now, split, "forced by an operator")
            else:
                self.planner.switch_to(split, now)
                self._apply(split, now, "forced by an operator")
        return split

    def cordon(self, node: NodeId, cordoned: bool = True) -> list[RequestId]:
        """An operator takes ``node`` out of routing for maintenance (``POST
        /v1/evinfra/nodes/{node}/cordon``), or puts it back (``.../uncordon``). Its queued
        requests whose prefill has not started are withdrawn and routed elsewhere; what runs
        there finishes, and its KV stays readable by its peers. It keeps its phase; the
        planner's next decisions split the other nodes (as for a node that is down). Returns
        the withdrawn requests."""
        if node not in self.drivers:
            raise RequestError(f"unknown node {node!r}", param="node", status=404)
        with self.bus.running():
            withdrawn = self.router.cordon(node, cordoned)
            for rid in withdrawn:
                self.drivers[node].withdraw(rid)
        log.info("node_cordoned" if cordoned else "node_uncordoned", node=node,
                 withdrawn=len(withdrawn))
        return withdrawn

    def _apply(self, split: Split, now: float, reason: str) -> None:
        """Switch the nodes whose phase differs (paper 4.2): stop routing their old phase,
        withdraw their queued requests, and switch each engine once it has drained."""
        self.counters["switches"] += 1
        self.bus.publish(SplitChanged(now, list(split.prefill), list(split.decode), reason))
        log.info("split_change", split=split.label, reason=reason)
        for node in self.nodes:
            phase = Phase.PREFILL if node in split.prefill else Phase.DECODE
            if self.router.phase(node) is phase and self.router.draining(node) is None:
                continue
            collocated = self.router.phase(node) is Phase.COLLOCATED
            for rid in self.router.begin_switch(node, phase):
                self.drivers[node].withdraw(rid)
            if collocated:
                # Serving both phases already: the engine finishes its other-phase work and
                # switches by itself; the router routes it by its new phase at once.
                self.directory.switch_phase(node, phase)
                self.drivers[node].switch_phase(phase)
            else:
                # In place or by relaunch (the engine's), the node first finishes its running
                # requests: a relaunch is Dynamo's graceful shutdown, routing stopped and
                # in-flight work completed before the worker exits.
                self._switching[node] = phase
        self._check_drains()

    def _check_drains(self) -> None:
        # A relaunch drops the node's KV: the decode side must have read its prefills first.
        handoffs = self.policy.switch == "relaunch"
        for node, phase in list(self._switching.items()):
            if self.router.drained(node, handoffs):
                del self._switching[node]
                self.drivers[node].switch_phase(phase)

    # -- status ----------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        p, d = self.router.split()
        nodes = {}
        for n in self.nodes:
            view = self.router.node_view(n)
            state = self.router._nodes[n].state
            if state is not None:
                view.update(l1_used=state.l1_used, l1_capacity=state.l1_capacity,
                            l2_used=state.l2_used, l2_capacity=state.l2_capacity,
                            reported_at=state.time)
            view["driver"] = dict(self.drivers[n].stats)
            nodes[n] = view
        c = sorted(n for n in self.nodes if self.router.phase(n) is Phase.COLLOCATED)
        # "6P3D"; "9C" during the collocated warm-up (not "0P0D")
        label = "".join(f"{k}{x}" for k, x in ((len(p), "P"), (len(d), "D"), (len(c), "C")) if k)
        return {
            "time": self.clock.now(),
            "policy": {"name": self.config.policy.name,
                       **{k: v for k, v in msgspec.to_builtins(self.policy).items()
                          if k != "about"}},
            "split": {"prefill": p, "decode": d, "label": label, "collocated": c,
                      "switching": {n: ph.value for n, ph in self._switching.items()}},
            "warming_up": self.planner.warming_up,
            "warmup_until": self.planner.warmup_end,
            "next_decision_at": self.planner.window_end,
            "in_flight": len(self._flights),
            "counters": dict(self.counters),
            "inferred_branches": len(self.chains) if self.chains is not None else 0,
            "nodes": nodes,
            "directory": self.directory.summary(),
            "planner": {
                "last_decision": msgspec.to_builtins(self.last_decision)
                if self.last_decision else None,
                "fits": {n: msgspec.to_builtins(r) for n, r in self.planner.fits.items()},
            },
            "bus_errors": self.bus.errors,
        }

    def branch_counts(self, branch: BranchId) -> dict[NodeId, int]:
        """How many blocks the branch counts on each node (for tests and debugging)."""
        if branch not in self.directory.branches:
            raise UnknownBranchError(branch)
        return {self.directory.nodes[i]: len(self.directory.branches.counted(branch, i))
                for i in self.directory.branches.nodes_of(branch)}

