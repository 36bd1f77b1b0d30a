"""The router's two hook points: which prefill node takes a request, which decode node and when
(paper 5.3, E.3 lines 11 and 13).

:class:`~evinfra.router.router.Router` keeps the books (``Q_n``, bindings, drains, the
directory's branch steps) and asks a strategy only to *choose*:

* a :class:`PrefillStrategy` gets a :class:`RouteView` of one request (its path, the
  directory's prefix match, the eligible prefill nodes, the Eq. 7 prediction on any of them)
  and returns the :class:`~evinfra.router.ttft.Prediction` of the node it picks, or
  :class:`Hold` to park the request (ThunderAgent's paused programs). Evinfra's choice is
  :class:`TTFTStrategy`, the argmin of Eq. 7; the baselines' are in ``evinfra.baselines``.
  Its lifecycle hooks (``routed``, ``prefill_done``, ``finished``) let a strategy keep its own
  books (approximate prefix trees, active blocks) from the requests it routed, as the
  SGLang Model Gateway and the Dynamo router do;
* a :class:`DecodeStrategy` picks among :class:`DecodeOption`\\ s, either when the prefill
  starts (evinfra: KV room, fewest requests, then the longest prefix in GPU memory; paper
  D.1) or when the request is routed (``at_submit``: SGLang PD's round-robin decode
  routing, whose decode node reserves the KV while the request waits in the prefill queue).

Strategies are synchronous and deterministic; time comes in through the view.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import msgspec

from evinfra.core.hashing import HashedPath
from evinfra.core.types import BranchId, NodeId, RequestId
from evinfra.directory import PrefixMatch
from evinfra.router.ttft import Prediction

__all__ = ["DecodeOption", "DecodeStrategy", "FewestRequests", "Hold", "PrefillStrategy",
           "RouteView", "Stateless", "TTFTStrategy"]


class Hold(msgspec.Struct, frozen=True, gc=False):
    """Park the request: a strategy releases it later (:meth:`PrefillStrategy.released`)."""

    reason: str


class RouteView(Protocol):
    """One request as a prefill strategy sees it (built by the router for each route)."""

    request: RequestId
    branch: BranchId
    parent: BranchId | None
    """The branch it was forked or spawned from (its harness's hint; None for an agent's
    root branch, or without hints)."""
    path: HashedPath
    t_in: int
    need: int
    """Decode KV room the request needs (input plus ``max_tokens``)."""
    final: bool
    """The branch ends with this request."""
    nodes: Sequence[NodeId]
    """The eligible prefill nodes: healthy, not draining, in the router's order."""
    match: PrefixMatch
    now: float

    def predict(self, node: NodeId) -> Prediction:
        """Eq. 7 on ``node`` with the router's queue, coefficients and data plane."""

    def t_hats(self, margin: float | None = None) -> list[tuple[float, int] | None]:
        """``(T̂_n, own prefix tokens)`` of Eq. 7 for every node of ``nodes``, in order: what
        :meth:`predict` says, without building a Prediction per node. With ``margin``, only
        for the nodes whose ``T̂_n`` may be within ``margin`` of the least, None for the
        others: a lower bound on ``T̂_n`` rules those out without Eq. 7."""

    def predict_full_input(self, node: NodeId) -> Prediction:
        """Eq. 7 on ``node`` as if no token were cached (Arrow's prediction, paper A.1)."""

    def own(self, node: NodeId) -> int:
        """Leading blocks of the path ``node`` holds in any tier (the directory's view)."""

    def own_l1(self, node: NodeId) -> int:
        """Leading blocks of the path ``node`` holds in GPU memory."""

    def last_chosen(self, node: NodeId) -> int:
        """The router's route count when it last chose ``node`` (0: never)."""

    def capacity(self, node: NodeId) -> int | None:
        """GPU plus host KV capacity in tokens from the node's last report (None before)."""


