"""A request's life in the control plane: accepted, routed, held or routed again, bound to
decode, streamed, and ended — by the engines' events, a timeout, the client, or a node lost.

:meth:`Lifecycle.end` is the one way a request ends: it leaves the ledger and the router's
books, its branch goes idle or ends, the planner and the bus get its record, its sink its
outcome. Every handler here is synchronous and runs to completion on the bus (``core/bus.py``):
an engine's answer to an order given here arrives after the handler returns.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np
import structlog

from evinfra.control.branches import BranchKeeper, Inference
from evinfra.control.counters import Counters
from evinfra.control.engines import Engines
from evinfra.control.ledger import Flight, Ledger
from evinfra.control.switching import Switching
from evinfra.config import ServerConfig
from evinfra.core.bus import Bus
from evinfra.core.clock import Clock, Timer
from evinfra.core.contracts import DecodeOrder, PrefillOrder, Sampling
from evinfra.core.events import (NodeDown, NodeKVEvents, NodeKVViewLost, NodeState, NodeUp,
                                 PrefillDone, PrefillStarted, RequestDone, RequestFailed,
                                 TokenLogprobs, TokensOut, Withdrawn)
from evinfra.core.types import BranchId, NodeId, RequestId
from evinfra.directory import Directory
from evinfra.errors import EngineError, EvinfraError, NoNodeError, RequestError
from evinfra.router.router import DecodeBinding, Held, Refusal, Route, Router

__all__ = ["Lifecycle", "RequestSink"]

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


class Lifecycle:
    def __init__(self, server: ServerConfig, ledger: Ledger, router: Router,
                 directory: Directory, planner, engines: Engines, branches: BranchKeeper,
                 switching: Switching, bus: Bus, clock: Clock, counters: Counters,
                 at: Callable[..., Timer]) -> None:
        self.server = server
        self.ledger = ledger
        self.router = router
        self.directory = directory
        self.planner = planner
        self.engines = engines
        self.branches = branches
        self.switching = switching
        self.bus = bus
        self.clock = clock
        self.counters = counters
        self._at = at
        self._decoding = 0
        self.stopping = False

    def subscribe(self) -> None:
        sub = self.bus.subscribe
        sub(NodeKVEvents, self._on_kv)
        sub(NodeKVViewLost, lambda ev: self.directory.view_lost(ev.node))
        sub(NodeState, self._on_state)
        sub(PrefillStarted, self._on_prefill_started)
        sub(PrefillDone, self._on_prefill_done)
        sub(TokensOut, self._on_tokens)
        sub(RequestFailed, self._on_failed)
        sub(Withdrawn, self._on_withdrawn)
        sub(NodeDown, self._on_node_down)
        sub(NodeUp, self._on_node_up)

    # -- acceptance ------------------------------------------------------------------------

    def submit(self, rid: RequestId, tokens: np.ndarray, sampling: Sampling,
               guess: Inference, hinted: bool, sink: RequestSink) -> None:
        """Route a request whose branch ``guess`` names (``hinted``: its harness named it).
        Raises :class:`NoNodeError` when no node can take it; nothing is kept then."""
        now = self.clock.now()
        branch, parent, final = guess.branch, guess.parent, guess.final
        # A hint-less request's branch is its own if this request starts it (nothing else
        # knows it then).
        own = not hinted and branch not in self.directory
        f = Flight(rid, branch, tokens, sampling, sink, now, parent, final)
        decision = self.router.route(f, now)
        if isinstance(decision, Refusal):
            self.counters.refused += 1
            self.router.finished(rid, now)
            self.branches.refused(branch, own, now)
            raise NoNodeError(decision.phase, decision.reason)
        self.branches.accepted(guess, own)
        f.answer = guess.answer
        self.counters.submitted += 1
        self.ledger.add(f)
        self.planner.observe_arrival(branch, now)
        self._population_changed()
        if isinstance(decision, Held):
            self.ledger.hold(f)
        else:
            self._dispatch(f, decision)
        self._arm_timer(f)
        self._release_held()
        self.engines.flush_hints()

    def _dispatch(self, f: Flight, route: Route) -> None:
        self.engines[route.node].submit_prefill(PrefillOrder(
            f.id, f.tokens, route.path.hashes, route.fetch, f.sampling,
            cached_tokens=route.prediction.t_c, branch=f.branch, final=f.final))
        if route.decode is not None:
            self._submit_decode(f, route.decode)

    def _submit_decode(self, f: Flight, binding: DecodeBinding) -> None:
        self.engines[binding.node].submit_decode(DecodeOrder(
            f.id, binding.source, f.tokens, f.path.hashes, f.sampling, branch=f.branch,
            final=f.final))

    def _reroute(self, f: Flight, decision: Route | Refusal | Held | None, why: str,
                 unbound: NodeId | None = None) -> None:
        """Carry out a second routing of a request whose prefill had not started.
        ``unbound``: the decode node bound at submit that the router let go; its order is
        aborted here."""
        if unbound is not None:
            self.engines[unbound].abort(f.id)
        if isinstance(decision, Route):
            f.reroutes += 1
            self._dispatch(f, decision)
        elif isinstance(decision, Held):
            self.ledger.hold(f)
        else:
            self.fail(f, NoNodeError("prefill", decision.reason if decision else why))

    def _release_held(self) -> None:
        """Route the held requests the prefill strategy lets go now."""
        if not self.ledger.has_held():
            return
        now = self.clock.now()
        for rid in self.router.take_released(now):
            f = self.ledger.unhold(rid)
            if f is not None:
                self._reroute(f, self.router.reroute(rid, now), "released")

    # -- ends ------------------------------------------------------------------------------

    def abort(self, f: Flight) -> None:
        """The client went away: stop the request everywhere, quietly."""
        self.engines.abort(f.id, f.nodes())
        self.end(f, "aborted", EngineError(f.prefill or "-", "aborted by the client"))

    def fail(self, f: Flight, error: EvinfraError) -> None:
        self.end(f, type(error).__name__, error)

    def end(self, f: Flight, status: str, error: EvinfraError | None) -> None:
        """The one way a request ends (``status``: ``"ok"``, ``"aborted"``, or the error's
        type); a request already ended is left alone."""
        if not self.ledger.remove(f):
            return
        now = self.clock.now()
        if f.timer is not None:
            f.timer.cancel()
        if f.admitted:
            self._decoding -= 1
        self._population_changed()
        self.router.finished(f.id, now)
        c = self.counters
        if status == "ok":
            c.ok += 1
            self.planner.observe_request(now, f.computed, f.cached, f.out)
        elif status == "aborted":  # a client that went away is not a failure of the cluster
            c.aborted += 1
        elif status == "RequestError":  # nor is a bad request
            c.rejected += 1
        else:
            c.failed += 1
        self.branches.request_over(f, status == "ok", now)
        self.engines.flush_hints()
        self.switching.check_drains()
        record = RequestDone(
            f.id, f.branch, f.arrival, now, status, int(f.tokens.size), f.out, f.cached,
            f.fetched, f.first, f.prefill_start, f.prefill, f.decode,
            error.message if error is not None else "", f.reroutes, f.finish)
        self.planner.observe_done(record)
        f.sink.done(record, error)
        self.bus.publish(record)
        self._release_held()

    def end_branch(self, branch: BranchId) -> None:
        """The harness says the branch is over: now, or after its requests in flight."""
        if self.ledger.busy(branch):
            self.branches.end_after(branch)
            return
        self.branches.end(branch)
        self.engines.flush_hints()

    def _population_changed(self) -> None:
        """Tell the planner the requests in decode and in flight (queued ones, held ones
        and those in prefill count: they are decode work the cluster holds)."""
        self.planner.observe_population(self.clock.now(), self._decoding, len(self.ledger))

    # -- timeouts --------------------------------------------------------------------------

    def _arm_timer(self, f: Flight) -> None:
        limit = self._limit(f)
        if limit is not None:
            f.timer = self._at(f.progress + limit, self._check_timeout, f)

    def _limit(self, f: Flight) -> float | None:
        s = self.server
        return s.first_token_timeout_s if f.first is None else s.token_timeout_s

    def _check_timeout(self, f: Flight) -> None:
        if f.id not in self.ledger:
            return
        limit = self._limit(f)
        if limit is None:
            return
        now = self.clock.now()
        if now < f.progress + limit:
            f.timer = self._at(f.progress + limit, self._check_timeout, f)
            return
        self.counters.timeouts += 1
        node = (f.decode if f.first is not None else f.prefill) or "-"
        what = "no output" if f.first is not None else "no first token"
        log.warning("request_timeout", request=f.id, node=node, waited=limit, what=what)
        self.engines.abort(f.id, f.nodes())
        self.fail(f, EngineError(node, f"{what} within {limit:g} s", timeout=True))

    # -- engine events ---------------------------------------------------------------------

    def _on_kv(self, ev: NodeKVEvents) -> None:
        self.directory.apply_batch(ev.node, ev.batch)
        self.engines.flush_hints()

    def _on_state(self, ev: NodeState) -> None:
        self.router.on_state(ev)
        self.planner.observe_state(ev)

    def _on_prefill_started(self, ev: PrefillStarted) -> None:
        f = self.ledger.get(ev.request)
        if f is None or f.prefill != ev.node:
            return
        f.prefill_start = ev.time
        binding = self.router.prefill_started(ev.request, ev.node, ev.time)
        if isinstance(binding, Refusal):
            self.engines[ev.node].abort(ev.request)
            self.fail(f, NoNodeError(binding.phase, binding.reason))
        elif isinstance(binding, DecodeBinding):
            self._submit_decode(f, binding)
            self.engines.flush_hints()

    def _on_prefill_done(self, ev: PrefillDone) -> None:
        f = self.ledger.get(ev.request)
        if f is None or f.prefill != ev.node:
            return
        f.cached, f.fetched, f.computed = ev.cached, ev.fetched, ev.computed
        if ev.fetched and ev.fetch_s > 0:
            self.router.observe_fetch(ev.fetched, ev.fetch_s)
        if ev.prompt_logprobs is not None:
            f.sink.prompt_logprobs(ev.prompt_logprobs)
        self.router.prefill_done(ev.request, ev.node)
        self.engines.flush_hints()
        self.switching.check_drains()

    def _on_tokens(self, ev: TokensOut) -> None:
        f = self.ledger.get(ev.request)
        if f is None or f.decode != ev.node:
            return
        now = self.clock.now()
        f.progress = now
        if not f.admitted:
            f.first = ev.time
            self.router.decode_admitted(ev.request, ev.node)
            if f.timer is not None:  # the token limit counts from here, not from arrival
                f.timer.cancel()
                self._arm_timer(f)
            self._decoding += 1
            self._population_changed()
            self.engines.flush_hints()
            self.switching.check_drains()
        f.out += len(ev.tokens)
        if len(ev.tokens):
            f.sink.tokens(ev.tokens, ev.logprobs)
            if f.answer is not None:
                f.answer.add(np.asarray(ev.tokens, np.uint32))
        if ev.finish is not None:
            f.finish = ev.finish
            self.end(f, "ok", None)

    def _on_failed(self, ev: RequestFailed) -> None:
        f = self.ledger.get(ev.request)
        if f is None or ev.node not in (f.prefill, f.decode):
            return
        # The nodes holding its orders, before the router lets a decode node bound at submit
        # go: each of them is aborted or handed over below.
        nodes, bound = f.nodes(), f.decode
        # A request the engine refused itself would be refused anywhere: not routed again.
        if (not ev.rejected and ev.node == f.prefill and not ev.started
                and f.prefill_start is None):
            again = self.router.failed(ev.request, ev.node, False, self.clock.now())
            if isinstance(again, (Route, Held)):
                self.counters.rerouted += 1
                log.info("request_rerouted", request=f.id, failed_on=ev.node,
                         to=getattr(again, "node", "held"), error=ev.error)
                self._reroute(f, again, "rerouted", bound)
                self.engines.flush_hints()
                return
        self.engines.abort(ev.request, nodes - {ev.node})
        self.fail(f, RequestError(f"the engine refused the request: {ev.error}")
                  if ev.rejected else EngineError(ev.node, ev.error))

    def _on_withdrawn(self, ev: Withdrawn) -> None:
        f = self.ledger.get(ev.request)
        if f is None or f.prefill != ev.node:
            return
        bound = f.decode
        self._reroute(f, self.router.withdrawn(ev.request, ev.node, self.clock.now()),
                      "withdrawn", bound)
        self.engines.flush_hints()
        self.switching.check_drains()

    def _on_node_up(self, ev: NodeUp) -> None:
        """A restarted engine serves again (its phase follows): route to it again. Its count
        marks are reset to the directory's, which released the node's counts when it went
        down: an engine that was only out of reach still holds marks of those."""
        log.info("node_up", node=ev.node)
        self.router.node_up(ev.node)
        self.engines.resync_hints(ev.node)

    def _on_node_down(self, ev: NodeDown) -> None:
        (log.info if self.stopping else log.error)("node_down", node=ev.node, reason=ev.reason)
        self.router.node_down(ev.node)
        # A dead engine may not report its requests: settle them here (re-route the ones
        # whose prefill had not started, fail the rest); late reports are then ignored.
        for f in self.ledger.on(ev.node):
            self._on_failed(RequestFailed(f.id, ev.node, ev.time, f"node {ev.node} down: "
                                          f"{ev.reason}", f.prefill_start is not None))
