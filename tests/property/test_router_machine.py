"""Stateful test: the real router against a naive model of its per-node books.

Random programs of what the service does with a router (``control/lifecycle.py`` and
``control/switching.py``) run on a real :class:`~evinfra.router.router.Router` over a real
directory: requests routed on a few branches (held and released by a pausing prefill
strategy), prefills started, done (the node stores the KV), admitted at decode, finished,
failed before and after they started; nodes reporting state, cordoned and uncordoned,
switched by new splits (``begin_switch``, the withdrawals it asks for, ``take_drained``,
the engine's ``PhaseSwitched``), lost and restarted. A few plain dicts and sets keep, per
node, what was sent there and not prefilled yet (``Q_n``, with the uncached tokens each
entry still has; started prefills included, as the router counts them), what is
prefilling, what was handed off to a decode node and not admitted there yet, what is bound
to decode there and not finished, and what of that has not been admitted yet. After every
step the router's public reads must agree with them: ``node_view``, ``loads``,
``requests``, ``switching``, ``drained``, ``split``, ``routable``, ``phase``, ``draining``,
``state``, the request records it books into, and ``check_invariants``; each decision it
returns (the prefill node and its fetch plan, the decode binding, a refusal, a hold, the
requests to withdraw, the nodes drained) must be the one the model expects.

Three broken routers at the end show that the machine fails when the books are wrong.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from evinfra.core.events import BlockStored, NodeState, PrefillItem
from evinfra.core.types import Phase
from evinfra.directory import Directory
from evinfra.router.router import (DecodeBinding, Held, Refusal, Route, Router, RouterConfig,
                                   Routing)
from evinfra.router.strategy import FewestRequests, Hold, TTFTStrategy
from evinfra.router.ttft import TTFTConfig
from tests.conftest import MIN_STEPS

PAGE = 4
NODES = {"p1": Phase.PREFILL, "p2": Phase.PREFILL,
         "d1": Phase.DECODE, "d2": Phase.DECODE}
NAMES = sorted(NODES)
BRANCHES = ["a", "b", "c"]
MAX_AGE = 5.0  # TTFTConfig.state_max_age_s
# Fetching is free and allowed from 8 tokens on, so routes plan fetches from peers.
CONFIG = RouterConfig(ttft=TTFTConfig(fetch_min_tokens=8, fetch_base_s=0.0,
                                      fetch_s_per_token=0.0, kappa=0.0, state_max_age_s=MAX_AGE))

STEPS = {"n": 0}


def route_request(request, branch, tokens, max_tokens, parent=None, final=False, reuse=True):
    """The one place the router's input is built: a fresh record for each route."""
    return Routing(request, branch, tokens, max_tokens, parent, final, reuse)


class PausingStrategy(TTFTStrategy):
    """Evinfra's prefill choice, except that requests of a paused branch are held (as
    ThunderAgent's paused programs) and released once the branch resumes."""

    def __init__(self) -> None:
        self.paused: set[str] = set()
        self.waiting: dict[str, str] = {}  # held request -> its branch
        self.seen: tuple | None = None  # what the router showed of the last request

    def choose(self, view):  # type: ignore[override]
        self.seen = (view.request, view.branch, list(view.nodes), view.t_in, view.need)
        if view.branch in self.paused:
            self.waiting[view.request] = view.branch
            return Hold(f"branch {view.branch} paused")
        self.waiting.pop(view.request, None)
        return super().choose(view)

    def finished(self, request, now):  # type: ignore[override]
        self.waiting.pop(request, None)

    def released(self, now):  # type: ignore[override]
        out = [r for r, b in self.waiting.items() if b not in self.paused]
        for r in out:
            del self.waiting[r]
        return out


class SeenDecode(FewestRequests):
    """Evinfra's decode choice, remembering what the router offered it (each node's room,
    requests and cached prefix: the router's decode books as a strategy sees them). With
    ``at_submit`` it binds when the request is routed (as SGLang PD's gateway does): the
    decode node reserves room while the request queues for prefill."""

    def __init__(self, at_submit: bool) -> None:
        self.at_submit = at_submit
        self.seen: tuple[int, list] | None = None

    def choose(self, need, options):  # type: ignore[override]
        self.seen = (need, list(options))
        return super().choose(need, options)


