"""Host-memory eviction in the order ``(1[R_b > 0], T_b)`` (paper 5.3, Algorithm E.2 16-21).

Two halves of one rule:

* :func:`eviction_order` is ``EvictHost`` as a function: given a node's host blocks with their
  ``T_b`` and its counts, it ranks them zero-count first and LRU within each group, pinned
  blocks never (the statement engines' orders are checked against).
* :class:`HostEvictionOrder` is the same order kept incrementally inside an engine (the fake
  engine, the SGLang patch). The engine cannot see ``R``; it learns which blocks have a
  positive count from the control plane's hints (:class:`~evinfra.core.contracts.HintDelta`:
  only blocks whose count crossed zero), and keeps one LRU list per group, so touching,
  inserting, re-grouping and picking a victim are all O(1). The lists live in the native core
  (``evinfra/native/src/host_order.cpp``), where the fake engine's cache keeps one too; this
  class is its Python face (the SGLang engine patch, tests).
"""

from __future__ import annotations

import heapq
from collections.abc import Set
from itertools import filterfalse
from typing import Callable, Container, Iterable, Iterator, Mapping

from evinfra.core.contracts import HintDelta
from evinfra.core.types import BlockHash
from evinfra.native import _native

__all__ = ["HostEvictionOrder", "PositiveBlocks", "eviction_order"]


def eviction_order(host_blocks: Mapping[BlockHash, float], counts: Mapping[BlockHash, int],
                   pinned: Container[BlockHash] = ()) -> Iterator[BlockHash]:
    """Unpinned host blocks in ascending ``(1[R_b > 0], T_b)``; ties by hash, for determinism.

    ``host_blocks`` maps each host block of the node to ``T_b``; ``counts`` is ``R[·, n]``.
    Lazily ordered (a heap), so taking the first few victims of a large tier is cheap.
    """
    heap = [(1 if counts.get(h, 0) > 0 else 0, t, h) for h, t in host_blocks.items()
            if h not in pinned]
    heapq.heapify(heap)
    while heap:
        yield heapq.heappop(heap)[2]


class PositiveBlocks(Set):
    """The blocks an engine was told have a positive count: a read-only set view of the
    order's own set (a copy per look would cost O(set) each time the engine patch keys a
    node)."""

    __slots__ = ("_order",)

    def __init__(self, order: _native.HostOrder) -> None:
        self._order = order

    def __contains__(self, block: object) -> bool:
        try:
            return self._order.is_positive(block)
        except TypeError:  # not an int64, so no block: a set answers False too
            return False

    def __len__(self) -> int:
        return self._order.positive_count()

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self._order.positive_list())

    @classmethod
    def _from_iterable(cls, it: Iterable[BlockHash]) -> set[BlockHash]:
        return set(it)  # the results of ``&``, ``|``, ``-`` are plain sets, not views

    def __repr__(self) -> str:
        return f"PositiveBlocks({set(self)!r})"


class HostEvictionOrder:
    """An engine's host tier order: zero-count blocks first, LRU within each group (paper
    5.3, Algorithm E.2 lines 16-21: ``EvictHost`` picks in ``(1[R_b > 0], T_b)`` order).

    With ``count_aware=False`` every block sits in one LRU list (plain HiCache LRU, for the
    baselines). ``positive`` may name blocks the engine does not hold yet: the control plane
    counts a branch's blocks when it places the request, before the prefill stores them.
    """

    __slots__ = ("_order", "positive")

    def __init__(self, count_aware: bool = True) -> None:
        self._bind(_native.HostOrder(count_aware))

    @classmethod
    def of(cls, order: _native.HostOrder) -> HostEvictionOrder:
        """The Python face of a native order kept elsewhere (the fake engine's cache)."""
        self = cls.__new__(cls)
        self._bind(order)
        return self

    def _bind(self, order: _native.HostOrder) -> None:
        self._order = order
        self.positive = PositiveBlocks(order)

    @property
    def count_aware(self) -> bool:
        return self._order.count_aware

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block: object) -> bool:
        try:
            return block in self._order
        except TypeError:  # not an int64, so no block
            return False

    def touch_all(self, blocks: Iterable[BlockHash]) -> None:
        """Insert each block, or mark it most recently used, in turn. The positive set
        says which group a block is in or joins (the zero group holds no positive block)."""
        self._order.touch_all(blocks)

    def remove_all(self, blocks: Iterable[BlockHash]) -> None:
        """Take the blocks out of the order, held or not."""
        self._order.remove_all(blocks)

    def apply_hints(self, delta: HintDelta,
                    arrange: Callable[[list[BlockHash]], list[BlockHash]] | None = None) -> None:
        """Regroup the blocks whose count crossed zero, keeping their LRU position rank.

        ``delta.positive`` joins the positive set first, then ``delta.zero`` leaves it. A
        block that changes group joins the other group as its most recent entry: its exact
        recency relative to that group is unknown to an O(1) structure, and the order between
        groups, the part the paper's rule is about, is exact. ``arrange`` orders each batch of
        moving blocks (given in hint order, each once) before it joins its group.

        A ``replace`` delta resets the positive set (:meth:`reset_hints`)."""
        self._order.apply_hints(delta.positive, delta.zero, delta.replace, arrange)

    def reset_hints(self, positive: Iterable[BlockHash]) -> None:
        """Replace the positive set wholesale (a resync after a lost connection)."""
        self._order.reset_hints(positive)

    def victims(self, pinned: Callable[[BlockHash], bool] | None = None) -> Iterator[BlockHash]:
        """Blocks in eviction order, skipping pinned ones (a snapshot: mutating the order
        while iterating is safe, but the iteration does not see it)."""
        order = iter(self._order.victims())
        return order if pinned is None else filterfalse(pinned, order)

    def check_invariants(self) -> None:
        """Assert each block sits in the group the positive set says (for tests)."""
        bad = self._order.check()
        assert not bad, bad
