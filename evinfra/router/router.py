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

A request walks: :meth:`route` (E.1 step, directory lookup, Eq. 7 per node, choose ``n*``,
place the branch) → :meth:`prefill_started` (bind decode, place the branch) →
:meth:`prefill_done` (``n*`` holds the version: settle) → :meth:`decode_admitted` (settle
on the decode node) → :meth:`finished`. A switch walks :meth:`begin_switch` (stop routing
the old phase, withdraw queued requests) → :meth:`withdrawn` (route again) → :meth:`drained`
→ :meth:`switched`.
"""

from __future__ import annotations

from typing import Iterable

import msgspec
import numpy as np
import structlog

from evinfra.core.events import NodeState
from evinfra.core.hashing import HashedPath
from evinfra.core.types import BranchId, NodeId, NonNegFloat, Phase, PosFloat, RequestId
from evinfra.directory import Directory, PrefixMatch
from evinfra.drivers.base import FetchRun
from evinfra.planner.itermodel import NodeModel
from evinfra.router.ttft import PrefillQueue, Prediction, TTFTConfig, estimate, predict

__all__ = ["DecodeBinding", "Refusal", "Route", "RouteRequest", "Router", "RouterConfig"]

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


class RouteRequest(msgspec.Struct, frozen=True, gc=False):
    request: RequestId
    branch: BranchId
    tokens: object
    """uint32 numpy array of the input."""
    max_tokens: int
    parent: BranchId | None = None


class Route(msgspec.Struct, frozen=True, gc=False):
    """Send the prefill to ``node``; it pulls ``fetch`` from peers while queued."""

    request: RequestId
    node: NodeId
    path: HashedPath
    fetch: list[FetchRun]
    prediction: Prediction
    candidates: int


class DecodeBinding(msgspec.Struct, frozen=True, gc=False):
    request: RequestId
    node: NodeId
    source: NodeId


class Refusal(msgspec.Struct, frozen=True, gc=False):
    """No node of ``phase`` can take the request (HTTP 503 at the API)."""

    request: RequestId
    phase: str
    reason: str


class _Req:
    __slots__ = ("id", "branch", "path", "t_in", "need", "prefill", "decode", "started", "done",
                 "admitted")

    def __init__(self, rid: RequestId, branch: BranchId, path: HashedPath, t_in: int,
                 need: int) -> None:
        self.id = rid
        self.branch = branch
        self.path = path
        self.t_in = t_in
        self.need = need
        self.prefill: NodeId | None = None
        self.decode: NodeId | None = None
        self.started = False
        self.done = False
        self.admitted = False


class _Node:
    __slots__ = ("name", "idx", "phase", "draining", "healthy", "queue", "state", "t_rem_at",
                 "decoding", "unadmitted", "running_prefill", "last_chosen")

    def __init__(self, name: NodeId, idx: int, phase: Phase) -> None:
        self.name = name
        self.idx = idx
        self.phase = phase
        self.draining: Phase | None = None  # the phase the node is switching to
        self.healthy = True
        self.queue = PrefillQueue()
        self.state: NodeState | None = None
        self.t_rem_at = 0.0  # when the last launched prefill iteration is predicted to end
        self.decoding: set[RequestId] = set()
        self.unadmitted: dict[RequestId, int] = {}
        self.running_prefill: set[RequestId] = set()
        self.last_chosen = 0  # the router's route count when it last chose this node


class Router:
    def __init__(self, directory: Directory, config: RouterConfig = RouterConfig()) -> None:
        self.directory = directory
        self.config = config
        self._nodes: dict[NodeId, _Node] = {
            n: _Node(n, directory.index(n), directory.phase(n)) for n in directory.nodes}
        self._reqs: dict[RequestId, _Req] = {}
        self._models: dict[NodeId, NodeModel] = {}
        p = config.prior
        self._prior = (p.c0, p.c1, p.c2, p.c3)
        self._coef: dict[NodeId, tuple[float, float, float, float]] = {}
        self._routed = 0

    # -- models and node state ------------------------------------------------------------

    def set_models(self, models: Iterable[NodeModel]) -> None:
        """Use the fitted Eq. 1 coefficients (frozen after warm-up); others keep the prior."""
        for m in models:
            if m.node in self._nodes and m.prefill_ok:
                self._models[m.node] = m
                self._coef[m.node] = (m.c0, m.c1, m.c2, m.c3)

    def coefficients(self, node: NodeId) -> tuple[float, float, float, float]:
        return self._coef.get(node, self._prior)

    def on_state(self, state: NodeState) -> None:
        """A node's report at an iteration launch: launched chunks leave ``Q_n``, and the
        iteration's predicted end is ``T_rem``'s anchor."""
        n = self._nodes.get(state.node)
        if n is None:
            return
        n.state = state
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

    def _prefill_nodes(self) -> list[_Node]:
        return [n for n in self._nodes.values()
                if n.healthy and n.draining is None
                and n.phase in (Phase.PREFILL, Phase.COLLOCATED)]

    def route(self, req: RouteRequest, now: float) -> Route | Refusal:
        """Choose ``n* = argmin T̂_n``, ties to the longest prefix in the node's own memory;
        append the request to ``Q_{n*}``; place its branch on ``n*`` (Alg. E.2)."""
        r = self._reqs.get(req.request)
        if r is None:
            step = self.directory.step(req.branch, req.tokens, req.parent)
            t_in = int(np.asarray(req.tokens).size)
            need = int((t_in + req.max_tokens) * self.config.decode_reserve_tokens)
            r = _Req(req.request, req.branch, step.path, t_in, need)
        nodes = self._prefill_nodes()
        if not nodes:
            log.warning("route_refused", request=req.request, phase="prefill",
                        reason="no healthy prefill node")
            return Refusal(req.request, "prefill", "no healthy prefill node outside a switch")
        self._reqs[r.id] = r
        match = self.directory.match(r.path.hashes)
        best = self._choose(r, nodes, match, now)
        n = self._nodes[best.node]
        self._routed += 1
        n.last_chosen = self._routed
        n.queue.add(r.id, best.t_uc, best.t_c, best.t_rst)
        r.prefill = n.name
        r.started = r.done = False
        self.directory.place(r.branch, n.name)
        return Route(r.id, n.name, r.path, self._fetch_plan(r, n, best, match), best, len(nodes))

    def _choose(self, r: _Req, nodes: list[_Node], match: PrefixMatch, now: float) -> Prediction:
        page = self.directory.page_size
        cap = r.t_in - 1  # at least one input token is computed
        union = min(match.union * page, cap)
        cfg = self.config.ttft
        best_key: tuple[float, int, int, str] | None = None
        best_args: tuple = ()
        for n in nodes:
            own = min(match.own[n.idx] * page, cap)
            x = union - own
            if x < cfg.fetch_min_tokens:
                x, t_c = 0, own  # below the fetch threshold the tokens are recomputed
            else:
                t_c = union
            t_rst = own - min(match.own_l1[n.idx] * page, own) + x
            t_rem = self._t_rem(n, now)
            t_hat, _ = estimate(n.queue, self.coefficients(n.name), t_rem, r.t_in - t_c, t_c,
                                t_rst, x, cfg)
            # Smaller T̂; a tie goes to the longer own prefix (E.3 line 11), then to the node
            # that was chosen least recently, so idle nodes share the work (and every node
            # sees the warm-up traffic its fit needs).
            key = (round(t_hat, 9), -own, n.last_chosen, n.name)
            if best_key is None or key < best_key:
                best_key = key
                best_args = (n, t_rem, r.t_in - t_c, t_c, t_rst, x, own)
        n, t_rem, t_uc, t_c, t_rst, x, own = best_args
        return predict(n.name, n.queue, self.coefficients(n.name), t_rem, t_uc, t_c, t_rst, x,
                       own, cfg)

    def _fetch_plan(self, r: _Req, n: _Node, p: Prediction, match: PrefixMatch
                    ) -> list[FetchRun]:
        """Blocks ``own..t_c`` of the path, in runs from one peer each.

        Greedy: the peer whose own prefix reaches furthest serves the run up to there (its
        prefix is contiguous, so no per-block check); a block past every peer's prefix (a
        hole in the holders' chains) is served block by block from whoever holds it."""
        if not p.x:
            return []
        page = self.directory.page_size
        hashes = r.path.hashes
        tree = self.directory.tree
        own = match.own
        peers = [i for i in range(len(own)) if i != n.idx]
        runs: list[FetchRun] = []
        pos, end = p.own // page, p.t_c // page
        while pos < end:
            best = max(peers, key=lambda i: (own[i], -i))
            if own[best] > pos:
                stop = min(own[best], end)
            else:
                best = next(i for i in tree.holders(hashes[pos]) if i != n.idx)
                stop = pos + 1
                while stop < end and best in tree.holders(hashes[stop]):
                    stop += 1
            runs.append(FetchRun(tree.node_name(best), pos, hashes[pos:stop]))
            pos = stop
        return runs

    # -- E.3 line 13: bind decode when the prefill starts ---------------------------------

    def prefill_started(self, request: RequestId, node: NodeId, now: float
                        ) -> DecodeBinding | Refusal | None:
        """Bind the request to the decode node with KV room and the fewest requests, and
        place its branch there. None for an unknown or already bound request."""
        r = self._reqs.get(request)
        if r is None or r.started:
            return None
        r.started = True
        src = self._nodes[node]
        src.running_prefill.add(request)
        if src.phase is Phase.COLLOCATED:
            dst = src
        else:
            dst = self._decode_node(r, now)
            if dst is None:
                log.warning("bind_refused", request=request, phase="decode",
                            reason="no healthy decode node")
                return Refusal(request, "decode", "no healthy decode node outside a switch")
        r.decode = dst.name
        dst.decoding.add(request)
        dst.unadmitted[request] = r.need
        self.directory.place(r.branch, dst.name)
        return DecodeBinding(request, dst.name, node)

    def _room(self, n: _Node, now: float) -> int | None:
        s = n.state
        if s is None or now - s.time > self.config.ttft.state_max_age_s:
            return None
        return s.kv_room - sum(n.unadmitted.values())

    def _decode_node(self, r: _Req, now: float) -> _Node | None:
        nodes = [n for n in self._nodes.values()
                 if n.healthy and n.draining is None and n.phase is Phase.DECODE]
        if not nodes:
            return None
        rooms = {n.name: self._room(n, now) for n in nodes}
        # A node without a fresh report may have room: it is not excluded, only ranked last
        # among the nodes that do.
        fits = [n for n in nodes if rooms[n.name] is None or rooms[n.name] >= r.need]
        if fits:
            return min(fits, key=lambda n: (rooms[n.name] is None, len(n.decoding), n.name))
        n = max(nodes, key=lambda n: (rooms[n.name], -len(n.decoding), n.name))
        log.info("decode_overcommitted", request=r.id, node=n.name, need=r.need,
                 room=rooms[n.name])
        return n

    # -- progress ------------------------------------------------------------------------

    def prefill_done(self, request: RequestId, node: NodeId) -> None:
        """``node`` holds the request's KV, hence the branch's current version: a same-phase
        copy elsewhere is released (E.2 line 11)."""
        r = self._reqs.get(request)
        n = self._nodes.get(node)
        if n is not None:
            n.queue.remove(request)
            n.running_prefill.discard(request)
        if r is not None and not r.done:
            r.done = True
            self.directory.settle(r.branch, node)

    def decode_admitted(self, request: RequestId, node: NodeId) -> None:
        r = self._reqs.get(request)
        n = self._nodes.get(node)
        if n is not None:
            n.unadmitted.pop(request, None)
        if r is not None and not r.admitted:
            r.admitted = True
            self.directory.settle(r.branch, node)

    def finished(self, request: RequestId) -> BranchId | None:
        """The request is over (done, failed for good, or aborted): forget it. Returns its
        branch."""
        r = self._reqs.pop(request, None)
        if r is None:
            return None
        for node in (r.prefill, r.decode):
            n = self._nodes.get(node) if node is not None else None
            if n is not None:
                n.queue.remove(request)
                n.running_prefill.discard(request)
                n.decoding.discard(request)
                n.unadmitted.pop(request, None)
        return r.branch

    def failed(self, request: RequestId, node: NodeId, started: bool, now: float
               ) -> Route | Refusal | None:
        """A request failed on ``node``. Before its prefill started it is routed again (to
        a node other than a failed one); afterwards the caller fails it (None)."""
        r = self._reqs.get(request)
        if r is None:
            return None
        n = self._nodes.get(node)
        if n is not None:
            n.queue.remove(request)
            n.running_prefill.discard(request)
        if started or r.started:
            return None
        return self.route(RouteRequest(request, r.branch, None, 0), now)

    def node_down(self, node: NodeId) -> list[RequestId]:
        """The node is gone: stop routing to it, drop its blocks and counts. Returns the
        requests that were on it (the engine's ``RequestFailed`` events say what to do)."""
        n = self._nodes[node]
        n.healthy = False
        self.directory.node_lost(node)
        return sorted(set(n.queue.requests()) | n.decoding | n.running_prefill)

    def node_up(self, node: NodeId) -> None:
        self._nodes[node].healthy = True

    # -- phase switches (paper 4.2) --------------------------------------------------------

    def begin_switch(self, node: NodeId, phase: Phase) -> list[RequestId]:
        """Stop routing ``node``'s old phase; return its queued requests whose prefill has not
        started, for the caller to withdraw (they are routed again on ``withdrawn``).

        A node leaving the collocated warm-up serves both phases already, so it takes its
        new phase at once and nothing is withdrawn."""
        n = self._nodes[node]
        if n.phase is Phase.COLLOCATED:
            n.phase = phase
            return []
        n.draining = phase
        return [q for q in n.queue.requests() if q not in n.running_prefill]

    def withdrawn(self, request: RequestId, node: NodeId, now: float) -> Route | Refusal | None:
        """A queued request came back from a draining node: route it again, re-predicting
        TTFT on the remaining nodes (the branch's path is not stepped again)."""
        r = self._reqs.get(request)
        n = self._nodes.get(node)
        if n is not None:
            n.queue.remove(request)
        if r is None:
            return None
        return self.route(RouteRequest(request, r.branch, None, 0), now)

    def drained(self, node: NodeId) -> bool:
        """No work of the old phase is left on a draining node."""
        n = self._nodes[node]
        if n.draining is None:
            return False
        if n.phase is Phase.PREFILL:
            return not len(n.queue) and not n.running_prefill
        return not n.decoding

    def switched(self, node: NodeId, phase: Phase) -> None:
        """The engine serves ``phase`` now; the directory applies E.2 lines 14-15."""
        n = self._nodes[node]
        n.phase = phase
        n.draining = None
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
            "queued": len(n.queue),
            "queued_uncached_tokens": n.queue.U,
            "prefilling": len(n.running_prefill),
            "decoding": len(n.decoding),
            "model": "fitted" if node in self._models else "prior",
        }

    def in_flight(self) -> int:
        return len(self._reqs)