class Req:
    """The model's record of a request in flight (what the ledger knows of it)."""

    __slots__ = ("id", "branch", "need", "t_in", "prefill", "decode", "started", "done",
                 "admitted", "held", "l1", "path")

    def __init__(self, rid: str, branch: str, need: int, t_in: int) -> None:
        self.id, self.branch, self.need, self.t_in = rid, branch, need, t_in
        self.prefill: str | None = None  # None while held
        self.decode: str | None = None
        self.started = self.done = self.admitted = False
        self.held = False  # the strategy holds it, and has not released it yet
        self.l1: dict[str, int] = {}  # its path's leading blocks in each node's GPU memory
        self.path: list[int] = []  # its input's full pages (block hashes)


# Which requests a rule may act on (what the engines could report of them).
UNSTARTED = lambda f: f.prefill is not None and not f.started  # noqa: E731  queued, unstarted
PREFILLING = lambda f: f.started and not f.done  # noqa: E731
TO_ADMIT = lambda f: f.done and f.decode is not None and not f.admitted  # noqa: E731
STARTED = lambda f: f.started  # noqa: E731
HELD = lambda f: f.held  # noqa: E731


class RouterMachine(RuleBasedStateMachine):
    router_cls = Router

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.relaunch = False
        self.at_submit = False
        self._build()
        # The model: per request, and per node its books, health, phase and drain.
        self.reqs: dict[str, Req] = {}
        self.queued: dict[str, dict[str, int]] = {n: {} for n in NODES}  # rid -> u, in order
        self.prefilling: dict[str, set[str]] = {n: set() for n in NODES}
        self.handoff: dict[str, set[str]] = {n: set() for n in NODES}
        self.decoding: dict[str, set[str]] = {n: set() for n in NODES}
        self.unadmitted: dict[str, set[str]] = {n: set() for n in NODES}
        self.phase = dict(NODES)
        self.draining: dict[str, Phase | None] = dict.fromkeys(NODES)
        self.told = dict.fromkeys(NODES, False)
        self.engine_to: dict[str, Phase | None] = dict.fromkeys(NODES)  # told to switch to
        self.healthy = dict.fromkeys(NODES, True)
        self.cordoned = dict.fromkeys(NODES, False)
        self.reports: dict[str, NodeState] = {}
        self.pending: set[tuple[str, str]] = set()  # withdraw orders out: (request, node)
        self.tokens: dict[str, list[int]] = {}  # each branch's last input
        self.inputs: dict[str, object] = {}  # what route() was given, per request
        self.next_id = 0

    def _build(self) -> None:
        self.strategy = PausingStrategy()
        self.decode = SeenDecode(self.at_submit)
        self.router = self.router_cls(Directory(NODES, PAGE), CONFIG, prefill=self.strategy,
                                      decode=self.decode)

    @initialize(relaunch=st.booleans(), at_submit=st.booleans())
    def deployment(self, relaunch: bool, at_submit: bool) -> None:
        """Engines that switch by relaunching (their drain waits for the handoffs), and a
        decode strategy that binds at submit or when the prefill starts."""
        self.relaunch, self.at_submit = relaunch, at_submit
        self._build()

    # -- the model's rules ---------------------------------------------------------------

    def _routable(self, n: str) -> bool:
        return self.healthy[n] and not self.cordoned[n] and self.draining[n] is None

    def _routable_of(self, phase: Phase) -> list[str]:
        return [n for n in NAMES if self._routable(n) and self.phase[n] is phase]

    def _room(self, n: str) -> int | None:
        s = self.reports.get(n)
        if s is None or self.now - s.time > MAX_AGE:
            return None
        return s.kv_room - sum(self.reqs[q].need for q in self.unadmitted[n])

    def _drained(self, n: str, handoffs: bool) -> bool:
        if self.draining[n] is None:
            return False
        if self.phase[n] is Phase.PREFILL:
            return not self.queued[n] and not self.prefilling[n] and not (handoffs
                                                                          and self.handoff[n])
        return not self.decoding[n]

    def _check_binding(self, f: Req, got: DecodeBinding | Refusal | None, source: str) -> bool:
        """A decode binding (E.3 line 13) as the model makes it (``FewestRequests``, from
        its docstring): the routable decode nodes are offered to the strategy with their
        room (the last fresh report's less what requests bound there and not admitted yet
        need), their requests and the request's prefix in their GPU memory when it was
        routed; among those with room for the request (or no fresh report), those that
        report room first, then the fewest requests, the longest prefix, the name; with
        room nowhere, the most room. A refusal when no decode node is routable. True if
        the request is still alive."""
        nodes = self._routable_of(Phase.DECODE)
        seen, self.decode.seen = self.decode.seen, None
        if not nodes:
            assert isinstance(got, Refusal) and got.phase == "decode", got
            assert seen is None
            return False
        assert isinstance(got, DecodeBinding), got
        assert (got.request, got.source) == (f.id, source)
        opts = {n: (self._room(n), len(self.decoding[n]), f.l1.get(n, 0)) for n in nodes}
        assert seen is not None and seen[0] == f.need, (seen, f.need)
        assert {o.node: (o.room, o.requests, o.cached) for o in seen[1]} == opts, (seen, opts)
        fits = [n for n, (room, _, _) in opts.items() if room is None or room >= f.need]
        if fits:
            want = min(fits, key=lambda n: (opts[n][0] is None, opts[n][1], -opts[n][2], n))
        else:
            want = max(nodes, key=lambda n: (opts[n][0], -opts[n][1], n))
        assert got.node == want, (got, opts, f.need)
        f.decode = got.node
        self.decoding[got.node].add(f.id)
        self.unadmitted[got.node].add(f.id)
        return True

    def _check_route(self, f: Req, got: Route | Refusal | Held, known: bool) -> None:
        """A routing (new, again after a withdrawal or a failure, or released from hold):
        a refusal iff no prefill node is routable, a hold iff the branch is paused, else a
        routable prefill node, which queues it. ``known``: the router had the request in
        its books before (the service ends a refused request with ``finished``)."""
        nodes = self._routable_of(Phase.PREFILL)
        f.prefill = None
        seen, self.strategy.seen = self.strategy.seen, None
        if not nodes:
            assert isinstance(got, Refusal) and got.phase == "prefill", got
            assert seen is None
            self._end(f, known)
            return
        # The prefill strategy was shown the routable prefill nodes, in the router's order.
        assert seen == (f.id, f.branch, [n for n in NODES if n in nodes], f.t_in, f.need), seen
        if f.branch in self.strategy.paused:
            assert isinstance(got, Held) and got.request == f.id, got
            f.held = True
            return
        if self.at_submit and not self._routable_of(Phase.DECODE):
            assert isinstance(got, Refusal) and got.phase == "decode", got
            self._end(f, True)
            return
        assert isinstance(got, Route), got
        assert got.request == f.id and got.node in nodes, (got, nodes)
        assert got.candidates == len(nodes)
        p = got.prediction
        assert p.node == got.node and p.t_uc + p.t_c == f.t_in and p.t_uc >= 1
        f.path = list(got.path.hashes)
        # What each node held of it as it was routed (the directory's lookup, tested on
        # its own): the decode binding's tie-break.
        if self.inputs[f.id].reuse:
            m = self.router.directory.match(got.path.hashes)
            f.l1 = {n: m.own_l1[self.router.directory.index(n)] for n in NODES}
        else:
            f.l1 = {}
        # The fetch plan: a run backing the node's own prefix, from the peer that holds the
        # longest prefix (when one holds any of it), then blocks own..t_c of the path, in
        # order, each from a peer that holds it; a block left out is one the node holds
        # itself.
        d, hashes = self.router.directory, got.path.hashes
        me, pos = d.index(got.node), p.own // PAGE
        fetch = list(got.fetch)
        m = d.match(hashes)
        reach = max(m.own[i] for i in range(len(m.own)) if i != me) if len(m.own) > 1 else 0
        if pos and reach:
            back = fetch.pop(0)
            assert back.start == 0 and back.peer != got.node, (back, got)
            assert m.own[d.index(back.peer)] == reach, (back, m)
            assert back.blocks == hashes[:min(reach, pos)], (back, got)
        for run in fetch + [None]:
            start = (p.t_c // PAGE if p.x else pos) if run is None else run.start
            assert start >= pos and all(d.holds(h, me) for h in hashes[pos:start]), (p, got)
            assert p.x or run is None, (p, got)  # nothing to fetch: no runs
            if run is None:
                break
            assert run.peer != got.node and run.blocks
            assert run.blocks == hashes[start:start + len(run.blocks)]
            assert all(d.holds(h, d.index(run.peer)) for h in run.blocks), (p, got)
            pos = start + len(run.blocks)
        f.prefill = got.node
        f.started = f.done = False
        self.queued[got.node][f.id] = p.t_uc
        if self.at_submit:
            assert self._check_binding(f, got.decode, got.node)
        else:
            assert got.decode is None

    def _end(self, f: Req, known: bool = True) -> None:
        """The service ends the request (``Lifecycle.end``): the router forgets it, and the
        drains are checked."""
        got = self.router.finished(f.id, self.now)
        assert got == (f.branch if known else None), (got, f.id)
        for n in NODES:
            self.queued[n].pop(f.id, None)
            for book in (self.prefilling, self.handoff, self.decoding, self.unadmitted):
                book[n].discard(f.id)
        self.reqs.pop(f.id, None)
        self.inputs.pop(f.id, None)
        self.pending = {(r, n) for r, n in self.pending if r != f.id}
        self._check_drains()
        self._release()

    def _unbind(self, f: Req) -> None:
        """A request bound at submit goes back to routing: its decode node lets it go."""
        if f.decode is not None and not f.started:
            self.decoding[f.decode].discard(f.id)
            self.unadmitted[f.decode].discard(f.id)
            f.decode = None

    def _store(self, node: str, f: Req) -> None:
        """The engine's KV events: ``node`` holds the request's path (whole leading blocks,
        as a radix cache does), so later routes see prefixes and plan fetches."""
        if f.path:
            self.router.directory.apply(node, BlockStored(f.path, None, [], PAGE, medium="GPU"))

    def _release(self) -> None:
        """``Lifecycle._release_held``, after every submit and every end: the strategy lets
        held requests go; each is routed again."""
        if not self._some(HELD):
            return
        want = sorted(f.id for f in self.reqs.values()
                      if HELD(f) and f.branch not in self.strategy.paused)
        got = self.router.take_released(self.now)
        assert sorted(got) == want
        for rid in got:
            self.reqs[rid].held = False
        for rid in got:
            if rid in self.reqs:  # a refusal ended it (and released others) meanwhile
                self._check_route(self.reqs[rid], self.router.reroute(rid, self.now),
                                  known=True)

    def _some(self, ok) -> bool:
        return any(ok(f) for f in self.reqs.values())

    def _pick(self, data: st.DataObject, ok) -> Req:
        return data.draw(st.sampled_from([f for f in self.reqs.values() if ok(f)]),
                         label="request")

    # -- requests ------------------------------------------------------------------------

    @rule(branch=st.sampled_from(BRANCHES), extend=st.booleans(),
          more=st.lists(st.integers(0, 30), min_size=1, max_size=40),
          parent=st.none() | st.sampled_from(BRANCHES),
          max_tokens=st.sampled_from([1, 50, 120, 200]), reuse=st.booleans(),
          final=st.booleans())
    def route(self, branch, extend, more, parent, max_tokens, reuse, final) -> None:
        """A new request (an agent's next turn: its context extended, or rewritten)."""
        toks = (self.tokens.get(branch, []) if extend else []) + more
        self.tokens[branch] = toks
        self.next_id += 1
        f = Req(f"r{self.next_id}", branch, len(toks) + max_tokens, len(toks))
        self.reqs[f.id] = f
        req = self.inputs[f.id] = route_request(f.id, branch, np.array(toks, np.uint32),
                                                 max_tokens, parent, final, reuse)
        got = self.router.route(req, self.now)
        self._check_route(f, got, known=False)
        self._release()

    def _start(self, f: Req) -> bool:
        """``PrefillStarted``: bind decode (unless bound at submit). False if it ended."""
        got = self.router.prefill_started(f.id, f.prefill, self.now)
        f.started = True
        self.prefilling[f.prefill].add(f.id)
        self.pending.discard((f.id, f.prefill))
        if f.decode is not None:
            assert got is None, got  # bound at submit
        elif not self._check_binding(f, got, f.prefill):
            self._end(f)  # the service aborts and fails it
            return False
        return True

    def _done(self, f: Req) -> None:
        """``PrefillDone``: the prefill node holds the KV (its KV events say so too)."""
        self.router.prefill_done(f.id, f.prefill)
        f.done = True
        self._store(f.prefill, f)
        self.queued[f.prefill].pop(f.id, None)
        self.prefilling[f.prefill].discard(f.id)
        if f.decode not in (None, f.prefill):
            self.handoff[f.prefill].add(f.id)
        self._check_drains()

    def _admit(self, f: Req) -> None:
        """The decode node read the KV and streams (its first ``TokensOut``)."""
        self.router.decode_admitted(f.id, f.decode)
        f.admitted = True
        self._store(f.decode, f)
        self.unadmitted[f.decode].discard(f.id)
        self.handoff[f.prefill].discard(f.id)
        self._check_drains()

    @precondition(lambda self: self._some(UNSTARTED))
    @rule(data=st.data())
    def prefill_started(self, data: st.DataObject) -> None:
        """The engine launched the first chunk (a withdrawal may still be on its way)."""
        self._start(self._pick(data, UNSTARTED))

    @precondition(lambda self: self._some(PREFILLING))
    @rule(data=st.data())
    def prefill_done(self, data: st.DataObject) -> None:
        self._done(self._pick(data, PREFILLING))

    @precondition(lambda self: self._some(TO_ADMIT))
    @rule(data=st.data())
    def decode_admitted(self, data: st.DataObject) -> None:
        self._admit(self._pick(data, TO_ADMIT))

    @precondition(lambda self: self._some(lambda f: UNSTARTED(f) or PREFILLING(f)))
    @rule(data=st.data(), admit=st.booleans())
    def serve(self, data: st.DataObject, admit: bool) -> None:
        """The engines take a request through its walk at once: started, prefilled, and
        admitted at decode or still to be read there (so long-lived decodes and handoffs
        pile up)."""
        f = self._pick(data, lambda f: UNSTARTED(f) or PREFILLING(f))
        if not f.started and not self._start(f):
            return
        self._done(f)
        if admit and f.decode is not None:
            self._admit(f)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finished(self, data: st.DataObject) -> None:
        """Done, aborted by the client, timed out, refused by an engine: any time."""
        self._end(self._pick(data, lambda f: True))

    @precondition(lambda self: self._some(UNSTARTED))
    @rule(data=st.data())
    def fail_before_start(self, data: st.DataObject) -> None:
        """The prefill engine failed a queued request: it is routed again."""
        f = self._pick(data, UNSTARTED)
        node = f.prefill
        got = self.router.failed(f.id, node, False, self.now)
        self.queued[node].pop(f.id, None)
        self.pending.discard((f.id, node))
        self._unbind(f)
        self._check_route(f, got, known=True)

    @precondition(lambda self: self._some(STARTED))
    @rule(data=st.data())
    def fail_after_start(self, data: st.DataObject) -> None:
        """An engine failed a started request: the router says so (None), the service ends
        it."""
        f = self._pick(data, STARTED)
        node = data.draw(st.sampled_from(sorted({f.prefill, f.decode} - {None})), label="node")
        assert self.router.failed(f.id, node, True, self.now) is None
        self.queued[node].pop(f.id, None)
        self.prefilling[node].discard(f.id)
        self.agree()
        self._end(f)

    # -- holds ---------------------------------------------------------------------------

    @rule(branch=st.sampled_from(BRANCHES), on=st.booleans())
    def pause(self, branch: str, on: bool) -> None:
        """The prefill strategy pauses a branch (its next requests are held) or resumes it."""
        (self.strategy.paused.add if on else self.strategy.paused.discard)(branch)

    # -- node reports and KV -------------------------------------------------------------

    @rule(dt=st.sampled_from([0.0, 0.1, 1.0, 6.0]), data=st.data())
    def heartbeat(self, dt: float, data: st.DataObject) -> None:
        """Time passes (a report over 5 s old is stale), then some nodes report an
        iteration: prefill chunks launched (they leave ``U``), their KV room."""
        self.now += dt
        for node in NAMES:
            if not self.healthy[node] or not data.draw(st.booleans(), label=f"{node} reports"):
                continue
            launched = []
            if self.phase[node] is Phase.PREFILL and self.queued[node]:
                picks = data.draw(st.lists(st.sampled_from(list(self.queued[node])), max_size=2,
                                           unique=True), label="launched")
                for rid in picks:
                    t = data.draw(st.integers(1, 50), label="chunk")
                    launched.append(PrefillItem(rid, t, 0, 0))
                    self.queued[node][rid] = max(0, self.queued[node][rid] - t)
            room = data.draw(st.sampled_from([0, 100, 200, 300, 450, 600]), label="kv room")
            state = NodeState(node, self.now, self.phase[node].value, launched=launched,
                              kv_room=room, l1_capacity=data.draw(st.integers(0, 5000)))
            self.router.on_state(state)
            self.reports[node] = state

    # -- cordons and switches ------------------------------------------------------------

    def _out(self) -> int:
        """Nodes out of routing: at most two at a time, so most steps see a serving cluster
        (and some see a phase with no node left)."""
        return sum(not self._routable(n) for n in NAMES)

    @precondition(lambda self: self._out() < 2 or any(self.cordoned.values()))
    @rule(data=st.data())
    def cordon(self, data: st.DataObject) -> None:
        """An operator takes a node out of routing, its unstarted queued requests withdrawn
        (``Switching.cordon``), or puts a cordoned one back."""
        back = [n for n in NAMES if self.cordoned[n]]
        if back and (self._out() >= 2 or data.draw(st.booleans(), label="uncordon")):
            node = data.draw(st.sampled_from(back), label="node")
            assert self.router.cordon(node, False) == []
            self.cordoned[node] = False
            return
        node = data.draw(st.sampled_from(NAMES), label="node")
        want = [q for q in self.queued[node] if q not in self.prefilling[node]]
        got = self.router.cordon(node, True)
        assert got == want, (got, want)
        self.cordoned[node] = True
        self._withdraw_orders(node, got, data)

    @precondition(lambda self: self._out() < 2 and not self.router.switching())
    @rule(data=st.data())
    def new_split(self, data: st.DataObject) -> None:
        """An operator's (or the planner's) split, applied as ``Switching._apply`` does:
        each node of the other phase, or still switching, begins a switch to its phase
        (its unstarted queued requests withdrawn); then the drains are checked. As
        ``Switching.force_split``, only while no drain is under way (a node told to switch
        may be, and may be sent back)."""
        prefill = data.draw(st.sets(st.sampled_from(NAMES), min_size=1, max_size=len(NAMES) - 1),
                            label="prefill nodes")
        orders = []
        for node in NODES:
            phase = Phase.PREFILL if node in prefill else Phase.DECODE
            if self.phase[node] is phase and self.draining[node] is None:
                continue
            want = [q for q in self.queued[node] if q not in self.prefilling[node]]
            got = self.router.begin_switch(node, phase)
            assert got == want, (got, want)
            self.draining[node], self.told[node] = phase, False
            orders.append((node, got))
        self._check_drains()
        for node, got in orders:
            self._withdraw_orders(node, got, data)

    def _withdraw_orders(self, node: str, requests: list[str], data: st.DataObject) -> None:
        """The service sends ``node`` a withdraw order for each request: the engine gives
        most back at once (``Withdrawn``); the others may start first, or come back later."""
        self.pending |= {(q, node) for q in requests}
        for rid in requests:
            if data.draw(st.booleans(), label=f"{rid} withdrawn now") and \
                    (rid, node) in self._withdrawable():
                self._withdraw(rid, node)

    def _withdrawable(self) -> list[tuple[str, str]]:
        return sorted((rid, n) for rid, n in self.pending
                      if rid in self.reqs and self.reqs[rid].prefill == n
                      and not self.reqs[rid].started)

    @precondition(lambda self: self._withdrawable())
    @rule(data=st.data())
    def withdrawn(self, data: st.DataObject) -> None:
        """The engine gave a request back (``Withdrawn``): it is routed again."""
        self._withdraw(*data.draw(st.sampled_from(self._withdrawable()), label="withdrawal"))

    def _withdraw(self, rid: str, node: str) -> None:
        self.pending.discard((rid, node))
        f = self.reqs[rid]
        got = self.router.withdrawn(rid, node, self.now)
        self.queued[node].pop(rid, None)
        self._unbind(f)
        self._check_route(f, got, known=True)
        self._check_drains()

    def _check_drains(self) -> None:
        """``Switching.check_drains``, which the service runs after every event that may
        end a drain: the drained nodes' engines are told to switch, each once."""
        want = [(n, self.draining[n]) for n in NODES
                if self.draining[n] is not None and not self.told[n]
                and self._drained(n, self.relaunch)]
        got = self.router.take_drained(self.relaunch)
        assert got == want, (got, want)
        for n, phase in got:
            self.told[n], self.engine_to[n] = True, phase

    @precondition(lambda self: any(self.engine_to[n] and self.healthy[n] for n in NAMES))
    @rule(data=st.data())
    def switched(self, data: st.DataObject) -> None:
        """An engine told to switch did (``PhaseSwitched``): it serves the phase it was
        told, even if a later split sent the node back meanwhile."""
        node = data.draw(st.sampled_from([n for n in NAMES
                                          if self.engine_to[n] and self.healthy[n]]),
                         label="node")
        phase, self.engine_to[node] = self.engine_to[node], None
        self.router.switched(node, phase)
        self.phase[node], self.draining[node], self.told[node] = phase, None, False

    @precondition(lambda self: self._out() < 2 or not all(self.healthy.values()))
    @rule(data=st.data())
    def crash_or_restart(self, data: st.DataObject) -> None:
        """An engine dies, or a dead one is restarted.

        Dead: the router stops routing to it and names what was on it; the service settles
        every request with an order there (``Lifecycle._on_node_down``): routed again if
        its prefill had not started there, ended otherwise. Restarted: ``NodeUp``, then
        ``PhaseSwitched`` to the phase it had (a switch under way died with it)."""
        down = [n for n in NAMES if not self.healthy[n]]
        if down and (self._out() >= 2 or data.draw(st.booleans(), label="restart")):
            node = data.draw(st.sampled_from(down), label="node")
            self.router.node_up(node)
            self.router.switched(node, self.phase[node])
            self.healthy[node] = True
            self.draining[node], self.told[node], self.engine_to[node] = None, False, None
            return
        node = data.draw(st.sampled_from([n for n in NAMES if self.healthy[n]]), label="node")
        want = sorted(set(self.queued[node]) | self.decoding[node] | self.prefilling[node])
        assert self.router.node_down(node) == want
        self.healthy[node] = False
        self.told[node] = self.draining[node] is not None
        self.engine_to[node] = None  # a switch under way dies with the engine
        for f in [f for f in self.reqs.values() if node in (f.prefill, f.decode)]:
            if f.id not in self.reqs:
                continue
            if f.prefill == node and not f.started:
                got = self.router.failed(f.id, node, False, self.now)
                self.queued[node].pop(f.id, None)
                self.pending.discard((f.id, node))
                self._unbind(f)
                self._check_route(f, got, known=True)
            else:
                self._end(f)

    # -- the comparison ------------------------------------------------------------------

    @invariant()
    def agree(self) -> None:
        STEPS["n"] += 1
        r = self.router
        assert sorted(r.requests()) == sorted(self.reqs)
        assert r.in_flight() == len(self.reqs)
        for n in NAMES:
            assert set(self.prefilling[n]) <= set(self.queued[n]), "model: prefilling unqueued"
            assert self.unadmitted[n] <= self.decoding[n], "model: unadmitted unbound"
            drain = self.draining[n]
            assert r.node_view(n) | {"model": None} == {
                "phase": self.phase[n].value,
                "draining_to": drain.value if drain else None,
                "healthy": self.healthy[n],
                "cordoned": self.cordoned[n],
                "queued": len(self.queued[n]),
                "queued_uncached_tokens": sum(self.queued[n].values()),
                "prefilling": len(self.prefilling[n]),
                "decoding": len(self.decoding[n]),
                "model": None,
            }, n
            assert r.routable(n) == self._routable(n), n
            assert r.phase(n) is self.phase[n] and r.draining(n) is drain, n
            assert r.state(n) == self.reports.get(n), n
            for handoffs in (False, True):
                assert r.drained(n, handoffs) == self._drained(n, handoffs), (n, handoffs)
        assert r.switching() == {n: self.draining[n] for n in NAMES
                                 if self.draining[n] is not None and not self.told[n]}
        assert r.split() == ([n for n in NAMES if self.phase[n] is Phase.PREFILL],
                             [n for n in NAMES if self.phase[n] is Phase.DECODE])
        for load in r.loads(self.now):
            n = load.node
            assert load.phase == self.phase[n].value
            assert load.queued_tokens == sum(self.queued[n].values()), n
            assert load.decode_tokens == sum(self.reqs[q].need for q in self.decoding[n]), n
            s = self.reports.get(n)
            assert load.kv_capacity == (s.l1_capacity if s is not None else None), n
            assert load.serving == (self.healthy[n] and not self.cordoned[n]), n
            assert math.isfinite(load.wait_s) and load.wait_s >= 0.0, n
        assert sorted(load.node for load in r.loads(self.now)) == NAMES
        # A record the router books into (``Routing``) says where each request is.
        for rid, f in self.reqs.items():
            rec = self.inputs[rid]
            if not hasattr(rec, "admitted"):
                continue
            got = (rec.prefill, rec.decode, rec.started, rec.done, rec.admitted, rec.need,
                   rec.t_in)
            assert got == (f.prefill, f.decode, f.started, f.done, f.admitted, f.need,
                           f.t_in), (rid, got)
        r.check_invariants()  # last: the model's own comparisons speak first


# Hypothesis draws the enabled rules evenly: new requests, the later steps of a request's
# walk and a withdrawal (when one is due) come up two or three times as often as the rest,
# so queues build up and requests get through between faults and switches.
for _name, _weight in (("route", 3), ("prefill_done", 2),
                       ("withdrawn", 3)):
    for _i in range(2, _weight + 1):
        setattr(RouterMachine, f"{_name}_{_i}", getattr(RouterMachine, _name))


def test_router_agrees_with_its_model() -> None:
    # Half the profile's examples (each step drives the router and reads all of it back):
    # ~5,000 steps in the ci profile.
    STEPS["n"] = 0
    run_state_machine_as_test(RouterMachine, settings=settings(
        max_examples=max(1, settings.default.max_examples // 2)))
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0) // 4, f"only {STEPS['n']} steps ran"


# -- the machine must be able to fail: realistic bookkeeping bugs --------------------------


class ForgetsWithdrawals(Router):
    """Routes a withdrawn request again but leaves it in the draining node's queue (and a
    decode node bound at submit keeps it): the drain never ends, ``Q_n`` overstates."""

    def withdrawn(self, request, node, now):  # type: ignore[override]
        return self.reroute(request, now) if request in self.requests() else None


class ForgetsHandoffs(Router):
    """Does not note that the decode node has yet to read the KV a prefill left: a prefill
    node that switches by relaunching (and drops its KV) is told to go before the decode
    side read it."""

    def prefill_done(self, request, node):  # type: ignore[override]
        super().prefill_done(request, node)
        self._nodes[node].handoff.discard(request)


class AdmittedKeepsRoom(Router):
    """Keeps an admitted request's KV reservation on its decode node until it ends (its
    room is counted twice, once in the node's report and once here): bindings skew. The
    router's own ``check_invariants`` cannot see it."""

    def decode_admitted(self, request, node):  # type: ignore[override]
        kept = self._nodes[node].unadmitted.get(request)
        super().decode_admitted(request, node)
        if kept is not None:
            self._nodes[node].unadmitted[request] = kept


def _fails_with(router_cls: type[Router]) -> None:
    from hypothesis import Phase as HPhase

    machine = type(f"{router_cls.__name__}Machine", (RouterMachine,), {"router_cls": router_cls})
    # No shrinking: the point is that the machine finds a failure, not the smallest one.
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine, settings=settings(max_examples=2000, stateful_step_count=60,
                                       phases=[HPhase.generate], print_blob=False))


@pytest.mark.parametrize("router_cls", [ForgetsWithdrawals, ForgetsHandoffs, AdmittedKeepsRoom],
                         ids=lambda c: c.__name__)
def test_the_machine_catches_a_router_that(router_cls: type[Router]) -> None:
    _fails_with(router_cls)
