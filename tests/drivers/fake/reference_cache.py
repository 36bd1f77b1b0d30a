"""The pure-Python fake-engine cache, kept as the reference of the native one (issue 37).

``NodeCache`` and the ``HostEvictionOrder`` it keeps are the implementations that
``evinfra/drivers/fake/cache.py`` and ``evinfra/directory/eviction.py`` had before the native
core (``evinfra/native/src/cache.cpp``, ``host_order.cpp``) took them over, unchanged but for
this module's imports. ``tests/property/test_cache_machine.py`` drives both with the same
operations and requires the same events, results and tiers.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict, deque
from itertools import chain, filterfalse, repeat
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from evinfra.core.contracts import HintDelta
from evinfra.core.events import BlockRemoved, BlockStored, KVEvent
from evinfra.core.hashing import held_prefix
from evinfra.core.types import BlockHash, Tier
from evinfra.drivers.fake.cache import InsertResult

__all__ = ["HostEvictionOrder", "InsertResult", "NodeCache"]

_GPU, _CPU = Tier.L1.medium, Tier.L2.medium


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


class _Seg:
    __slots__ = ("hashes", "depth", "parent", "children", "l1", "l2", "lock", "access", "l1_kids")

    def __init__(self, hashes: list[BlockHash], depth: int, parent: _Seg | None, l1: bool,
                 l2: bool, lock: int, access: float) -> None:
        self.hashes = hashes
        self.depth = depth  # index of the first block in every path through this segment
        self.parent = parent
        self.children: dict[BlockHash, _Seg] = {}  # by first block
        self.l1 = l1
        self.l2 = l2
        self.lock = lock  # requests pinning it (pins cover whole path prefixes)
        self.access = access
        self.l1_kids = 0  # children held in L1


class NodeCache:
    """L1 and L2 of one node. Sizes in tokens; ``reserved`` is GPU KV of running requests that
    is not in the tree yet (partial pages, chunks being computed, decode outputs)."""

    def __init__(self, page_size: int, l1_tokens: int, l2_tokens: int, count_aware: bool,
                 emit: Callable[[KVEvent], None]) -> None:
        self.page = page_size
        self.l1_capacity = l1_tokens
        self.l2_capacity = l2_tokens
        self._count_aware = count_aware
        self._emit = emit
        self.clear()

    def clear(self) -> None:
        """Forget everything without events (the node is gone)."""
        self.order = HostEvictionOrder(self._count_aware)
        self.reserved = 0
        self.l1_blocks = 0
        self.l2_blocks = 0
        self.locked_l1 = 0
        self._root = _Seg([], 0, None, True, True, 1, 0.0)
        self._seg_of: dict[BlockHash, _Seg] = {}
        self._heap: list[tuple[float, int, int, _Seg]] = []
        self._seq = itertools.count()

    # -- sizes ------------------------------------------------------------------------------

    @property
    def l1_used(self) -> int:
        return self.l1_blocks * self.page + self.reserved

    @property
    def l2_used(self) -> int:
        return self.l2_blocks * self.page

    @property
    def free(self) -> int:
        """GPU tokens free now."""
        return self.l1_capacity - self.l1_used

    @property
    def kv_room(self) -> int:
        """GPU tokens a new request could get: free plus unpinned (evictable) L1."""
        return self.free + (self.l1_blocks - self.locked_l1) * self.page

    def make_room(self, tokens: int) -> bool:
        """Evict unpinned L1 blocks until ``tokens`` are free; False if pins prevent it."""
        short = tokens - self.free
        if short > 0:
            self._evict_l1(-(-short // self.page))
        return self.free >= tokens

    def reserve(self, tokens: int) -> bool:
        if not self.make_room(tokens):
            return False
        self.reserved += tokens
        return True

    def release(self, tokens: int) -> None:
        self.reserved -= tokens

    # -- queries ----------------------------------------------------------------------------

    def prefix(self, path: Sequence[BlockHash], limit: int | None = None) -> int:
        """Longest prefix of ``path[:limit]`` held in any tier (the tree is prefix-closed)."""
        return held_prefix(path, self._seg_of, limit)

    def tier_prefix(self, path: Sequence[BlockHash], k: int, tier: Tier) -> int:
        """Longest prefix of ``path[:k]`` in ``tier``, where ``path[:k]`` is held."""
        if k == 0:
            return 0
        seg = self._seg_of[path[k - 1]]
        in_l1 = tier is Tier.L1
        res = k
        while seg is not self._root and not (seg.l1 if in_l1 else seg.l2):
            res = seg.depth
            seg = seg.parent
        return res

    def l1_prefix(self, path: Sequence[BlockHash]) -> int:
        return self.tier_prefix(path, self.prefix(path), Tier.L1)

    def l2_prefix(self, path: Sequence[BlockHash]) -> int:
        return self.tier_prefix(path, self.prefix(path), Tier.L2)

    # -- pins -------------------------------------------------------------------------------

    def lock(self, path: Sequence[BlockHash], n: int, now: float) -> None:
        """Pin ``path[:n]`` (held) and touch it."""
        self._lock_up(self._boundary(path, n), 0, now)

    def extend_lock(self, path: Sequence[BlockHash], old: int, new: int, now: float) -> None:
        """Grow a pin of ``path[:old]`` to ``path[:new]``: only the new segments are walked."""
        if new > old:
            self._lock_up(self._boundary(path, new), old, now)

    def unlock(self, path: Sequence[BlockHash], n: int, now: float) -> None:
        """Release a pin of ``path[:n]`` and touch it. Segments the pin no longer tells apart
        merge, so a branch's chunks and turns do not deepen the tree forever."""
        seg, below, root = self._boundary(path, n), None, self._root
        while seg is not root:
            seg.lock -= 1
            seg.access = now
            if seg.lock == 0:
                if seg.l1:
                    self.locked_l1 -= len(seg.hashes)
                    self._push(seg)
                else:
                    self._order_add(seg)
            if (below is not None and len(seg.children) == 1 and below.lock == seg.lock
                    and below.l1 == seg.l1 and below.l2 == seg.l2):
                seg = self._merge(seg, below)
            below, seg = seg, seg.parent

    def _lock_up(self, seg: _Seg, stop_depth: int, now: float) -> None:
        root = self._root
        while seg is not root and seg.depth >= stop_depth:
            if seg.lock == 0:
                if seg.l1:
                    self.locked_l1 += len(seg.hashes)
                else:
                    self._order_remove(seg)
            seg.lock += 1
            seg.access = now
            seg = seg.parent

    # -- stores -----------------------------------------------------------------------------

    def insert(self, path: Sequence[BlockHash], n: int, tokens: np.ndarray,
               now: float) -> InsertResult:
        """Make ``path[:n]`` resident in L1, written through to L2, evicting as needed.

        Held L2-only blocks are restored, new blocks stored (``tokens`` are the path's token
        ids, for the events). Blocks that find no L1 room are left out, from the end.
        """
        page = self.page
        k = self.prefix(path, n)
        self.lock(path, k, now)  # room-making must not evict the chain we extend
        l1p = self.tier_prefix(path, k, Tier.L1)
        stop1 = l1p + self._room_l1(n - l1p)
        l2p = self.tier_prefix(path, k, Tier.L2)
        stop2 = l2p + self._room_l2(stop1 - l2p)
        for seg in self._range(path, l1p, min(k, stop1)):
            seg.l1 = True
            self.l1_blocks += len(seg.hashes)
            self.locked_l1 += len(seg.hashes)
            seg.parent.l1_kids += 1
        for seg in self._range(path, l2p, min(k, stop2)):
            seg.l2 = True
            self.l2_blocks += len(seg.hashes)
        if stop1 > k:
            parent = self._boundary(path, k)
            if stop2 > k:
                parent = self._new(parent, list(path[k:stop2]), k, True, now)
            if stop1 > max(k, stop2):
                self._new(parent, list(path[max(k, stop2):stop1]), max(k, stop2), False, now)
        # Token ids travel as views of the request's array: converting them to lists was
        # the largest single cost of a simulation.
        for a, b, medium in ((l1p, stop1, _GPU), (l2p, stop2, _CPU)):
            if b > a:
                self._emit(BlockStored(list(path[a:b]), path[a - 1] if a else None,
                                       tokens[a * page:b * page], page, medium=medium))
        self.unlock(path, k, now)
        return InsertResult(stop1, max(0, min(k, stop1) - l1p), max(0, stop1 - k))

    def store_host(self, path: Sequence[BlockHash], n: int, tokens: np.ndarray,
                   now: float) -> int:
        """Hold ``path[:n]`` in host memory only (a peer fetch without L1 room): held L1-only
        blocks written through, new ones stored host-only, as L2 room allows (left out from
        the end). Returns the blocks new to this node. (Added with the native one; not in
        the cache the native core replaced.)"""
        page = self.page
        k = self.prefix(path, n)
        self.lock(path, k, now)  # host eviction must not take the chain we extend
        l2p = self.tier_prefix(path, k, Tier.L2)
        stop2 = l2p + self._room_l2(n - l2p)
        for seg in self._range(path, l2p, min(k, stop2)):
            seg.l2 = True
            self.l2_blocks += len(seg.hashes)
        if stop2 > k:
            parent = self._boundary(path, k)
            seg = _Seg(list(path[k:stop2]), k, parent, False, True, 0, now)
            parent.children[seg.hashes[0]] = seg
            for h in seg.hashes:
                self._seg_of[h] = seg
            self.l2_blocks += len(seg.hashes)
            self._order_add(seg)
        if stop2 > l2p:
            self._emit(BlockStored(list(path[l2p:stop2]), path[l2p - 1] if l2p else None,
                                   tokens[l2p * page:stop2 * page], page, medium=_CPU))
        self.unlock(path, k, now)
        return max(0, stop2 - k)

    def _new(self, parent: _Seg, hashes: list[BlockHash], depth: int, l2: bool,
             now: float) -> _Seg:
        seg = _Seg(hashes, depth, parent, True, l2, 0, now)
        parent.children[hashes[0]] = seg
        parent.l1_kids += 1
        held = self._seg_of
        for h in hashes:
            held[h] = seg
        self.l1_blocks += len(hashes)
        if l2:
            self.l2_blocks += len(hashes)
        self._push(seg)
        return seg

    def _range(self, path: Sequence[BlockHash], a: int, b: int) -> list[_Seg]:
        """The segments covering ``path[a:b]`` (held), split at both ends."""
        if b <= a:
            return []
        self._boundary(path, a)
        seg, out = self._boundary(path, b), []
        while seg.depth >= a and seg is not self._root:
            out.append(seg)
            seg = seg.parent
        return out

    # -- hints ------------------------------------------------------------------------------

    def apply_hints(self, delta: HintDelta) -> None:
        """Regroup host blocks whose count crossed zero. A regrouped batch joins its group as
        its newest entries; ordering it LRU and leaves first keeps eviction leaf-first.
        Plain LRU eviction has no groups: the hints change nothing there."""
        if not self._count_aware:
            return
        self.order.apply_hints(delta, self._leaf_first)

    def _leaf_first(self, blocks: list[BlockHash]) -> list[BlockHash]:
        """Host blocks (held, distinct) by their segment's access time, deepest first, each
        segment's blocks from its tail. Blocks are only counted per segment (C loops):
        usually a whole segment crossed, and its own list is the answer."""
        count = Counter(map(self._seg_of.__getitem__, blocks))
        chosen: set[BlockHash] | None = None
        out: list[BlockHash] = []
        for seg in sorted(count, key=lambda s: (s.access, -s.depth)):
            if count[seg] == len(seg.hashes):
                out.extend(reversed(seg.hashes))
            else:
                if chosen is None:
                    chosen = set(blocks)
                out.extend(h for h in reversed(seg.hashes) if h in chosen)
        return out

    # -- eviction ---------------------------------------------------------------------------

    def _room_l1(self, blocks: int) -> int:
        """How many of ``blocks`` new L1 blocks fit, after evicting what may be evicted."""
        if blocks <= 0:
            return 0
        self.make_room(blocks * self.page)
        return max(0, min(blocks, self.free // self.page))

    def _room_l2(self, blocks: int) -> int:
        if blocks <= 0:
            return 0
        short = blocks - (self.l2_capacity // self.page - self.l2_blocks)
        if short > 0:
            self._evict_l2(short)
        return max(0, min(blocks, self.l2_capacity // self.page - self.l2_blocks))

    def _push(self, seg: _Seg) -> None:
        """Offer ``seg`` to L1 eviction if it is an unpinned L1 leaf. Entries are checked when
        popped (lazy deletion): a changed access time, depth or state voids them."""
        if seg.l1 and not seg.lock and not seg.l1_kids:
            heapq.heappush(self._heap, (seg.access, -seg.depth, next(self._seq), seg))
            if len(self._heap) > 2 * self.l1_blocks + 1024:
                self._heap[:] = [e for e in self._heap if self._live(e)]  # in place: callers
                heapq.heapify(self._heap)                                 # may hold the list

    @staticmethod
    def _live(entry: tuple[float, int, int, _Seg]) -> bool:
        access, neg_depth, _, seg = entry
        return (seg.l1 and not seg.lock and not seg.l1_kids and seg.access == access
                and seg.depth == -neg_depth)

    def _evict_l1(self, blocks: int) -> None:
        removed: list[BlockHash] = []
        heap = self._heap
        while blocks > 0 and heap:
            entry = heapq.heappop(heap)
            if not self._live(entry):
                continue
            seg = entry[3]
            if len(seg.hashes) > blocks:  # take the tail only
                seg = self._split(seg, len(seg.hashes) - blocks)[1]
            blocks -= len(seg.hashes)
            removed.extend(seg.hashes)
            self._drop_l1(seg)
        if removed:
            self._emit(BlockRemoved(removed, medium=_GPU))

    def _drop_l1(self, seg: _Seg) -> None:
        seg.l1 = False
        self.l1_blocks -= len(seg.hashes)
        parent = seg.parent
        parent.l1_kids -= 1
        if parent is not self._root:
            self._push(parent)
        if seg.l2:
            self._order_add(seg)
        else:  # its write-through found no room: held nowhere now (a leaf, by L2 closure)
            del parent.children[seg.hashes[0]]
            for h in seg.hashes:
                del self._seg_of[h]

    def _evict_l2(self, blocks: int) -> None:
        """Free ``blocks`` host blocks in the host order, leaves first.

        A pass walks the order and takes each block that is the tail of a childless segment
        once the blocks after it are taken. It stops at the first block it cannot take yet:
        that block is older (or zero-count) and may become a leaf when this pass's victims
        go, so everything after it waits for the next pass."""
        held, order, removed = self._seg_of, self.order, []
        while len(removed) < blocks:
            taken: dict[_Seg, int] = {}
            batch: list[BlockHash] = []
            need = blocks - len(removed)
            victims = order.victims()
            while (h := next(victims, None)) is not None:
                seg = held[h]
                t = taken.get(seg, 0)
                hashes = seg.hashes
                if seg.children or hashes[-1 - t] != h:
                    if batch:
                        break
                    continue
                # A segment joins the order tail first, so the blocks before ``h`` usually
                # come next: compare as many as may be taken in one go.
                end = len(hashes) - t - 1
                run = hashes[max(0, end - (need - len(batch) - 1)):end][::-1]
                after = list(itertools.islice(victims, len(run)))
                same = 0
                if after == run:
                    same = len(run)
                else:
                    while same < len(after) and after[same] == run[same]:
                        same += 1
                    victims = itertools.chain(after[same:], victims)
                taken[seg] = t + 1 + same
                batch.append(h)
                batch += run[:same]
                if len(batch) == need:
                    break
            if not batch:
                break
            deque(map(held.__delitem__, batch), 0)
            for seg, t in taken.items():  # each loses its last t blocks
                hashes = seg.hashes
                if t == len(hashes):
                    del seg.parent.children[hashes[0]]
                del hashes[len(hashes) - t:]
            order.remove_all(batch)
            self.l2_blocks -= len(batch)
            removed.extend(batch)
        if removed:
            self._emit(BlockRemoved(removed, medium=_CPU))

    def _order_add(self, seg: _Seg) -> None:
        # Deepest first: leaves are evicted before their prefix.
        self.order.touch_all(reversed(seg.hashes))

    def _order_remove(self, seg: _Seg) -> None:
        self.order.remove_all(seg.hashes)

    # -- tree surgery -----------------------------------------------------------------------

    def _boundary(self, path: Sequence[BlockHash], k: int) -> _Seg:
        """The segment ending exactly at ``path[k - 1]`` (held), splitting one if needed."""
        if k == 0:
            return self._root
        seg = self._seg_of[path[k - 1]]
        cut = k - seg.depth
        if cut < len(seg.hashes):
            seg = self._split(seg, cut)[0]
        return seg

    def _merge(self, head: _Seg, tail: _Seg) -> _Seg:
        """Join ``tail``, the only child of ``head``, into one segment (same flags, pins and
        access); the object with more blocks survives, so only the other's are re-pointed."""
        held = self._seg_of
        if len(tail.hashes) <= len(head.hashes):
            keep, gone = head, tail
            for h in tail.hashes:
                held[h] = head
            head.hashes += tail.hashes
            head.children = tail.children
        else:
            keep, gone = tail, head
            for h in head.hashes:
                held[h] = tail
            tail.hashes = head.hashes + tail.hashes
            tail.depth, tail.parent = head.depth, head.parent
            head.parent.children[tail.hashes[0]] = tail
        for child in keep.children.values():
            child.parent = keep
        keep.l1_kids = tail.l1_kids
        gone.l1 = gone.l2 = False  # voids its heap entries
        self._push(keep)
        return keep

    def _split(self, seg: _Seg, p: int) -> tuple[_Seg, _Seg]:
        """Split ``seg`` after its ``p``-th block; the smaller half becomes the new object, so
        only its blocks are re-pointed."""
        hashes, kids = seg.hashes, seg.l1_kids
        new = _Seg([], 0, None, seg.l1, seg.l2, seg.lock, seg.access)
        if p <= len(hashes) - p:
            head, tail = new, seg
            head.depth, head.parent = seg.depth, seg.parent
            seg.parent.children[hashes[0]] = head
        else:
            head, tail = seg, new
            tail.children = seg.children
            for child in tail.children.values():
                child.parent = tail
        head.hashes, tail.hashes = hashes[:p], hashes[p:]
        tail.depth, tail.parent = head.depth + p, head
        head.children = {tail.hashes[0]: tail}
        tail.l1_kids, head.l1_kids = kids, int(tail.l1)
        held = self._seg_of
        for h in new.hashes:
            held[h] = new
        self._push(tail)
        return head, tail

    # -- checks -----------------------------------------------------------------------------

    def blocks(self, tier: Tier) -> set[BlockHash]:
        """Every block held in ``tier`` (tests and status; O(blocks))."""
        in_l1 = tier is Tier.L1
        return {h for h, seg in self._seg_of.items() if (seg.l1 if in_l1 else seg.l2)}

    def check_invariants(self) -> None:
        """Assert the tree, the counters and the host order agree (for tests)."""
        l1 = l2 = locked = blocks = 0
        host: set[BlockHash] = set()
        candidates: set[int] = set()
        stack = [self._root]
        while stack:
            seg = stack.pop()
            for key, child in seg.children.items():
                assert child.hashes and child.hashes[0] == key and child.parent is seg
                assert child.depth == seg.depth + len(seg.hashes)
                assert child.l1 or child.l2, "segment held nowhere"
                assert seg.l1 or not child.l1, "L1 not prefix-closed"
                assert seg.l2 or not child.l2, "L2 not prefix-closed"
                assert 0 <= child.lock and (seg is self._root or child.lock <= seg.lock), \
                    "a pin must cover a whole prefix"
                stack.append(child)
            assert seg.l1_kids == sum(c.l1 for c in seg.children.values())
            if seg is self._root:
                continue
            assert all(self._seg_of[h] is seg for h in seg.hashes)
            n = len(seg.hashes)
            blocks += n
            l1 += n * seg.l1
            l2 += n * seg.l2
            locked += n * (seg.l1 and seg.lock > 0)
            if seg.l2 and not seg.l1 and not seg.lock:
                host.update(seg.hashes)
            if seg.l1 and not seg.lock and not seg.l1_kids:
                candidates.add(id(seg))
        assert (l1, l2, locked) == (self.l1_blocks, self.l2_blocks, self.locked_l1)
        assert len(self._seg_of) == blocks, "a held block outside the tree"
        assert len(self.order) == len(host) and all(h in self.order for h in host)
        self.order.check_invariants()
        assert candidates <= {id(e[3]) for e in self._heap if self._live(e)}, "lost L1 leaf"
        assert 0 <= self.reserved and self.l1_used <= self.l1_capacity
        assert self.l2_used <= self.l2_capacity
