"""The SGLang Model Gateway's PD routing: cache-aware prefill routing, round-robin decode
(paper 6.1: the router of every baseline; 3.3: "cache-aware" in Fig. 3c; D.5, D.6).

Sources, read for behaviour, not copied:

* ``sgl-router/src/policies/cache_aware.rs`` (sgl-project/sglang): one approximate radix
  tree per worker built from the requests the gateway routed (it never sees the engines'
  evictions), a load per worker, and the rule below. Defaults from the gateway's CLI and
  docs (``docs/advanced_features/sgl_model_gateway.md``, "Cache-Aware Policy Tuning"):
  ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5,
  ``eviction_interval`` 120 s, ``max_tree_size`` 67,108,864.
* ``sgl-router/src/routers/http/pd_router.rs``: in PD mode a request adds one to the load of
  both its prefill and decode worker until its response completes (``WorkerLoadGuard``).

The rule, per request over the healthy prefill workers:

1. loads are *imbalanced* if ``max − min > balance_abs_threshold`` and
   ``max > balance_rel_threshold · min``: route to the least loaded worker;
2. otherwise find the worker whose tree matches the longest prefix of the request; if the
   match covers more than ``cache_threshold`` of the request, route there;
3. otherwise route to the worker with the smallest tree ("most available cache capacity").
   The issue text says "least loaded" for this case; the gateway's source takes the
   smallest tree, and we follow the source.

The selected worker's tree gets the request either way. Our trees hold full KV pages of the
request (block hashes, the engines' page size) instead of characters, so a match rate is
matched pages over input tokens; ties among owners of the deepest match go to the most
recent owner, then the node name (the gateway's tree keeps no order among them).
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from evinfra.core.hashing import held_prefix
from evinfra.core.types import BlockHash, NodeId, NonNegFloat, PosFloat, PosInt, RequestId
from evinfra.router.strategy import DecodeOption, RouteView
from evinfra.router.ttft import Prediction

__all__ = ["ApproximateTree", "CacheAware", "CacheAwareConfig", "RoundRobin"]


class CacheAwareConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The gateway's cache-aware defaults (module docstring)."""

    cache_threshold: NonNegFloat = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: PosFloat = 1.5
    eviction_interval_s: PosFloat = 120.0
    max_tree_size: PosInt = 67_108_864
    """Tokens an approximate tree keeps per worker before its LRU leaves are evicted."""


class ApproximateTree:
    """One worker's approximate radix tree: the pages of the requests routed to it, with the
    time each was last routed. Paths are chained hashes, so a page implies its prefix and the
    tree is prefix-closed as long as eviction takes deeper pages first."""

    __slots__ = ("pages", "page_size")

    def __init__(self, page_size: int) -> None:
        self.pages: dict[BlockHash, tuple[float, int]] = {}  # page -> (last routed, depth)
        self.page_size = page_size

    @property
    def size(self) -> int:
        """Tokens held."""
        return len(self.pages) * self.page_size

    def match(self, path: Sequence[BlockHash]) -> int:
        """Leading pages of ``path`` in the tree (prefix-closed)."""
        return held_prefix(path, self.pages)

    def insert(self, path: Sequence[BlockHash], now: float) -> None:
        pages = self.pages
        for depth, h in enumerate(path):
            pages[h] = (now, depth)

    def last_access(self, path: Sequence[BlockHash], k: int) -> float:
        return self.pages[path[k - 1]][0] if k else float("-inf")

    def evict_to(self, tokens: int) -> None:
        """LRU, deeper pages first on ties, until at most ``tokens`` are held."""
        excess = len(self.pages) - tokens // self.page_size
        if excess <= 0:
            return
        victims = sorted(self.pages.items(), key=lambda kv: (kv[1][0], -kv[1][1]))[:excess]
        for h, _ in victims:
            del self.pages[h]


class CacheAware:
    """The gateway's cache-aware prefill routing (module docstring)."""

    def __init__(self, config: CacheAwareConfig, page_size: int) -> None:
        self.config = config
        self.page_size = page_size
        self.trees: dict[NodeId, ApproximateTree] = {}
        self.load: dict[NodeId, int] = {}
        self._on: dict[RequestId, NodeId] = {}
        self._next_eviction: float | None = None
        self.last_rule = ""
        """Which rule took the last request: ``imbalanced``, ``match`` or ``smallest``."""

    def _tree(self, node: NodeId) -> ApproximateTree:
        tree = self.trees.get(node)
        if tree is None:
            tree = self.trees[node] = ApproximateTree(self.page_size)
        return tree

    def choose(self, view: RouteView) -> Prediction:
        return view.predict(self.select(view))

    def select(self, view: RouteView) -> NodeId:
        self._evict(view.now)
        nodes = list(view.nodes)
        loads = [self.load.get(n, 0) for n in nodes]
        hi, lo = max(loads), min(loads)
        c = self.config
        if hi - lo > c.balance_abs_threshold and hi > c.balance_rel_threshold * lo:
            self.last_rule = "imbalanced"
            return nodes[loads.index(lo)]
        path = view.path.hashes
        matched = {n: self._tree(n).match(path) for n in nodes}
        deepest = max(matched.values())
        if deepest * self.page_size > c.cache_threshold * view.t_in:
            self.last_rule = "match"
            owners = [n for n in nodes if matched[n] == deepest]
            return min(owners, key=lambda n: (-self._tree(n).last_access(path, deepest), n))
        self.last_rule = "smallest"
        return min(nodes, key=lambda n: (self._tree(n).size, n))

    def _evict(self, now: float) -> None:
        """The gateway's background eviction, run when its interval has passed."""
        if self._next_eviction is None:
            self._next_eviction = now + self.config.eviction_interval_s
        elif now >= self._next_eviction:
            for tree in self.trees.values():
                tree.evict_to(self.config.max_tree_size)
            self._next_eviction = now + self.config.eviction_interval_s

    def routed(self, request: RequestId, node: NodeId, view: RouteView) -> None:
        self._release(request)
        self._on[request] = node
        self.load[node] = self.load.get(node, 0) + 1
        self._tree(node).insert(view.path.hashes, view.now)

    def prefill_done(self, request: RequestId, node: NodeId) -> None:
        pass  # the gateway's load lasts until the response completes

    def finished(self, request: RequestId, now: float) -> None:
        self._release(request)

    def _release(self, request: RequestId) -> None:
        node = self._on.pop(request, None)
        if node is not None:
            self.load[node] -= 1

    def released(self, now: float) -> list[RequestId]:
        return []


class RoundRobin:
    """The gateway's round-robin decode routing in PD mode: the decode worker is chosen
    with the prefill worker, when the request arrives, cycling over the healthy workers
    (``policies/round_robin.rs``: a counter modulo their number)."""

    at_submit = True

    def __init__(self) -> None:
        self._next = 0

    def choose(self, need: int, options: Sequence[DecodeOption]) -> NodeId:
        node = options[self._next % len(options)].node
        self._next += 1
        return node