class PrefillStrategy(Protocol):
    """Chooses the prefill node of each request; may keep books from the lifecycle hooks."""

    def choose(self, view: RouteView) -> Prediction | Hold: ...

    def routed(self, request: RequestId, node: NodeId, view: RouteView) -> None:
        """``request`` was sent to ``node`` (also after a re-route)."""

    def prefill_done(self, request: RequestId, node: NodeId) -> None:
        """``node`` finished (or gave back) the prefill of ``request``."""

    def finished(self, request: RequestId, now: float) -> None:
        """``request`` is over, whatever the outcome."""

    def released(self, now: float) -> list[RequestId]:
        """Requests held earlier that may be routed now."""


class Stateless:
    """The lifecycle hooks of a prefill strategy that keeps no per-request state."""

    def routed(self, request: RequestId, node: NodeId, view: RouteView) -> None:
        pass

    def prefill_done(self, request: RequestId, node: NodeId) -> None:
        pass

    def finished(self, request: RequestId, now: float) -> None:
        pass

    def released(self, now: float) -> list[RequestId]:
        return []


class TTFTStrategy(Stateless):
    """Evinfra's choice (E.3 line 11): ``n* = argmin T̂_n``, ties to the longest prefix in the
    node's own memory, then to the node chosen least recently, so idle nodes share the work
    (and every node sees the warm-up traffic its fit needs)."""

    def choose(self, view: RouteView) -> Prediction:
        nodes = view.nodes
        # Ties are equal T̂ to 9 decimals. ``round`` is monotone and a difference of close
        # floats is exact, so the tied nodes are among those within 2 ns of the minimum:
        # only those are estimated (others are ruled out by a bound) and rounded.
        estimates = view.t_hats(2e-9)
        near = [(i, e) for i, e in enumerate(estimates) if e is not None]
        if len(near) == 1:  # the bound ruled every other node out: nothing is tied
            return view.predict(nodes[near[0][0]])
        lo = min(t for _, (t, _) in near)
        least = round(lo, 9)
        tied = [(i, own) for i, (t, own) in near if t - lo <= 2e-9 and round(t, 9) == least]
        best = min(tied, key=lambda c: (-c[1], view.last_chosen(nodes[c[0]]), nodes[c[0]]))[0]
        return view.predict(nodes[best])


class DecodeOption(msgspec.Struct, frozen=True, gc=False):
    """A decode node the request may be bound to."""

    node: NodeId
    room: int | None
    """KV room from the node's last report minus what bound requests will take; None
    without a fresh report."""
    requests: int
    """Requests bound to the node and not finished."""
    cached: int = 0
    """Leading blocks of the request's path in the node's GPU memory: the KV the prefill
    node need not send it (Fig. 4d)."""


class DecodeStrategy(Protocol):
    at_submit: bool
    """Bind when the request is routed (and reserve there while it queues for prefill)
    rather than when its prefill starts."""

    def choose(self, need: int, options: Sequence[DecodeOption]) -> NodeId: ...


class FewestRequests:
    """E.3 line 13: the decode node with KV room for the request and the fewest requests,
    bound when the prefill starts, so queued requests hold no decode memory (paper D.1).
    A node without a fresh report may have room: it is ranked after those that report
    room. When none has room, the node with the most room takes it (overcommitted).

    Ties on requests (about half the bindings of a ``cc`` run) go to the node holding the
    longest prefix of the request in GPU memory: the branch's last decode node, as in
    Fig. 4d, where a branch alternates between a prefill node and one decode node and each
    step sends only new KV. Broken by name, a tie could move the branch to another node:
    its counts there and all the KV that node lacked."""

    at_submit = False

    def choose(self, need: int, options: Sequence[DecodeOption]) -> NodeId:
        fits = [o for o in options if o.room is None or o.room >= need]
        if fits:
            return min(fits, key=lambda o: (o.room is None, o.requests, -o.cached,
                                            o.node)).node
        return max(options, key=lambda o: (o.room, -o.requests, o.node)).node
