"""One node's KV: L1 (GPU) and L2 (host) as a radix tree of block segments (paper 4.2, 5.3).

A *segment* is a run of consecutive blocks of one path that share everything the cache tracks:
tier flags, pins and last access. The tree is SGLang's radix cache in blocks, which is what
keeps a request cheap: matching a prefix is a binary search on block membership, pinning,
touching and unpinning walk the segments of a path (a few dozen for a long agent branch), and
only blocks that actually move (stored, restored, evicted) cost per-block work — the same
blocks the KV events must list anyway. A dict of blocks would touch all ~1,600 blocks of a 100K
context several times per request.

Invariants (``check_invariants``):

* each tier is prefix-closed: a block in L1 (L2) has its parent block in L1 (L2), because
  eviction only takes leaves. The longest cached prefix is therefore a binary search;
* write-through: blocks enter L2 together with L1 unless L2 has no room (then they are
  L1-only, and L1 eviction drops them); only ``store_host`` (a peer fetch without L1 room)
  enters blocks in L2 alone;
* L1 eviction is LRU over unpinned L1 leaves, deeper first on ties (a touched path gets one
  time, so leaves go before their prefix, like SGLang's leaf-first eviction), then the order
  they became candidates in; it drops the GPU copy only;
* L2 eviction takes blocks held only in L2, unpinned, leaves first, in the host order
  (:class:`~evinfra.directory.eviction.HostEvictionOrder`: zero-count first from the pushed
  hints, or plain LRU). The order holds exactly the blocks of unpinned L2-only segments.

Every store and removal is reported through ``emit`` as SGLang KV events.

The tree lives in the native core (``evinfra/native/src/cache.cpp``): each call here is one
native call, which returns what the events must say; this shell builds and emits them. The
former pure-Python cache is the reference it is tested against
(``tests/drivers/fake/reference_cache.py``, ``tests/property/test_cache_machine.py``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from evinfra.core.contracts import HintDelta
from evinfra.core.events import BlockRemoved, BlockStored, KVEvent
from evinfra.core.types import BlockHash, Tier
from evinfra.directory.eviction import HostEvictionOrder
from evinfra.native import _native

__all__ = ["InsertResult", "NodeCache"]

_GPU, _CPU = Tier.L1.medium, Tier.L2.medium


class InsertResult(NamedTuple):
    resident: int
    """Leading blocks of the path in L1 afterwards."""
    restored: int
    """Blocks loaded from this node's L2 into L1."""
    added: int
    """Blocks new to this node."""


