"""The cluster-wide prefix tree of KV blocks (paper 4.3, Appendix A.3).

A block is keyed by its page-chained hash, so the hash alone names a block *and* its whole
prefix: the tree needs no child pointers to answer "how long a prefix of this path does node
n hold". Each block keeps its parent hash and one integer of holder bits: for node ``i``, bit
``i`` says L2 (host), bit ``S + i`` L1 (GPU) and bit ``2S + i`` either tier, with ``S`` the
node capacity. Packing the three masks in one int lets a prefix walk test "does every node
still alive hold this block" with a single AND per block. Each (block, node) pair keeps its
last store time ``T_b``.

Lookups (:meth:`PrefixTree.match`, on every route) read a numpy mirror of the holder bits
instead: each block has a *slot*, an index into ``uint64`` arrays, one per 32 nodes, where node
``i`` has bit ``i % 32`` ("holds it in some tier") and bit ``32 + i % 32`` ("holds it in L1")
of array ``i // 32``; events write it in bulk. A path remembers the slots of its blocks (``HashedPath.slots``), so a lookup is
a few vectorised gathers plus one dict lookup per block that was not in the tree last time;
a remembered slot is trusted only if it still holds that hash, so a freed and reused slot is
never misread.

Engines feed the tree with their KV events (SGLang schema). Bad events never raise: unknown
parents, removals of blocks the node does not hold, duplicate hashes and untracked media are
counted in :class:`TreeStats` and logged at powers of two, and the tree stays consistent.

When a node stops holding a block in every tier, the block is *lost* on that node: the caller
(``directory.Directory``) zeroes the block's branch counts there (Algorithm E.2 line 20).
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import not_
from typing import Iterable, Sequence

import msgspec
import numpy as np
import structlog

from evinfra.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from evinfra.core.hashing import HashedPath
from evinfra.core.types import BlockHash, NodeId, Tier

__all__ = ["PrefixMatch", "PrefixTree", "TreeStats"]

log = structlog.get_logger(__name__)


class TreeStats(msgspec.Struct):
    """Counters of applied and tolerated events (exported as metrics)."""

    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    unknown_parent: int = 0
    unknown_removal: int = 0
    duplicate_hash: int = 0
    unknown_node: int = 0
    untracked_medium: int = 0
    block_size_mismatch: int = 0


class PrefixMatch(msgspec.Struct, frozen=True, gc=False):
    """What a path's prefix looks like across the nodes (read by the router, E.3 line 6).

    ``union`` is the number of leading blocks held by *some* node: the cached prefix
    ``t_c,n`` any node can reach through the pool. ``own[i]`` and ``own_l1[i]`` are the
    leading blocks node ``i`` (its index) holds itself, in any tier and in L1; blocks
    ``own[i]:union`` are the ones it would fetch from peers (``x_n``).
    """

    union: int
    own: list[int]
    own_l1: list[int]


class PrefixTree:
    """Blocks by hash with per-(node, tier) holders; nodes are addressed by a small index."""

    def __init__(self, nodes: Iterable[NodeId], page_size: int) -> None:
        self.page_size = page_size
        self.stats = TreeStats()
        nodes = list(nodes)
        # Node capacity of the packed masks (doubles when exceeded): small masks are fast.
        self._S = 8
        while self._S < len(nodes):
            self._S *= 2
        self._held: dict[BlockHash, int] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._index: dict[NodeId, int] = {}
        self._names: list[NodeId] = []
        # T_b per (block, node): one dict per node; its keys are exactly the node's blocks.
        self._access: list[dict[BlockHash, float]] = []
        # The lookup mirror (module docstring): slot per block, its hash, and per slot the
        # any-tier and L1 holder words. Slot rows of blocks no node holds are all zero.
        self._slot: dict[BlockHash, int] = {}
        self._free: list[int] = []
        self._top = 1  # the next slot never handed out
        self._slot_hash = np.zeros(1024, np.int64)
        self._words = [np.zeros(1024, np.uint64)]
        for n in nodes:
            self.add_node(n)

    # -- nodes -------------------------------------------------------------------------------

    def add_node(self, node: NodeId) -> int:
        if node in self._index:
            return self._index[node]
        if len(self._names) == self._S:
            self._repack(2 * self._S)
        if len(self._names) == 32 * len(self._words):
            self._words.append(np.zeros_like(self._slot_hash, np.uint64))
        self._index[node] = len(self._names)
        self._names.append(node)
        self._access.append({})
        return self._index[node]

    def _repack(self, S: int) -> None:
        old, low = self._S, (1 << self._S) - 1
        for h, m in self._held.items():
            self._held[h] = (m & low) | (((m >> old) & low) << S) | ((m >> 2 * old) << 2 * S)
        self._S = S

    def node_index(self, node: NodeId) -> int | None:
        return self._index.get(node)

    def node_name(self, index: int) -> NodeId:
        return self._names[index]

    @property
    def nodes(self) -> list[NodeId]:
        return list(self._names)

    # -- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._held

    def parent(self, block: BlockHash) -> BlockHash | None:
        return self._parent[block]

    def tiers(self, block: BlockHash, node: int) -> set[Tier]:
        m = self._held.get(block, 0)
        out = set()
        if m >> (self._S + node) & 1:
            out.add(Tier.L1)
        if m >> node & 1:
            out.add(Tier.L2)
        return out

    def holds(self, block: BlockHash, node: int) -> bool:
        return block in self._access[node]

    def holders(self, block: BlockHash) -> list[int]:
        """Indexes of the nodes holding ``block`` in any tier."""
        m = self._held.get(block, 0) >> 2 * self._S
        return [i for i in range(len(self._names)) if m >> i & 1]

    def blocks_on(self, node: int) -> dict[BlockHash, float]:
        """The node's blocks and their ``T_b`` (read-only view; do not mutate)."""
        return self._access[node]

    def host_blocks(self, node: int) -> list[BlockHash]:
        held = self._held
        return [h for h in self._access[node] if held[h] >> node & 1]

    def host_only_blocks(self, node: int) -> list[BlockHash]:
        """Blocks the node holds in host memory and not in GPU memory."""
        held, S = self._held, self._S
        return [h for h in self._access[node]
                if held[h] >> node & 1 and not held[h] >> (S + node) & 1]

    def entries(self) -> int:
        """Number of (block, node) entries."""
        return sum(len(a) for a in self._access)

    def match(self, path: HashedPath | Sequence[BlockHash]) -> PrefixMatch:
        """Longest prefix of ``path`` per node (any tier, and L1) and across the cluster.

        The path's rows of the mirror are gathered (the slots it remembers, checked, and one
        dict lookup per block it did not find last time) and folded down the path with a
        cumulative AND, which only loses bits: a node's prefix ends at the row where its bit
        leaves the fold. Python-level work is O(nodes) at the rows where the fold changes.
        """
        n = len(self._names)
        if isinstance(path, HashedPath):
            hashes, array = path.hashes, path.array
            if path.slots is None:
                path.slots = np.full(len(hashes), -1, np.int64)
            slots = path.slots
        else:
            hashes = list(path)
            array = np.array(hashes, dtype=np.int64)
            slots = np.full(len(hashes), -1, np.int64)
        if not hashes:
            return PrefixMatch(0, [0] * n, [0] * n)
        # Slot 0 is never handed out: an unknown block (-1, clipped to 0) reads an empty row.
        rows = [a.take(slots, mode="clip") for a in self._words]
        held = rows[0] if len(rows) == 1 else np.bitwise_or.reduce(rows)
        ok = self._slot_hash.take(slots, mode="clip") == array
        ok &= held != 0
        union = len(hashes)
        if np.count_nonzero(ok) < union:
            # Look up the blocks not found last time, up to the first one no node holds
            # (the union's end): the first 16, and the rest only if those are all held.
            bad = (~ok).nonzero()[0].tolist()
            found = list(map(self._slot.get, map(hashes.__getitem__, bad[:16])))
            if None not in found and len(bad) > 16:
                found += map(self._slot.get, map(hashes.__getitem__, bad[16:]))
            if None in found:
                cut = found.index(None)
                union = bad[cut]
                del found[cut:]
            fixed = bad[:len(found)]
            if fixed:
                slots[fixed] = found
                for r, a in zip(rows, self._words):
                    r[fixed] = a[found]
        own = [0] * n
        own_l1 = [0] * n
        if not union:
            return PrefixMatch(union, own, own_l1)
        acc = [np.bitwise_and.accumulate(r[:union]) for r in rows]
        changed = acc[0][1:] != acc[0][:-1]
        for a in acc[1:]:
            changed |= a[1:] != a[:-1]
        # A node's bits live in the fold from row 0 up to the row where they die; the bits
        # still alive at the end die at ``union``. Nodes without block 0 keep 0.
        prev = [int(a[0]) for a in acc]
        for j in [*(i + 1 for i in changed.nonzero()[0].tolist()), union]:
            now = [int(a[j]) for a in acc] if j < union else [0] * len(acc)
            for w, (p, q) in enumerate(zip(prev, now)):
                dead = p & ~q
                while dead:
                    low = dead & -dead
                    bit = low.bit_length() - 1
                    if bit < 32:
                        own[32 * w + bit] = j
                    else:
                        own_l1[32 * w + bit - 32] = j
                    dead ^= low
            prev = now
        return PrefixMatch(union, own, own_l1)

    # -- KV events ---------------------------------------------------------------------------

    def apply(self, node: NodeId, event: KVEvent, now: float) -> list[BlockHash]:
        """Apply one KV event of ``node``; return the blocks the node lost entirely."""
        idx = self._index.get(node)
        if idx is None:
            self._count("unknown_node", node=node)
            return []
        if type(event) is BlockStored:
            self.store(idx, event.block_hashes, event.parent_block_hash, event.medium, now,
                       block_size=event.block_size)
            return []
        if type(event) is BlockRemoved:
            return self.remove(idx, event.block_hashes, event.medium)
        if type(event) is AllBlocksCleared:
            return self.clear(idx)
        raise TypeError(f"not a KV event: {event!r}")

    def store(self, node: int, hashes: Sequence[BlockHash], parent: BlockHash | None,
              medium: str | None, now: float, *, block_size: int | None = None) -> None:
        tier = Tier.from_medium(medium)
        if tier is None:
            self._count("untracked_medium", medium=medium)
            return
        if block_size is not None and block_size != self.page_size:
            self._count("block_size_mismatch", block_size=block_size, page_size=self.page_size)
        held, parents = self._held, self._parent
        access = self._access[node]
        if parent is not None and parent not in held:
            self._count("unknown_parent", node=self._names[node], parent=parent)
        if len(hashes) > 1 and len(set(hashes)) != len(hashes):
            # A chained hash cannot repeat within one path: the event is corrupt. Storing a
            # block is idempotent, so store each once and count it.
            self._count("duplicate_hash", node=self._names[node])
            hashes = list(dict.fromkeys(hashes))
        S = self._S
        bits = (1 << (2 * S + node)) | (1 << (S + node) if tier is Tier.L1 else 1 << node)
        # Whole-event dict updates (C loops): a store names hundreds of blocks.
        old = list(map(held.get, hashes, repeat(0)))  # a held block's bits are never 0
        held.update(zip(hashes, map(bits.__or__, old)))
        fresh = list(map(not_, old))
        new = list(compress(hashes, fresh))
        if new:
            parents.update(compress(zip(hashes, chain((parent,), hashes)), fresh))
        access.update(zip(hashes, repeat(now)))
        self.stats.blocks_stored += len(hashes)
        if new:
            self._alloc(new)
        slots = self._slots_of(hashes)
        w, b = divmod(node, 32)
        self._words[w][slots] |= np.uint64(1 << b | (1 << (32 + b) if tier is Tier.L1 else 0))

    def remove(self, node: int, hashes: Iterable[BlockHash], medium: str | None) -> list[BlockHash]:
        tier = Tier.from_medium(medium)
        if tier is None:
            self._count("untracked_medium", medium=medium)
            return []
        S = self._S
        bit = 1 << (S + node) if tier is Tier.L1 else 1 << node
        other = 1 << node if tier is Tier.L1 else 1 << (S + node)
        anybit = 1 << (2 * S + node)
        hashes = list(hashes)
        old = list(map(self._held.get, hashes, repeat(0)))
        if all(map(bit.__and__, old)) and len(set(hashes)) == len(hashes):
            lost, kept, gone = self._remove_all(node, hashes, old, bit, other, anybit)
        else:
            lost, kept, gone = self._remove_each(node, hashes, bit, other, anybit)
        self.stats.blocks_removed += len(kept) + len(lost)
        w, b = divmod(node, 32)
        if lost:
            self._words[w][self._slots_of(lost)] &= ~np.uint64(1 << b | 1 << (32 + b))
        if kept and tier is Tier.L1:
            self._words[w][self._slots_of(kept)] &= ~np.uint64(1 << (32 + b))
        if gone:
            self._release_slots(gone)
        return lost

    def _remove_all(self, node: int, hashes: list[BlockHash], old: list[int], bit: int,
                    other: int, anybit: int
                    ) -> tuple[list[BlockHash], list[BlockHash], list[BlockHash]]:
        """:meth:`remove` of distinct blocks the node holds in the tier, in whole-list dict
        operations: ``(lost, kept in the other tier, held by no node any more)``."""
        held, parents, access = self._held, self._parent, self._access[node]
        in_other = list(map(other.__and__, old))
        kept = list(compress(hashes, in_other))
        if kept:
            held.update(zip(kept, map((~bit).__and__, compress(old, in_other))))
        only = list(map(not_, in_other))
        lost = list(compress(hashes, only))
        rest = list(map((~(bit | anybit)).__and__, compress(old, only)))
        held.update(compress(zip(lost, rest), rest))
        gone = list(compress(lost, map(not_, rest)))
        for h in lost:
            del access[h]
        for h in gone:
            del held[h], parents[h]
        return lost, kept, gone

    def _remove_each(self, node: int, hashes: list[BlockHash], bit: int, other: int, anybit: int
                     ) -> tuple[list[BlockHash], list[BlockHash], list[BlockHash]]:
        """:meth:`remove` block by block: an event with blocks the node does not hold in the
        tier (each counted) or a block named twice."""
        held, parents, access = self._held, self._parent, self._access[node]
        lost: list[BlockHash] = []
        kept: list[BlockHash] = []
        gone: list[BlockHash] = []
        for h in hashes:
            m = held.get(h, 0)
            if not m & bit:
                self._count("unknown_removal", node=self._names[node], block=h)
                continue
            if m & other:
                held[h] = m & ~bit
                kept.append(h)
                continue
            m &= ~(bit | anybit)
            del access[h]
            lost.append(h)
            if m:
                held[h] = m
            else:
                del held[h]
                del parents[h]
                gone.append(h)
        return lost, kept, gone

    def clear(self, node: int) -> list[BlockHash]:
        """The node dropped everything (``AllBlocksCleared``, a crash, a relaunch)."""
        held, parents, S = self._held, self._parent, self._S
        keep = ~((1 << node) | (1 << (S + node)) | (1 << (2 * S + node)))
        lost = list(self._access[node])
        gone = []
        for h in lost:
            m = held[h] & keep
            if m:
                held[h] = m
            else:
                del held[h]
                del parents[h]
                gone.append(h)
        self._access[node] = {}
        self.stats.clears += 1
        if lost:
            w, b = divmod(node, 32)
            self._words[w][self._slots_of(lost)] &= ~np.uint64(1 << b | 1 << (32 + b))
        if gone:
            self._release_slots(gone)
        return lost

    # -- the lookup mirror -------------------------------------------------------------------

    def _slots_of(self, hashes: Sequence[BlockHash]) -> np.ndarray:
        return np.fromiter(map(self._slot.__getitem__, hashes), np.int64, len(hashes))

    def _alloc(self, hashes: list[BlockHash]) -> None:
        """Slots for blocks new to the tree: freed ones first, then fresh ones (the mirror
        doubles when full; slot 0 stays empty)."""
        free = self._free
        take = min(len(free), len(hashes))
        got = free[len(free) - take:]
        del free[len(free) - take:]
        if len(hashes) > take:
            top = self._top
            end = self._top = top + len(hashes) - take
            cap = len(self._slot_hash)
            if end > cap:
                while cap < end:
                    cap *= 2
                grow = cap - len(self._slot_hash)
                self._slot_hash = np.concatenate([self._slot_hash, np.zeros(grow, np.int64)])
                zeros = np.zeros(grow, np.uint64)
                self._words = [np.concatenate([a, zeros]) for a in self._words]
            got.extend(range(top, end))
        self._slot.update(zip(hashes, got))
        self._slot_hash[got] = hashes

    def _release_slots(self, hashes: list[BlockHash]) -> None:
        """Blocks no node holds: their rows are all zero already; their slots are reused."""
        pop = self._slot.pop
        self._free.extend(pop(h) for h in hashes)

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the packed masks and the per-node ``T_b`` tables agree (for tests)."""
        S = self._S
        assert self._held.keys() == self._parent.keys()
        for h, m in self._held.items():
            assert m, f"block {h} held by no node"
            for idx in range(len(self._names)):
                l2, l1, any_ = m >> idx & 1, m >> (S + idx) & 1, m >> (2 * S + idx) & 1
                assert any_ == (l1 | l2), f"{h} on {idx}: any-tier bit disagrees"
                assert bool(any_) == (h in self._access[idx]), f"{h} on {idx}: T_b disagrees"
        for idx, access in enumerate(self._access):
            for h in access:
                assert h in self._held, f"{h} on {idx} not in index"
        assert self._slot.keys() == self._held.keys()
        assert 0 not in self._slot.values() and not set(self._free) & set(self._slot.values())
        low = (1 << len(self._names)) - 1
        for h, m in self._held.items():
            slot = self._slot[h]
            assert self._slot_hash[slot] == h, f"{h}: slot {slot} names another block"
            words = [int(a[slot]) for a in self._words]
            any_ = sum((x & 0xFFFFFFFF) << (32 * w) for w, x in enumerate(words))
            l1 = sum((x >> 32) << (32 * w) for w, x in enumerate(words))
            assert any_ == (m >> 2 * S) & low and l1 == (m >> S) & low, f"{h}: mirror disagrees"
        for slot in [0, *self._free]:
            assert not any(a[slot] for a in self._words), f"free slot {slot}"

    def _count(self, what: str, **fields: object) -> None:
        value = getattr(self.stats, what) + 1
        setattr(self.stats, what, value)
        # Log the 1st, 2nd, 4th, 8th... occurrence: visible, but a flood cannot drown the log.
        if value & (value - 1) == 0:
            log.warning("kv_event_tolerated", problem=what, occurrences=value, **fields)
