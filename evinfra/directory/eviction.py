"""Host-memory eviction in the order ``(1[R_b > 0], T_b)`` (paper 5.3, Algorithm E.2 16-21).

Two halves of one rule:

* :func:`eviction_order` is ``EvictHost`` as a function: given a node's host blocks with their
  ``T_b`` and its counts, it ranks them zero-count first and LRU within each group, pinned
  blocks never (the statement engines' orders are checked against).
* :class:`HostEvictionOrder` is the same order kept incrementally inside an engine (the fake
  engine, the SGLang patch). The engine cannot see ``R``; it learns which blocks have a
  positive count from the control plane's hints (:class:`~evinfra.core.contracts.HintDelta`:
  only blocks whose count crossed zero), and keeps one LRU list per group, so touching,
  inserting, re-grouping and picking a victim are all O(1).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from itertools import chain, filterfalse, repeat
from typing import Callable, Container, Iterable, Iterator, Mapping, Sequence

from evinfra.core.contracts import HintDelta
from evinfra.core.types import BlockHash

__all__ = ["HostEvictionOrder", "eviction_order"]


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


class HostEvictionOrder:
    """An engine's host tier order: zero-count blocks first, LRU within each group.

    With ``count_aware=False`` every block sits in one LRU list (plain HiCache LRU, for the
    baselines). ``positive`` may name blocks the engine does not hold yet: the control plane
    counts a branch's blocks when it places the request, before the prefill stores them.
    """

    def __init__(self, count_aware: bool = True) -> None:
        self.count_aware = count_aware
        self.positive: set[BlockHash] = set()
        self._zero: OrderedDict[BlockHash, None] = OrderedDict()
        self._pos: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._zero) + len(self._pos)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._zero or block in self._pos

    def _group(self, block: BlockHash) -> OrderedDict[BlockHash, None]:
        if self.count_aware and block in self.positive:
            return self._pos
        return self._zero

    def touch_all(self, blocks: Iterable[BlockHash]) -> None:
        """Insert each block, or mark it most recently used, in turn. The positive set
        says which group a block is in or joins (the zero group holds no positive block),
        so a block costs two lookups, whether it is new or held."""
        zero, pos, positive = self._zero, self._pos, self.positive
        aware = self.count_aware
        for h in blocks:
            group = pos if aware and h in positive else zero
            if h in group:
                group.move_to_end(h)
            else:
                group[h] = None

    def remove_all(self, blocks: Sequence[BlockHash]) -> None:
        """Take the blocks out of the order, held or not: a ``pop`` pass over the first
        block's group, and one over the other unless the first found them all (a segment's
        blocks usually share a group); each a C loop."""
        if not blocks:
            return
        first, other = self._zero, self._pos
        if blocks[0] in other:
            first, other = other, first
        held = len(first)
        deque(map(first.pop, blocks, repeat(None)), 0)
        if held - len(first) < len(blocks):
            deque(map(other.pop, blocks, repeat(None)), 0)

    def apply_hints(self, delta: HintDelta,
                    arrange: Callable[[list[BlockHash]], list[BlockHash]] | None = None) -> None:
        """Regroup the blocks whose count crossed zero, keeping their LRU position rank.

        A block that changes group joins the other group as its most recent entry: its
        exact recency relative to that group is unknown to an O(1) structure, and the
        order between groups, the part the paper's rule is about, is exact. ``arrange``
        orders each batch of moving blocks (given in hint order) before it joins its group.

        Most hinted blocks are not in host memory (a branch's context counted on a node
        before its KV arrives, or still in GPU memory there): the positive set takes them
        in one C loop, and only the blocks that change group are visited one by one.

        A ``replace`` delta resets the positive set (:meth:`reset_hints`)."""
        if delta.replace:
            self.reset_hints(delta.positive)
            return
        self.positive.update(delta.positive)
        if self.count_aware:
            self._move(delta.positive, self._zero, self._pos, arrange)
        self.positive.difference_update(delta.zero)
        self._move(delta.zero, self._pos, self._zero, arrange)

    @staticmethod
    def _move(blocks: list[BlockHash], src: OrderedDict[BlockHash, None],
              dst: OrderedDict[BlockHash, None],
              arrange: Callable[[list[BlockHash]], list[BlockHash]] | None) -> None:
        """The blocks ``src`` holds join ``dst`` as its newest, in ``arrange``'s order.
        Usually none does (a hinted block is rarely in host memory yet): a C scan that
        stops at the first one tells, before a filter that calls ``__contains__`` per block."""
        if src.keys().isdisjoint(blocks):
            return
        moving = list(filter(src.__contains__, blocks))
        if arrange is not None:
            moving = arrange(moving)
        for h in moving:
            del src[h]
            dst[h] = None

    def reset_hints(self, positive: Iterable[BlockHash]) -> None:
        """Replace the positive set wholesale (a resync after a lost connection)."""
        self.positive = set(positive)
        blocks = list(self._zero) + list(self._pos)
        self._zero, self._pos = OrderedDict(), OrderedDict()
        for h in blocks:
            self._group(h)[h] = None

    def victims(self, pinned: Callable[[BlockHash], bool] | None = None) -> Iterator[BlockHash]:
        """Blocks in eviction order, skipping pinned ones. Do not mutate while iterating;
        collect the victims first, then :meth:`remove_all` them."""
        order = chain(self._zero, self._pos)
        return order if pinned is None else filterfalse(pinned, order)

    def check_invariants(self) -> None:
        """Assert each block sits in the group the positive set says (for tests)."""
        assert self._zero.keys().isdisjoint(self._pos), "a block in both groups"
        if self.count_aware:
            assert self.positive.isdisjoint(self._zero), "a positive block in the zero group"
            assert self.positive.issuperset(self._pos), "a zero-count block in the positive group"
        else:
            assert not self._pos, "plain LRU has one group"
