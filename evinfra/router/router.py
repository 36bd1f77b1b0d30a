"""Prefill routing, decode binding and the phase-switch drain (paper 5.3, 4.2; E.3 3-14).

:class:`Router` is a pure, synchronous core: it decides and keeps its books; the service
carries its decisions out (submits orders, withdraws requests, switches engines) and feeds
it the engines' events. Its books are the source of truth for what the router sent where:

* ``Q_n`` per prefill node (:class:`~evinfra.router.ttft.PrefillQueue`): requests sent to
  ``n`` whose prefill has not finished, including those ``n`` has not reported yet;
* per decode node, the requests bound to it and not finished, and those whose KV has not
  arrived yet (they use KV room the node's last report does not show);
* per node, its phase as the router routes it, whether it is draining for a switch, and its
  last reported state (used only while at most ``state_max_age_s`` old).

What it chooses it asks its strategies (``strategy.py``): the prefill node (evinfra's Eq. 7
argmin, or a baseline's rule) and the decode node and when to bind it. ``pool`` tells it
whether the engines read peers' host memory; without the pool no fetch is planned.

A request walks: :meth:`route` (E.1 step, directory lookup, the strategy chooses ``n*``,
place the branch; a decode strategy that binds at submit binds here) →
:meth:`prefill_started` (bind decode, place the branch) →
:meth:`prefill_done` (``n*`` holds the version: settle) → :meth:`decode_admitted` (settle
on the decode node) → :meth:`finished`; one whose prefill had not started may go back to
routing (:meth:`withdrawn`, :meth:`failed`, or :meth:`reroute` once a strategy releases it).
A switch walks :meth:`begin_switch` (stop routing the old phase, withdraw queued requests) →
:meth:`withdrawn` (route again) → :meth:`take_drained` (the engine may switch now) →
:meth:`switched`. The router is the one writer of a node's phase.
"""

from __future__ import annotations

import math
from operator import add, attrgetter
from typing import Iterable, NamedTuple

import msgspec
import numpy as np
import structlog

from evinfra.core.contracts import FetchRun, NodeLoad
from evinfra.core.events import NodeState
from evinfra.core.hashing import HashedPath
from evinfra.core.types import BranchId, NodeId, NonNegFloat, Phase, PosFloat, RequestId
from evinfra.directory import Directory, PrefixMatch
from evinfra.planner.itermodel import NodeModel
from evinfra.router.strategy import (DecodeOption, DecodeStrategy, FewestRequests, Hold,
                                     PrefillStrategy, TTFTStrategy)
from evinfra.router.ttft import FetchTime, PrefillQueue, Prediction, TTFTConfig, estimate, predict

__all__ = ["DecodeBinding", "Held", "Refusal", "Route", "Routing", "Router",
           "RouterConfig"]

log = structlog.get_logger(__name__)