class NodeCache:
    """L1 and L2 of one node. Sizes in tokens; ``reserved`` is GPU KV of running requests that
    is not in the tree yet (partial pages, chunks being computed, decode outputs)."""

    def __init__(self, page_size: int, l1_tokens: int, l2_tokens: int, count_aware: bool,
                 emit: Callable[[KVEvent], None]) -> None:
        self.page = page_size
        self.l1_capacity = l1_tokens
        self.l2_capacity = l2_tokens
        self._emit = emit
        self._tree = _native.NodeCache(page_size, l1_tokens, l2_tokens, count_aware)
        self.order = HostEvictionOrder.of(self._tree.order)
        """The host tier order (read-only for callers: the cache keeps it)."""

    def clear(self) -> None:
        """Forget everything without events (the node is gone)."""
        self._tree.clear()

    # -- sizes ------------------------------------------------------------------------------

    @property
    def reserved(self) -> int:
        return self._tree.reserved

    @property
    def l1_blocks(self) -> int:
        return self._tree.l1_blocks

    @property
    def l2_blocks(self) -> int:
        return self._tree.l2_blocks

    @property
    def locked_l1(self) -> int:
        """L1 blocks pinned by requests."""
        return self._tree.locked_l1

    @property
    def l1_used(self) -> int:
        return self._tree.l1_used

    @property
    def l2_used(self) -> int:
        return self._tree.l2_used

    @property
    def free(self) -> int:
        """GPU tokens free now."""
        return self._tree.free

    @property
    def kv_room(self) -> int:
        """GPU tokens a new request could get: free plus unpinned (evictable) L1."""
        return self._tree.kv_room

    def make_room(self, tokens: int) -> bool:
        """Evict unpinned L1 blocks until ``tokens`` are free; False if pins prevent it."""
        ok, removed = self._tree.make_room(tokens)
        if removed:
            self._emit(BlockRemoved(removed, medium=_GPU))
        return ok

    def reserve(self, tokens: int) -> bool:
        """Hold ``tokens`` of GPU KV outside the tree, evicting for them; False (nothing held)
        if pins prevent it."""
        ok, removed = self._tree.reserve(tokens)
        if removed:
            self._emit(BlockRemoved(removed, medium=_GPU))
        return ok

    def release(self, tokens: int) -> None:
        self._tree.release(tokens)

    # -- queries ----------------------------------------------------------------------------

    def prefix(self, path: Sequence[BlockHash], limit: int | None = None) -> int:
        """Longest prefix of ``path[:limit]`` held in any tier (the tree is prefix-closed)."""
        return self._tree.prefix(path, limit)

    def tier_prefix(self, path: Sequence[BlockHash], k: int, tier: Tier) -> int:
        """Longest prefix of ``path[:k]`` in ``tier``, where ``path[:k]`` is held."""
        return self._tree.tier_prefix(path, k, tier is Tier.L1)

    def l1_prefix(self, path: Sequence[BlockHash]) -> int:
        return self._tree.tier_prefix(path, self._tree.prefix(path, None), True)

    def l2_prefix(self, path: Sequence[BlockHash]) -> int:
        return self._tree.tier_prefix(path, self._tree.prefix(path, None), False)

    # -- pins -------------------------------------------------------------------------------

    def lock(self, path: Sequence[BlockHash], n: int, now: float) -> None:
        """Pin ``path[:n]`` (held) and touch it."""
        self._tree.lock(path, n, now)

    def extend_lock(self, path: Sequence[BlockHash], old: int, new: int, now: float) -> None:
        """Grow a pin of ``path[:old]`` to ``path[:new]``: only the new segments are walked."""
        self._tree.extend_lock(path, old, new, now)

    def unlock(self, path: Sequence[BlockHash], n: int, now: float) -> None:
        """Release a pin of ``path[:n]`` and touch it. Segments the pin no longer tells apart
        merge, so a branch's chunks and turns do not deepen the tree forever."""
        self._tree.unlock(path, n, now)

    # -- stores -----------------------------------------------------------------------------

    def insert(self, path: Sequence[BlockHash], n: int, tokens: np.ndarray,
               now: float) -> InsertResult:
        """Make ``path[:n]`` resident in L1, written through to L2, evicting as needed.

        Held L2-only blocks are restored, new blocks stored (``tokens`` are the path's token
        ids, for the events). Blocks that find no L1 room are left out, from the end.
        """
        k, l1p, stop1, l2p, stop2, gone1, gone2 = self._tree.insert(path, n, now)
        emit, page = self._emit, self.page
        if gone1:
            emit(BlockRemoved(gone1, medium=_GPU))
        if gone2:
            emit(BlockRemoved(gone2, medium=_CPU))
        # Token ids travel as views of the request's array: converting them to lists was
        # the largest single cost of a simulation.
        for a, b, medium in ((l1p, stop1, _GPU), (l2p, stop2, _CPU)):
            if b > a:
                emit(BlockStored(list(path[a:b]), path[a - 1] if a else None,
                                 tokens[a * page:b * page], page, medium=medium))
        return InsertResult(stop1, max(0, min(k, stop1) - l1p), max(0, stop1 - k))

    def store_host(self, path: Sequence[BlockHash], n: int, tokens: np.ndarray,
                   now: float) -> int:
        """Hold ``path[:n]`` in host memory only: a peer fetch that finds no L1 room lands in
        the host tier, as the SGLang engine's fetch does (``engine_patch/fetch.py``), and the
        request's admission loads it back. Held L1-only blocks are written through, new ones
        stored host-only, as L2 room allows (left out from the end). Returns the blocks new
        to this node."""
        k, l2p, stop2, gone2 = self._tree.store_host(path, n, now)
        if gone2:
            self._emit(BlockRemoved(gone2, medium=_CPU))
        if stop2 > l2p:
            page = self.page
            self._emit(BlockStored(list(path[l2p:stop2]), path[l2p - 1] if l2p else None,
                                   tokens[l2p * page:stop2 * page], page, medium=_CPU))
        return max(0, stop2 - k)

    # -- hints ------------------------------------------------------------------------------

    def apply_hints(self, delta: HintDelta) -> None:
        """Regroup host blocks whose count crossed zero. A regrouped batch joins its group as
        its newest entries, ordered LRU by segment and leaves first, which keeps eviction
        leaf-first. Plain LRU eviction has no groups: the hints change nothing there."""
        self._tree.apply_hints(delta.positive, delta.zero, delta.replace)

    # -- checks -----------------------------------------------------------------------------

    def blocks(self, tier: Tier) -> set[BlockHash]:
        """Every block held in ``tier`` (tests and status; O(blocks))."""
        return set(self._tree.blocks(tier is Tier.L1))

    def check_invariants(self) -> None:
        """Assert the tree, the counters and the host order agree (for tests)."""
        bad = self._tree.check()
        assert not bad, bad
