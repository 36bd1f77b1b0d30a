"""The SGLang Model Gateway's sticky-session prefill routing (paper 3.3, Fig. 3c: "sticky").

Source, read for behaviour, not copied: the gateway's ``manual`` policy
(``model_gateway/src/policies/manual.rs`` of lightseekorg/smg, the gateway's repository;
``docs/configuration/routing.md``, "Manual Policy": "sticky session routing with explicit
routing key mapping", usable as the prefill policy in PD mode). Per request:

1. a request with a routing key (``X-SMG-Routing-Key``) whose entry lists a healthy worker
   goes to the first such worker of the entry (at most two candidates, oldest first);
2. a key whose candidates are all unhealthy gets a new worker, appended to its candidates
   (the oldest dropped beyond two): it fails over and may come back;
3. a new key gets a new worker; the default assignment mode draws it uniformly from the
   healthy workers (``--assignment-mode random``), loads not looked at;
4. entries idle for ``max_idle_s`` (4 h) are evicted every ``eviction_interval_s`` (60 s).

The routing key is the agent's session: the paper says these policies "keep an agent and its
forked branches on the few prefill nodes that hold their prefixes", so a branch takes the
key of the branch it was forked or spawned from (the harness's parent hint), and a root
branch its own id. The gateway's uniform draw is made here from a hash of the key (crc32),
so a run is deterministic for its seed and the draw does not depend on arrival order.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import msgspec

from evinfra.core.types import BranchId, NodeId, PosFloat
from evinfra.router.strategy import RouteView, Stateless
from evinfra.router.ttft import Prediction

__all__ = ["Sticky", "StickyConfig"]

CANDIDATES = 2
"""``MAX_CANDIDATE_WORKERS``: the workers an entry remembers for failover."""


class StickyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``manual`` policy's defaults (``ManualConfig::default``)."""

    max_idle_s: PosFloat = 4 * 3600.0
    eviction_interval_s: PosFloat = 60.0


class _Entry:
    __slots__ = ("candidates", "last_access")

    def __init__(self, node: NodeId, now: float) -> None:
        self.candidates = [node]
        self.last_access = now


class Sticky(Stateless):
    """Sticky-session prefill routing (module docstring)."""

    def __init__(self, config: StickyConfig) -> None:
        self.config = config
        self.entries: dict[BranchId, _Entry] = {}
        """Routing key (an agent's root branch) -> its workers."""
        self._key: dict[BranchId, BranchId] = {}  # branch -> its routing key
        self._next_eviction: float | None = None
        self.last_rule = ""
        """Which branch of the policy took the last request: ``hit``, ``miss`` (failover) or
        ``vacant`` (a new key), the gateway's ``occupied_hit`` / ``occupied_miss`` /
        ``vacant``."""

    def key(self, branch: BranchId, parent: BranchId | None) -> BranchId:
        """The routing key of ``branch``: its parent's, else its own."""
        k = self._key.get(branch)
        if k is None:
            k = self._key[branch] = self.key(parent, None) if parent is not None else branch
        return k

    def choose(self, view: RouteView) -> Prediction:
        return view.predict(self.select(view))

    def select(self, view: RouteView) -> NodeId:
        self._evict(view.now)
        key = self.key(view.branch, view.parent)
        nodes = view.nodes
        entry = self.entries.get(key)
        if entry is None:
            node = self._draw(key, nodes)
            self.entries[key] = _Entry(node, view.now)
            self.last_rule = "vacant"
            return node
        entry.last_access = view.now
        for node in entry.candidates:
            if node in nodes:
                self.last_rule = "hit"
                return node
        node = self._draw(key, nodes)
        entry.candidates = (entry.candidates + [node])[-CANDIDATES:]
        self.last_rule = "miss"
        return node

    @staticmethod
    def _draw(key: BranchId, nodes: Sequence[NodeId]) -> NodeId:
        return nodes[zlib.crc32(key.encode()) % len(nodes)]

    def _evict(self, now: float) -> None:
        """The gateway's periodic TTL eviction of idle entries."""
        if self._next_eviction is None:
            self._next_eviction = now + self.config.eviction_interval_s
        elif now >= self._next_eviction:
            limit = self.config.max_idle_s
            stale = [k for k, e in self.entries.items() if now - e.last_access >= limit]
            for k in stale:
                del self.entries[k]
            if stale:  # their branches' keys too, or the map would grow with every branch
                gone = set(stale)
                self._key = {b: k for b, k in self._key.items() if k not in gone}
            self._next_eviction = now + self.config.eviction_interval_s