class PriorModel(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Eq. 1 coefficients used until the warm-up fit exists (E.3 line 1). Deliberately rough:
    they only have to rank nodes by queued work; the fitted model replaces them."""

    c0: NonNegFloat = 0.02
    c1: NonNegFloat = 5e-5
    c2: NonNegFloat = 1e-10
    c3: NonNegFloat = 0.0


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    ttft: TTFTConfig = TTFTConfig()
    prior: PriorModel = PriorModel()
    decode_reserve_tokens: PosFloat = 1.0
    """KV room a decode binding needs, as a multiple of the request's input plus max_tokens."""


class DecodeBinding(msgspec.Struct, frozen=True, gc=False):
    request: RequestId
    node: NodeId
    source: NodeId


class Route(msgspec.Struct, frozen=True, gc=False):
    """Send the prefill to ``node``; it pulls ``fetch`` from peers while queued. ``decode`` is
    the decode node bound at once (a decode strategy that binds at submit), else None."""

    request: RequestId
    node: NodeId
    path: HashedPath
    fetch: list[FetchRun]
    prediction: Prediction
    candidates: int
    decode: DecodeBinding | None = None


class Held(msgspec.Struct, frozen=True, gc=False):
    """The prefill strategy parked the request; :meth:`Router.take_released` names it when
    it may be routed again."""

    request: RequestId
    reason: str


class Refusal(msgspec.Struct, frozen=True, gc=False):
    """No node of ``phase`` can take the request (HTTP 503 at the API)."""

    request: RequestId
    phase: str
    reason: str


class _Row(NamedTuple):
    """A node's Eq. 7 inputs that no request changes (``Router._row``). The first eleven
    fields are what each route's arithmetic unpacks, in this order."""

    U: int
    """Queued uncached tokens of ``Q_n``."""
    SA: int
    """``ΣA`` of ``Q_n`` (query-key pairs, Eq. 1)."""
    SR: int
    """``Σt_rst`` of ``Q_n``."""
    c0: float
    c1: float
    c2: float
    c3: float
    w0: float
    """The four terms of ``Ŵ_n`` after ``T_rem``: Eq. 1 over the ``⌊U/B⌋`` iterations that
    hold only earlier tokens."""
    w1: float
    w2: float
    w3: float
    t_rem_at: float
    """When the last launched iteration is predicted to end (``T_rem``'s anchor)."""
    reported: float
    """The time of the node's last report (-inf: none)."""
    floor: float
    """The queue's own iteration time, so ``T̂_n >= T_rem + floor`` for any request (-inf
    when a coefficient is negative)."""


_FLOOR = attrgetter("floor")


class Estimate(NamedTuple):
    """E.3 lines 6-9 on one node for one request (:meth:`Router._estimates`)."""

    t_hat: float
    """``T̂_n``, Eq. 7."""
    own: int
    """Tokens of the request's leading prefix the node holds itself."""
    w_hat: float
    """``Ŵ_n``: the predicted wait before the request starts."""
    t_uc: int
    t_c: int
    t_rst: int
    x: int
    """Tokens to fetch from peers' host memory."""


class Routing:
    """A request as the router routes it, and what the router booked of it.

    The caller creates it (the control plane's ledger record extends it) and the router
    keeps it while the request is in flight: the fields from ``path`` on are the router's to
    write, everyone else reads them."""

    __slots__ = ("id", "branch", "tokens", "max_tokens", "parent", "final", "reuse", "path",
                 "t_in", "need", "prefill", "decode", "started", "done", "admitted", "l1")

    def __init__(self, request: RequestId, branch: BranchId, tokens: np.ndarray,
                 max_tokens: int, parent: BranchId | None = None, final: bool = False,
                 reuse: bool = True) -> None:
        self.id = request
        self.branch = branch
        self.tokens = tokens
        """uint32 numpy array of the input."""
        self.max_tokens = max_tokens
        self.parent = parent
        self.final = final
        """The branch ends with this request (its harness said so, at submit or while the
        request ran)."""
        self.reuse = reuse
        """False: the engine recomputes the whole prompt (its log-probabilities are asked
        for), so no cached prefix counts anywhere and nothing is fetched."""
        self.path: HashedPath | None = None
        """The input's full pages, as E.1 stepped the branch when it was first routed."""
        self.t_in = 0
        self.need = 0
        """KV room its decode takes: input plus ``max_tokens``, times the reserve."""
        self.prefill: NodeId | None = None
        """The node its prefill was sent to (None: held, or not routed yet)."""
        self.decode: NodeId | None = None
        """The node bound to decode it (None: not bound yet)."""
        self.started = False
        self.done = False
        """Its prefill is over."""
        self.admitted = False
        """The decode node took it (its first token is out)."""
        self.l1: list[int] = []
        """Leading path blocks each node (by index) held in GPU memory when it was last
        routed: the decode binding's tie-break."""


_NONE_LEFT = "no {} node to route to: each is down, cordoned or switching"


class _Node:
    __slots__ = ("name", "idx", "phase", "draining", "told", "healthy", "cordoned", "queue",
                 "state",
                 "t_rem_at", "decoding", "unadmitted", "running_prefill", "handoff",
                 "last_chosen", "version", "row", "row_q", "row_v")

    def __init__(self, name: NodeId, idx: int, phase: Phase) -> None:
        self.name = name
        self.idx = idx
        self.phase = phase
        self.draining: Phase | None = None  # the phase the node is switching to
        self.told = False  # its engine was told to switch (it had drained)
        self.healthy = True
        self.cordoned = False  # an operator took it out of routing (maintenance)
        self.queue = PrefillQueue()
        self.state: NodeState | None = None
        self.t_rem_at = 0.0  # when the last launched prefill iteration is predicted to end
        self.decoding: set[RequestId] = set()
        self.unadmitted: dict[RequestId, int] = {}
        self.running_prefill: set[RequestId] = set()
        # Prefilled here, bound to decode elsewhere, not admitted there yet: the decode node
        # still has to read the KV from this node.
        self.handoff: set[RequestId] = set()
        self.last_chosen = 0  # the router's route count when it last chose this node
        # The node's Eq. 7 inputs that change only with its queue, state or coefficients
        # (``Router._row``), built from queue version ``row_q`` and node version ``row_v``;
        # ``version`` moves with the state and the coefficients.
        self.version = 0
        self.row: _Row | None = None
        self.row_q = self.row_v = -1


class _View:
    """A :class:`~evinfra.router.strategy.RouteView` of one request; predictions are
    computed once per node and kept, so a strategy may ask freely."""

    __slots__ = ("_router", "_r", "_nodes", "request", "branch", "parent", "path", "t_in",
                 "need", "final", "nodes", "match", "now", "_pred", "_est", "_full")

    def __init__(self, router: "Router", r: Routing, nodes: list[_Node], match: PrefixMatch,
                 now: float) -> None:
        self._router = router
        self._r = r
        self.request, self.branch, self.parent, self.path = r.id, r.branch, r.parent, r.path
        self.t_in, self.need, self.final = r.t_in, r.need, r.final
        self._nodes = nodes
        self.nodes = [n.name for n in nodes]
        self.match = match
        self.now = now
        self._pred: dict[NodeId, Prediction] = {}
        # t_hats' rows, one per node of ``nodes`` (None: not computed): the chosen node's
        # Prediction reuses its.
        self._est: list[Estimate | None] | None = None
        self._full: dict[NodeId, Prediction] = {}

    def predict(self, node: NodeId) -> Prediction:
        p = self._pred.get(node)
        if p is None:
            e = None
            if self._est is not None and node in self.nodes:
                e = self._est[self.nodes.index(node)]
            if e is None:
                e = self._router._estimates(self._r, [self._router._nodes[node]], self.match,
                                            self.now)[0]
                assert e is not None
            p = self._pred[node] = Prediction(node, e.t_hat, e.w_hat, e.t_uc, e.t_c, e.t_rst, e.x,
                                              e.own)
        return p

    def t_hats(self, margin: float | None = None) -> list[tuple[float, int] | None]:
        self._est = self._router._estimates(self._r, self._nodes, self.match, self.now, margin)
        return [e[:2] if e is not None else None for e in self._est]

    def predict_full_input(self, node: NodeId) -> Prediction:
        p = self._full.get(node)
        if p is None:
            n = self._router._nodes[node]
            p = self._full[node] = predict(
                node, n.queue, self._router.coefficients(node), self._router._t_rem(n, self.now),
                self.t_in, 0, 0, 0, self.own(node) * self._router.directory.page_size,
                self._router.config.ttft, self._router.tau)
        return p

    def own(self, node: NodeId) -> int:
        return self.match.own[self._router._nodes[node].idx]

    def own_l1(self, node: NodeId) -> int:
        return self.match.own_l1[self._router._nodes[node].idx]

    def last_chosen(self, node: NodeId) -> int:
        return self._router._nodes[node].last_chosen

    def capacity(self, node: NodeId) -> int | None:
        s = self._router._nodes[node].state
        return None if s is None else s.l1_capacity + s.l2_capacity


class Router:
    """See the module docstring. ``prefill`` and ``decode`` are the choices it delegates
    (:mod:`evinfra.router.strategy`; evinfra's by default). ``pool`` says whether the
    engines read peers' host memory (the shared KV pool, paper 4.2): without it a request
    reuses only the prefix its own node holds, and no fetch is planned (private host tiers,
    as SGLang HiCache's L2, paper A.2)."""

    def __init__(self, directory: Directory, config: RouterConfig = RouterConfig(), *,
                 prefill: PrefillStrategy | None = None, decode: DecodeStrategy | None = None,
                 pool: bool = True) -> None:
        self.directory = directory
        self.config = config
        self.prefill = prefill if prefill is not None else TTFTStrategy()
        self.decode = decode if decode is not None else FewestRequests()
        self.pool = pool
        self._nodes: dict[NodeId, _Node] = {
            n: _Node(n, directory.index(n), directory.phase(n)) for n in directory.nodes}
        self._reqs: dict[RequestId, Routing] = {}
        self._models: dict[NodeId, NodeModel] = {}
        p = config.prior
        self._prior = (p.c0, p.c1, p.c2, p.c3)
        self._coef: dict[NodeId, tuple[float, float, float, float]] = {}
        self.tau = FetchTime(config.ttft)
        """τ(x) of E.3 line 9, fitted to the fetches the engines report."""
        self._routed = 0
        self._eligible: list[_Node] | None = None

    # -- models and node state ------------------------------------------------------------

    def set_models(self, models: Iterable[NodeModel]) -> None:
        """Use the fitted Eq. 1 coefficients (frozen after warm-up); others keep the prior."""
        for m in models:
            if m.node in self._nodes and m.prefill_ok:
                self._models[m.node] = m
                self._coef[m.node] = (m.c0, m.c1, m.c2, m.c3)
                self._nodes[m.node].version += 1

    def coefficients(self, node: NodeId) -> tuple[float, float, float, float]:
        return self._coef.get(node, self._prior)

    def observe_fetch(self, tokens: int, seconds: float) -> None:
        """An engine fetched ``tokens`` from peers in ``seconds`` (``PrefillDone``): τ is
        refitted, and every node's prediction uses the new τ from the next route on."""
        self.tau.observe(tokens, seconds)

    def on_state(self, state: NodeState) -> None:
        """A node's report at an iteration launch: launched chunks leave ``Q_n``, and the
        iteration's predicted end is ``T_rem``'s anchor."""
        n = self._nodes.get(state.node)
        if n is None:
            return
        n.state = state
        n.version += 1
        if state.launched:
            c0, c1, c2, c3 = self.coefficients(n.name)
            dur = c0
            for item in state.launched:
                n.queue.launched(item.request, item.t_uc)
                dur += (c1 * item.t_uc + c2 * (item.t_uc * item.t_c + item.t_uc * (item.t_uc + 1) // 2)
                        + c3 * item.t_rst)
            n.t_rem_at = state.time + dur

    def _t_rem(self, n: _Node, now: float) -> float:
        s = n.state
        if s is None or now - s.time > self.config.ttft.state_max_age_s:
            return 0.0
        return max(0.0, n.t_rem_at - now)

    # -- E.3 lines 3-12: route a prefill ---------------------------------------------------

    @staticmethod
    def _routable(n: _Node) -> bool:
        """New work may go to the node: healthy, not cordoned, outside a switch."""
        return n.healthy and not n.cordoned and n.draining is None

    def _prefill_nodes(self) -> list[_Node]:
        """Routable prefill-capable nodes (kept until a node's health, cordon, phase or drain
        changes: every route asks)."""
        if self._eligible is None:
            self._eligible = [n for n in self._nodes.values() if self._routable(n)
                              and n.phase in (Phase.PREFILL, Phase.COLLOCATED)]
        return self._eligible

    def route(self, r: Routing, now: float) -> Route | Refusal | Held:
        """Let the prefill strategy choose ``n*`` (evinfra: ``argmin T̂_n``, ties to the
        longest prefix in the node's own memory); append the request to ``Q_{n*}``; place its
        branch on ``n*`` (Alg. E.2). A decode strategy that binds at submit binds now."""
        r.path = self.directory.step(r.branch, r.tokens, r.parent).path
        r.t_in = int(np.asarray(r.tokens).size)
        r.need = int((r.t_in + r.max_tokens) * self.config.decode_reserve_tokens)
        return self._route(r, now)

    def reroute(self, request: RequestId, now: float) -> Route | Refusal | Held:
        """Route a request again whose prefill has not started (withdrawn, failed, or held):
        TTFT re-predicted on the nodes routable now; its branch's path is not stepped
        again."""
        return self._route(self._reqs[request], now)

    def _route(self, r: Routing, now: float) -> Route | Refusal | Held:
        nodes = self._prefill_nodes()
        if not nodes:
            log.warning("route_refused", request=r.id, phase="prefill",
                        reason="no routable prefill node")
            return Refusal(r.id, "prefill", _NONE_LEFT.format("prefill"))
        self._reqs[r.id] = r
        if r.reuse:
            match = self.directory.match(r.path)
        else:
            none = [0] * len(self.directory.nodes)
            match = PrefixMatch(0, none, list(none))
        r.l1 = match.own_l1
        view = _View(self, r, nodes, match, now)
        best = self.prefill.choose(view)
        if isinstance(best, Hold):
            r.prefill = None
            return Held(r.id, best.reason)
        n = self._nodes[best.node]
        binding = None
        if self.decode.at_submit and n.phase is not Phase.COLLOCATED:
            dst = self._decode_node(r, now)
            if dst is None:
                log.warning("bind_refused", request=r.id, phase="decode",
                            reason="no routable decode node")
                return Refusal(r.id, "decode", _NONE_LEFT.format("decode"))
            binding = self._bind(r, n, dst)
        self._routed += 1
        n.last_chosen = self._routed
        n.queue.add(r.id, best.t_uc, best.t_c, best.t_rst)
        r.prefill = n.name
        r.started = r.done = False
        self.directory.place(r.branch, n.name)
        self.prefill.routed(r.id, n.name, view)
        return Route(r.id, n.name, r.path, self._fetch_plan(r, n, best, match), best, len(nodes),
                     binding)

    def take_released(self, now: float) -> list[RequestId]:
        """Held requests the prefill strategy lets go now (route them again)."""
        return self.prefill.released(now)

    def _row(self, n: _Node) -> _Row:
        """``n``'s :class:`_Row`, rebuilt when its queue, state or coefficients moved.
        ``floor`` bounds ``T̂_n - T_rem`` from below because every Eq. 7 term grows with the
        request's work when no coefficient is negative."""
        q, B = n.queue, self.config.ttft.chunk_tokens
        c0, c1, c2, c3 = self._coef.get(n.name, self._prior)
        k = q.U // B
        A_k, R_k = q.first(k * B)
        floor = (c0 * -(-q.U // B) + c1 * q.U + c2 * q.SA + c3 * q.SR
                 if min(c0, c1, c2, c3) >= 0.0 else -math.inf)
        n.row = _Row(q.U, q.SA, q.SR, c0, c1, c2, c3, c0 * k, c1 * k * B, c2 * A_k, c3 * R_k,
                     n.t_rem_at, n.state.time if n.state is not None else -math.inf, floor)
        n.row_q, n.row_v = q.version, n.version
        return n.row

    def _estimates(self, r: Routing, nodes: list[_Node], match: PrefixMatch, now: float,
                   margin: float | None = None
                   ) -> list[Estimate | None]:
        """E.3 lines 6-9 on each node (an :class:`Estimate`). The cached
        prefix ``t_c`` reaches as far as some node holds it when the pool serves it (``x``
        of it fetched), else only ``n``'s own prefix (``own`` tokens). The arithmetic is
        :func:`~evinfra.router.ttft.estimate`'s, in the same order (so the same floats),
        inlined because every route runs it on every prefill node (``tests/router`` checks
        the two agree); what no request changes comes from the node's cached row.

        With ``margin``, only the nodes whose ``T̂_n`` may be within ``margin`` of the
        minimum get a row, the others None: nodes are visited by the lower bound
        ``T_rem + floor`` (see :meth:`_row`) and the visit stops at the first bound past
        the least ``T̂`` so far plus ``margin`` (and 1 ns for the rounding of two sums)."""
        page = self.directory.page_size
        t_in = r.t_in
        cap = t_in - 1
        cfg = self.config.ttft
        B, fmin, kappa = cfg.chunk_tokens, cfg.fetch_min_tokens, cfg.kappa
        fbase, fper, max_age = self.tau.base, self.tau.per_token, cfg.state_max_age_s
        pool = self.pool
        union = min(match.union * page, cap) if pool else 0
        own_all, l1_all = match.own, match.own_l1
        rows = [n.row if n.row_q == n.queue.version and n.row_v == n.version else self._row(n)
                for n in nodes]
        # T_rem, :meth:`_t_rem`'s rule from the rows: a fresh report's remaining time, never
        # negative; 0 without one.
        t_rems = [r.t_rem_at - now if now - r.reported <= max_age and r.t_rem_at > now else 0.0
                  for r in rows]
        out: list[Estimate | None] = [None] * len(nodes)
        order: Iterable[int] = range(len(nodes))
        bounds: list[float] = []
        if margin is not None:
            bounds = list(map(add, t_rems, map(_FLOOR, rows)))  # C loops
            order = sorted(order, key=bounds.__getitem__)
        lo, slack = math.inf, (margin or 0.0) + 1e-9
        for i in order:
            if bounds and bounds[i] > lo + slack + 1e-12 * abs(bounds[i]):
                break
            n = nodes[i]
            U, SA, SR, c0, c1, c2, c3, w0, w1, w2, w3 = rows[i][:11]
            t_rem = t_rems[i]
            own = own_all[n.idx] * page
            if own > cap:
                own = cap
            x = union - own if pool else 0
            if x < fmin:
                x, t_c = 0, own
            else:
                t_c = own + x
            l1 = l1_all[n.idx] * page
            t_rst = own - (l1 if l1 < own else own) + x
            t_uc = t_in - t_c
            w_hat = t_rem + w0 + w1 + w2 + w3
            Ut = U + t_uc
            A = t_uc * t_c + t_uc * (t_uc + 1) // 2
            done = t_rem + c0 * -(-Ut // B) + c1 * Ut + c2 * (SA + A) + c3 * (SR + t_rst)
            if x >= fmin and x > 0:
                gap = fbase + fper * x - w_hat
                if gap > 0.0:
                    done += gap
            t_hat = done + kappa * x
            out[i] = Estimate(t_hat, own, w_hat, t_uc, t_c, t_rst, x)
            if t_hat < lo:
                lo = t_hat
        return out

    def _fetch_plan(self, r: Routing, n: _Node, p: Prediction, match: PrefixMatch
                    ) -> list[FetchRun]:
        """Blocks ``own..t_c`` of the path, in runs from one peer each, after a run that
        backs ``n``'s own prefix.

        Greedy: a peer of ``n``'s phase on which the branch counts blocks (the node its last
        prefill ran on: the source of its move, E.2 line 11) serves the run its own prefix
        reaches, then the peer of any phase that reaches furthest (their prefixes are
        contiguous, so no per-block check); a block past every peer's prefix (a hole in the
        holders' chains) is served block by block from whoever holds it, and one only ``n``
        holds (past a hole in its own chain) is not fetched. The branch's own prefill copy
        first because a decode node keeps a count for every branch it decoded (line 12): at
        a split with few decode nodes they hold more counted KV than their host memory and
        evict some of it while the request waits, and a short read past the node's own
        prefix is recomputed (OSWorld 160 at 8P1D: 6,223 of 10,309 fetches came back short
        from the decode node, 94 % of the blocks still held by a prefill node). Only a copy
        the branch counts: another prefill node's uncounted copy is evicted first (E.2 line
        18), and preferring any same-phase copy lost reuse at 2P7D.

        The backing run names that same peer for ``n``'s own blocks: a request may wait
        long enough for ``n`` to evict them (a long queue at a node whose cache cannot hold
        its agents' contexts), and the engine pulls only the blocks it lacks when the fetch
        starts (the patched SGLang engine skips held pages too), so a copy lost while
        queued is fetched, not recomputed."""
        page = self.directory.page_size
        pos, end = p.own // page, p.t_c // page
        if not self.pool or not (p.x or pos):
            return []
        hashes = r.path.hashes
        directory = self.directory
        names = directory.nodes  # a copy per read
        # The peer whose own prefix reaches furthest (the first on ties): C loops over the
        # nodes, which a route at 64 nodes notices.
        reach = list(match.own)
        reach[n.idx] = -1
        far = reach.index(max(reach))
        near = max((i for i in directory.branch_nodes(r.branch)
                    if i != n.idx and self._nodes[names[i]].phase is n.phase),
                   key=reach.__getitem__, default=far)
        runs: list[FetchRun] = []
        if reach[far] > 0 and pos > 0:
            back = near if reach[near] >= min(reach[far], pos) else far
            runs.append(FetchRun(names[back], 0, hashes[:min(reach[back], pos)]))
        if not p.x:
            return runs
        while pos < end:
            if reach[near] > pos:
                best, stop = near, min(reach[near], end)
            elif reach[far] > pos:
                best, stop = far, min(reach[far], end)
            else:
                best = next((i for i in directory.holders(hashes[pos]) if i != n.idx), -1)
                if best < 0:
                    pos += 1
                    continue
                stop = pos + 1
                while stop < end and directory.holds(hashes[stop], best):
                    stop += 1
            runs.append(FetchRun(names[best], pos, hashes[pos:stop]))
            pos = stop
        return runs

    # -- E.3 line 13: bind decode when the prefill starts ---------------------------------

    def prefill_started(self, request: RequestId, node: NodeId, now: float
                        ) -> DecodeBinding | Refusal | None:
        """Bind the request to a decode node (the decode strategy's choice; evinfra's: KV
        room and the fewest requests) and place its branch there. None for an unknown
        request, one already started, or one bound at submit."""
        r = self._reqs.get(request)
        if r is None or r.started:
            return None
        r.started = True
        src = self._nodes[node]
        src.running_prefill.add(request)
        if r.decode is not None:
            return None
        if src.phase is Phase.COLLOCATED:
            dst = src
        else:
            dst = self._decode_node(r, now)
            if dst is None:
                log.warning("bind_refused", request=request, phase="decode",
                            reason="no routable decode node")
                return Refusal(request, "decode", _NONE_LEFT.format("decode"))
        return self._bind(r, src, dst)

    def _bind(self, r: Routing, src: _Node, dst: _Node) -> DecodeBinding:
        r.decode = dst.name
        dst.decoding.add(r.id)
        dst.unadmitted[r.id] = r.need
        self.directory.place(r.branch, dst.name)
        return DecodeBinding(r.id, dst.name, src.name)

    def _unbind(self, r: Routing) -> None:
        """A request bound at submit goes back to routing before its prefill started: its
        decode node lets it go (the caller aborts the decode order)."""
        if r.decode is not None and not r.started:
            dst = self._nodes[r.decode]
            dst.decoding.discard(r.id)
            dst.unadmitted.pop(r.id, None)
            r.decode = None

    def _room(self, n: _Node, now: float) -> int | None:
        s = n.state
        if s is None or now - s.time > self.config.ttft.state_max_age_s:
            return None
        return s.kv_room - sum(n.unadmitted.values())

    def _decode_node(self, r: Routing, now: float) -> _Node | None:
        nodes = [n for n in self._nodes.values()
                 if self._routable(n) and n.phase is Phase.DECODE]
        if not nodes:
            return None
        l1 = r.l1
        options = [DecodeOption(n.name, self._room(n, now), len(n.decoding),
                                l1[n.idx] if n.idx < len(l1) else 0) for n in nodes]
        chosen = self._nodes[self.decode.choose(r.need, options)]
        room = next(o.room for o in options if o.node == chosen.name)
        if room is not None and room < r.need:
            log.info("decode_overcommitted", request=r.id, node=chosen.name, need=r.need,
                     room=room)
        return chosen

    # -- progress ------------------------------------------------------------------------

    def prefill_done(self, request: RequestId, node: NodeId) -> None:
        """``node`` holds the request's KV, hence the branch's current version: a same-phase
        copy elsewhere is released (E.2 line 11)."""
        r = self._reqs.get(request)
        n = self._nodes.get(node)
        if n is not None:
            n.queue.remove(request)
            n.running_prefill.discard(request)
            if r is not None and r.decode not in (None, node):
                n.handoff.add(request)
        self.prefill.prefill_done(request, node)
        if r is not None and not r.done:
            r.done = True
            self.directory.settle(r.branch, node)

    def decode_admitted(self, request: RequestId, node: NodeId) -> None:
        r = self._reqs.get(request)
        n = self._nodes.get(node)
        if n is not None:
            n.unadmitted.pop(request, None)
        if r is not None and r.prefill is not None:
            self._nodes[r.prefill].handoff.discard(request)
        if r is not None and not r.admitted:
            r.admitted = True
            self.directory.settle(r.branch, node)

    def finished(self, request: RequestId, now: float = 0.0) -> BranchId | None:
        """The request is over (done, failed for good, or aborted): forget it. Returns its
        branch."""
        r = self._reqs.pop(request, None)
        if r is None:
            return None
        self.prefill.finished(request, now)
        for node in (r.prefill, r.decode):
            n = self._nodes.get(node) if node is not None else None
            if n is not None:
                n.queue.remove(request)
                n.running_prefill.discard(request)
                n.handoff.discard(request)
                n.decoding.discard(request)
                n.unadmitted.pop(request, None)
        return r.branch

    def failed(self, request: RequestId, node: NodeId, started: bool, now: float
               ) -> Route | Refusal | Held | None:
        """A request failed on ``node``. Before its prefill started it is routed again, on
        the nodes routable now (``node`` among them if it still is: a node that is down has
        left them); afterwards the caller fails it (None)."""
        r = self._reqs.get(request)
        if r is None:
            return None
        n = self._nodes.get(node)
        if n is not None:
            n.queue.remove(request)
            n.running_prefill.discard(request)
        self.prefill.prefill_done(request, node)
        if started or r.started:
            return None
        self._unbind(r)
        return self._route(r, now)

    def node_down(self, node: NodeId) -> list[RequestId]:
        """The node is gone: stop routing to it, drop its blocks and counts. Returns the
        requests that were on it (the engine's ``RequestFailed`` events say what to do)."""
        n = self._nodes[node]
        n.healthy = False
        # A switch under way dies with the engine: it comes back in the phase it had.
        n.told = n.draining is not None
        self._eligible = None
        self.directory.node_lost(node)
        return sorted(set(n.queue.requests()) | n.decoding | n.running_prefill)

    def node_up(self, node: NodeId) -> None:
        self._nodes[node].healthy = True
        self._eligible = None

    def cordon(self, node: NodeId, cordoned: bool) -> list[RequestId]:
        """Take the node out of routing, or back in. Its KV stays in the directory (peers
        still fetch it from its host memory) and what runs there finishes; returns its queued
        requests whose prefill has not started, for the caller to withdraw (they are routed
        again on ``withdrawn``)."""
        n = self._nodes[node]
        n.cordoned = cordoned
        self._eligible = None
        return self._unstarted(n) if cordoned else []

    @staticmethod
    def _unstarted(n: _Node) -> list[RequestId]:
        """The node's queued requests whose prefill has not started (it may give them up)."""
        return [q for q in n.queue.requests() if q not in n.running_prefill]

    def routable(self, node: NodeId) -> bool:
        return self._routable(self._nodes[node])

    # -- phase switches (paper 4.2) --------------------------------------------------------

    def begin_switch(self, node: NodeId, phase: Phase, *, drain: bool = True
                     ) -> list[RequestId]:
        """Stop routing ``node``'s old phase; return its queued requests whose prefill has not
        started, for the caller to withdraw (they are routed again on ``withdrawn``).
        ``drain=False``: the caller switches the engine at once, without waiting for its
        running requests (a Dynamo relaunch terminates the worker, paper A.1), so
        :meth:`take_drained` never names the node.

        A node leaving the collocated warm-up serves both phases already, so it takes its
        new phase at once and nothing is withdrawn."""
        n = self._nodes[node]
        self._eligible = None
        if n.phase is Phase.COLLOCATED:
            n.phase = phase
            self.directory.switch_phase(node, phase)
            return []
        n.draining, n.told = phase, not drain
        return self._unstarted(n)

    def withdrawn(self, request: RequestId, node: NodeId, now: float
                  ) -> Route | Refusal | Held | None:
        """A queued request came back from a draining node: route it again, re-predicting
        TTFT on the remaining nodes (the branch's path is not stepped again)."""
        r = self._reqs.get(request)
        n = self._nodes.get(node)
        if n is not None:
            n.queue.remove(request)
        if r is None:
            return None
        self.prefill.prefill_done(request, node)
        self._unbind(r)
        return self._route(r, now)

    def drained(self, node: NodeId, handoffs: bool = False) -> bool:
        """No work of the old phase is left on a draining node. With ``handoffs`` a prefill
        node also waits until the decode nodes have read every KV it produced: an engine
        that relaunches to switch (Dynamo) loses its memory, an in-place switch keeps it
        readable."""
        n = self._nodes[node]
        if n.draining is None:
            return False
        if n.phase is Phase.PREFILL:
            return not len(n.queue) and not n.running_prefill and not (handoffs and n.handoff)
        return not n.decoding

    def switching(self) -> dict[NodeId, Phase]:
        """The nodes draining for a switch whose engine has not been told yet, and the phase
        each will serve."""
        return {n.name: n.draining for n in self._nodes.values()
                if n.draining is not None and not n.told}

    def take_drained(self, handoffs: bool = False) -> list[tuple[NodeId, Phase]]:
        """The nodes of :meth:`switching` that have :meth:`drained`: their engines are to
        switch now (each is named once)."""
        out = []
        for n in self._nodes.values():
            if n.draining is not None and not n.told and self.drained(n.name, handoffs):
                n.told = True
                out.append((n.name, n.draining))
        return out

    def switched(self, node: NodeId, phase: Phase) -> None:
        """The engine serves ``phase`` now; the directory applies E.2 lines 14-15."""
        n = self._nodes[node]
        n.phase = phase
        n.draining, n.told = None, False
        self._eligible = None
        self.directory.switch_phase(node, phase)

    # -- views ---------------------------------------------------------------------------

    def phase(self, node: NodeId) -> Phase:
        return self._nodes[node].phase

    def draining(self, node: NodeId) -> Phase | None:
        return self._nodes[node].draining

    def split(self) -> tuple[list[NodeId], list[NodeId]]:
        """The prefill and decode nodes as routed now (draining nodes by their old phase)."""
        p = sorted(n for n, v in self._nodes.items() if v.phase is Phase.PREFILL)
        d = sorted(n for n, v in self._nodes.items() if v.phase is Phase.DECODE)
        return p, d

    def node_view(self, node: NodeId) -> dict[str, object]:
        n = self._nodes[node]
        return {
            "phase": n.phase.value,
            "draining_to": n.draining.value if n.draining else None,
            "healthy": n.healthy,
            "cordoned": n.cordoned,
            "queued": len(n.queue),
            "queued_uncached_tokens": n.queue.U,
            "prefilling": len(n.running_prefill),
            "decoding": len(n.decoding),
            "model": "fitted" if node in self._models else "prior",
        }

    def state(self, node: NodeId) -> NodeState | None:
        """The node's last report (None before any)."""
        return self._nodes[node].state

    def in_flight(self) -> int:
        return len(self._reqs)

    def requests(self) -> list[RequestId]:
        """The requests in the router's books (routed or held, not finished)."""
        return list(self._reqs)

    def check_invariants(self) -> None:
        """Each node's books hold only requests the router knows, where it sent them."""
        for n in self._nodes.values():
            for q in n.queue.requests():
                assert self._reqs[q].prefill == n.name, f"{q} queued on {n.name}, routed elsewhere"
            for q in n.running_prefill | n.handoff:
                assert self._reqs[q].prefill == n.name, f"{q} prefilling on {n.name}, routed elsewhere"
            for q in n.decoding:
                assert self._reqs[q].decode == n.name, f"{q} decoding on {n.name}, bound elsewhere"
            assert n.unadmitted.keys() <= n.decoding, f"{n.name}: unadmitted but not bound"
            assert n.handoff.isdisjoint(n.queue.requests()), f"{n.name}: handed off yet queued"
            assert not n.told or n.draining is not None, f"{n.name}: told to switch to nothing"

    def loads(self, now: float) -> list[NodeLoad]:
        """Every node's load as the router sees it (O(requests bound to decode))."""
        out = []
        for n in self._nodes.values():
            wait = estimate(n.queue, self.coefficients(n.name), self._t_rem(n, now), 0, 0, 0, 0,
                            self.config.ttft, self.tau)[1]
            need = sum(self._reqs[q].need for q in n.decoding if q in self._reqs)
            out.append(NodeLoad(n.name, n.phase.value, n.queue.U, wait, need,
                                n.state.l1_capacity if n.state is not None else None,
                                n.healthy and not n.cordoned))
        return out
