"""The cluster-wide prefix tree of KV blocks (paper 4.3, Appendix A.3).

A block is keyed by its page-chained hash, so the hash alone names a block *and* its whole
prefix: the tree needs no child pointers to answer "how long a prefix of this path does node
n hold". Each block has a *slot* in numpy tables: its hash and its holder bits, three per
node (it holds the block in L2, host; in L1, GPU; in either tier), packed 21 nodes to an
int64 word. A prefix walk is then a gather of the path's words and a cumulative AND down
them, whatever the number of nodes. No per-(block, node) access time is kept: host eviction
is each engine's (paper 5.3: "each node evicts the blocks in its host memory"), which knows
its own LRU order; a dense ``T_b`` table here cost 8 bytes per slot and node (1 GB at 64
nodes) for nothing the control plane reads.

Why slots: looking a long path up by hash costs a dict probe per block (a cache miss in a
large directory), which dominated the router's decision. A path remembers the slots its
blocks had (``HashedPath.memo``, inherited by the branch's next path for the pages they
share), so a lookup checks the remembered slots against the blocks' hashes, vectorised,
and probes the dict only for new pages. An event names its blocks by hash, but blocks stored
together get consecutive slots and tend to move together (a chunk, a transfer, an evicted
leaf), so an event tries the slot after its previous block's first, and probes the dict only
where that misses; then it sets their bits one by one.

Engines feed the tree with their KV events (SGLang schema). Bad events never raise: unknown
parents, removals of blocks the node does not hold, duplicate hashes and untracked media are
counted in :class:`TreeStats` and logged at powers of two, and the tree stays consistent.

When a node stops holding a block in every tier, the block is *lost* on that node: the caller
(``directory.Directory``) zeroes the block's branch counts there (Algorithm E.2 line 20).
"""

from __future__ import annotations

from itertools import repeat
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


_PER_WORD = 21  # nodes per int64 word: bits j (L2), 21 + j (L1) and 42 + j (either tier)


class PrefixTree:
    """Blocks by hash, each in a slot of packed holder bits; nodes by a small index."""

    def __init__(self, nodes: Iterable[NodeId], page_size: int) -> None:
        self.page_size = page_size
        self.stats = TreeStats()
        self._slot: dict[BlockHash, int] = {}
        self._free: list[int] = []
        # Slot 0 is never a block's: what a path's unknown blocks point at (no holders).
        self._top = 1
        # Per slot, its block's hash and the holder bits, word-major: ``_words[w][s]`` packs
        # the three tiers of nodes 21w..21w+20. Numpy arrays, which a lookup gathers along a
        # path at once; events update them item by item through memoryviews (``_hash``,
        # ``_bits``), about twice as fast per item as numpy's own indexing.
        self._hash_np = np.zeros(1024, np.int64)
        self._words = [np.zeros(1024, np.int64)]
        self._views()
        self._index: dict[NodeId, int] = {}
        self._names: list[NodeId] = []
        for n in nodes:
            self.add_node(n)

    # -- nodes -------------------------------------------------------------------------------

    def add_node(self, node: NodeId) -> int:
        if node in self._index:
            return self._index[node]
        if len(self._names) == _PER_WORD * len(self._words):
            self._words.append(np.zeros(len(self._hash_np), np.int64))
            self._views()
        self._index[node] = len(self._names)
        self._names.append(node)
        return self._index[node]

    def node_index(self, node: NodeId) -> int | None:
        return self._index.get(node)

    def node_name(self, index: int) -> NodeId:
        return self._names[index]

    @property
    def nodes(self) -> list[NodeId]:
        return list(self._names)

    @staticmethod
    def _bits_of(node: int) -> tuple[int, int, int, int]:
        """The word of ``node`` and its L2, L1 and either-tier bits there."""
        w, j = divmod(node, _PER_WORD)
        return w, 1 << j, 1 << (_PER_WORD + j), 1 << (2 * _PER_WORD + j)

    # -- slots -------------------------------------------------------------------------------

    def _views(self) -> None:
        self._hash = memoryview(self._hash_np)
        self._bits = [memoryview(t) for t in self._words]

    def _grow(self) -> None:
        """Double the slot tables."""
        pad = np.zeros(len(self._hash_np), np.int64)
        self._hash_np = np.concatenate([self._hash_np, pad])
        self._words = [np.concatenate([t, pad]) for t in self._words]
        self._views()

    def _unused(self, s: int) -> bool:
        """No node holds the block in slot ``s``."""
        return not any(t[s] for t in self._bits)

    # -- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._slot

    def tiers(self, block: BlockHash, node: int) -> set[Tier]:
        w, l2, l1, _ = self._bits_of(node)
        m = self._bits[w][self._slot.get(block, 0)]
        out = set()
        if m & l1:
            out.add(Tier.L1)
        if m & l2:
            out.add(Tier.L2)
        return out

    def holds(self, block: BlockHash, node: int) -> bool:
        w, _, _, either = self._bits_of(node)
        return bool(self._bits[w][self._slot.get(block, 0)] & either)

    def holders(self, block: BlockHash) -> list[int]:
        """Indexes of the nodes holding ``block`` in any tier."""
        s = self._slot.get(block, 0)
        return [i for i in range(len(self._names))
                if self._bits[i // _PER_WORD][s] >> (2 * _PER_WORD + i % _PER_WORD) & 1]

    def blocks_on(self, node: int) -> set[BlockHash]:
        """The node's blocks (a scan of the slots: status and tests)."""
        return set(self._hash_np[self._held(node, 2)].tolist())

    def _held(self, node: int, tier: int) -> np.ndarray:
        """Slots whose block the node holds in L2 (``tier`` 0), L1 (1) or either (2)."""
        w, j = divmod(node, _PER_WORD)
        return (self._words[w][:self._top] >> (tier * _PER_WORD + j) & 1).nonzero()[0]

    def held(self, node: int, tier: Tier | None = None) -> int:
        """Number of blocks the node holds in ``tier`` (None: in either)."""
        return int(self._held(node, 2 if tier is None else int(tier is Tier.L1)).size)

    def entries(self) -> int:
        """Number of (block, node) entries."""
        return sum(self.held(i) for i in range(len(self._names)))

    def match(self, path: Sequence[BlockHash] | HashedPath) -> PrefixMatch:
        """Longest prefix of ``path`` per node (any tier, and L1) and across the cluster.

        The path's words are gathered and folded with a cumulative AND down the path, which
        is non-increasing; a node's prefix ends where its bit leaves the fold, found at the
        fold's changes (at most two per node). A :class:`HashedPath` brings its slots from
        its last lookup (or its base path's): they are checked against the blocks' hashes
        at once, and only blocks that moved, or are new, are looked up by hash.
        """
        slots, union, gathered = self._slots(path)
        n = len(self._names)
        own = [0] * n
        own_l1 = [0] * n
        if union:
            if gathered is None:
                rows = slots[:union]
                gathered = [t[rows] for t in self._words]
            for w, words in enumerate(gathered):
                self._prefixes(words[:union], _PER_WORD * w, union, own, own_l1)
        return PrefixMatch(union, own, own_l1)

    def _slots(self, path: Sequence[BlockHash] | HashedPath
               ) -> tuple[np.ndarray, int, list[np.ndarray] | None]:
        """The slots of the path's blocks, the number of leading blocks some node holds (the
        slots past those are not meaningful) and, when a memo gave the slots, each word
        table gathered along them (the lookup's own check reads them; None: not gathered)."""
        if not isinstance(path, HashedPath):
            return (*self._lookup(path), None)
        if path.memo is not None:
            got = self._recheck(path)
            if got is not None:
                return got
        slots, union = self._lookup(path.hashes)
        path.memo = (slots, self._hash_np[slots])
        return slots, union, None

    def _lookup(self, hashes: Sequence[BlockHash]) -> tuple[np.ndarray, int]:
        """:meth:`_slots` by hash, a dict probe per block (0: held nowhere). (Here and below
        ``ndarray.nonzero``, not ``np.flatnonzero``: the latter's Python wrapper costs more
        than the search itself on a path.)"""
        slots = np.fromiter(map(self._slot.get, hashes, repeat(0)), np.intp, len(hashes))
        missing = (slots == 0).nonzero()[0]
        return slots, int(missing[0]) if missing.size else len(hashes)

    def _recheck(self, path: HashedPath) -> tuple[np.ndarray, int, list[np.ndarray]] | None:
        """:meth:`_slots` from the path's memo: ``known[i]`` is the hash slot ``slots[i]``
        had when it was found (new pages start at slot 0, which no node holds). A slot is
        still the block's if it holds that hash and some node holds it (a freed slot's hash
        is 0, a block's hash may be too). None if the memo is another directory's."""
        hashes = path.hashes
        L = len(hashes)
        slots, known = path.memo
        if len(slots) < L:
            slots = np.concatenate([slots, np.zeros(L - len(slots), np.intp)])
            known = np.concatenate([known, np.zeros(L - len(known), np.int64)])
        try:
            gathered = [t[slots] for t in self._words]
            stale = self._hash_np[slots] != known
        except IndexError:  # slots past this directory's tables
            return None
        held = gathered[0]
        for words in gathered[1:]:
            held = held | words
        stale |= held == 0
        stale_at = stale.nonzero()[0]
        path.memo = (slots, known)
        # Usually a few new pages, the first of them held nowhere yet: look them up one by
        # one up to that. Many moved blocks are looked up in one go.
        get = self._slot.get
        for i in stale_at[:16].tolist():
            h = hashes[i]
            s = get(h)
            if s is None:
                return slots, i, gathered
            slots[i], known[i] = s, h
            for words, t in zip(gathered, self._words):
                words[i] = t[s]
        if stale_at.size <= 16:
            return slots, L, gathered
        at = stale_at[16:]
        found, union = self._lookup([hashes[i] for i in at.tolist()])
        slots[at] = found
        known[at] = self._hash_np[found]
        for words, t in zip(gathered, self._words):
            words[at] = t[found]
        return slots, int(at[union]) if union < len(at) else L, gathered

    @staticmethod
    def _prefixes(words: np.ndarray, base: int, union: int, own: list[int],
                  own_l1: list[int]) -> None:
        """For the nodes of one word (from ``base`` on), the leading path blocks held in
        either tier (``own``) and in L1 (``own_l1``); ``words`` is that word along the path."""
        if not words[0]:
            return
        acc = np.bitwise_and.accumulate(words)
        prev = int(acc[0])
        for j in [*((acc[1:] != acc[:-1]).nonzero()[0] + 1).tolist(), union]:
            now = int(acc[j]) if j < union else 0  # bits alive to the end die at union
            dead = (prev & ~now) >> _PER_WORD  # L2 bits do not matter
            while dead:
                low = dead & -dead
                bit = low.bit_length() - 1
                if bit >= _PER_WORD:
                    own[base + bit - _PER_WORD] = j
                else:
                    own_l1[base + bit] = j
                dead ^= low
            prev = now

    # -- KV events ---------------------------------------------------------------------------

    def apply(self, node: NodeId, event: KVEvent) -> list[BlockHash]:
        """Apply one KV event of ``node``; return the blocks the node lost entirely."""
        idx = self._index.get(node)
        if idx is None:
            self._count("unknown_node", node=node)
            return []
        if type(event) is BlockStored:
            self.store(idx, event.block_hashes, event.parent_block_hash, event.medium,
                       block_size=event.block_size)
            return []
        if type(event) is BlockRemoved:
            return self.remove(idx, event.block_hashes, event.medium)
        if type(event) is AllBlocksCleared:
            return self.clear(idx)
        raise TypeError(f"not a KV event: {event!r}")

    def store(self, node: int, hashes: Sequence[BlockHash], parent: BlockHash | None,
              medium: str | None, *, block_size: int | None = None,
              through: bool = False) -> None:
        """Apply a ``BlockStored``. With ``through``, the event is a GPU store followed by an
        identical one in host memory (an engine's write-through): both are applied, and
        counted, in one pass over the blocks."""
        tier = Tier.from_medium(medium)
        if tier is None:
            self._count("untracked_medium", medium=medium)
            return
        events = 2 if through else 1
        # A chained hash cannot repeat within one path: such an event is corrupt. Storing a
        # block twice is idempotent, so it is applied and counted. (The host event's parent
        # is unknown only if the GPU event did not store it.)
        duplicate = len(hashes) > 1 and len(set(hashes)) != len(hashes)
        orphan = parent is not None and parent not in self._slot
        for second in range(events):
            if block_size is not None and block_size != self.page_size:
                self._count("block_size_mismatch", block_size=block_size,
                            page_size=self.page_size)
            if orphan and not (second and parent in hashes):
                self._count("unknown_parent", node=self._names[node], parent=parent)
            if duplicate:
                self._count("duplicate_hash", node=self._names[node])
        slot, free, table = self._slot, self._free, self._hash
        w, l2, l1, either = self._bits_of(node)
        bits = either | (l1 | l2 if through else l1 if tier is Tier.L1 else l2)
        words = self._bits[w]
        get = slot.get
        top, cap = self._top, len(table)
        s = 0
        for h in hashes:
            # Blocks stored together got consecutive slots: try the one after the last
            # block's before the dict (a cache miss or more in a large directory). A free
            # slot's hash is 0, so a match is the block's live slot (0 itself never matches).
            s += 1
            if s >= top or table[s] != h or not h:
                s = get(h)
                if s is None:
                    if free:
                        s = free.pop()
                    else:
                        if top == cap:
                            self._grow()
                            table, words, cap = self._hash, self._bits[w], len(self._hash)
                        s = top
                        top += 1
                    table[s] = h
                    slot[h] = s
            words[s] |= bits
        self._top = top
        self.stats.blocks_stored += events * len(hashes)

    def remove(self, node: int, hashes: Sequence[BlockHash], medium: str | None) -> list[BlockHash]:
        tier = Tier.from_medium(medium)
        if tier is None:
            self._count("untracked_medium", medium=medium)
            return []
        w, l2, l1, either = self._bits_of(node)
        bit, other = (l1, l2) if tier is Tier.L1 else (l2, l1)
        # The masks that clear the tier's bit, and it and the either-tier bit.
        keep_tier, keep_none = ~bit, ~(bit | either)
        slot, table = self._slot, self._hash
        words, get = self._bits[w], slot.get
        others = [t for t in self._bits if t is not words]  # a block is free once all are 0
        lost: list[BlockHash] = []
        freed: list[int] = []
        removed = len(hashes)
        top = self._top
        s = 0
        for h in hashes:
            s += 1
            if s >= top or table[s] != h or not h:  # see store
                s = get(h, 0)
            m = words[s]
            if not m & bit:
                self._count("unknown_removal", node=self._names[node], block=h)
                removed -= 1
                continue
            if m & other:
                words[s] = m & keep_tier
                continue
            m &= keep_none
            words[s] = m
            lost.append(h)
            if m:
                continue
            for t in others:  # inlined _unused: a call per lost block shows at 64 nodes
                if t[s]:
                    break
            else:
                del slot[h]
                table[s] = 0
                freed.append(s)
        self._release(freed)
        self.stats.blocks_removed += removed
        return lost

    def clear(self, node: int) -> list[BlockHash]:
        """The node dropped everything (``AllBlocksCleared``, a crash, a relaunch)."""
        w, l2, l1, either = self._bits_of(node)
        keep = ~(l2 | l1 | either)
        words, slot, table = self._bits[w], self._slot, self._hash
        single = len(self._bits) == 1
        held = self._held(node, 2)
        lost = self._hash_np[held].tolist()
        freed = []
        for s in held.tolist():
            m = words[s] & keep
            words[s] = m
            if not m and (single or self._unused(s)):
                del slot[table[s]]
                table[s] = 0
                freed.append(s)
        self._release(freed)
        self.stats.clears += 1
        return lost

    def _release(self, freed: list[int]) -> None:
        """Free the slots (their hashes already zeroed), to be handed out lowest first: a
        block run freed together and stored again gets consecutive slots again."""
        freed.sort(reverse=True)
        self._free.extend(freed)

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the holder bits and the slots agree (tests)."""
        live = set(self._slot.values())
        assert 0 not in live, "slot 0 is reserved"
        assert len(live) == len(self._slot), "two blocks share a slot"
        assert live.isdisjoint(self._free) and len(set(self._free)) == len(self._free)
        assert len(live) + len(self._free) == self._top - 1, "a slot leaked"
        assert all(len(t) == len(self._hash) for t in self._bits)
        assert all(t.obj is a for t, a in zip(self._bits, self._words))
        assert self._hash.obj is self._hash_np
        for s in [0, *self._free]:
            assert not any(t[s] for t in self._bits), f"free slot {s} has holders"
            assert not self._hash[s], f"free slot {s} keeps a hash"
        for h, s in self._slot.items():
            assert self._hash[s] == h, f"slot {s} of {h} holds {self._hash[s]}"
            assert any(t[s] for t in self._bits), f"block {h} held by no node"
            for idx in range(len(self._names)):
                w, l2, l1, either = self._bits_of(idx)
                m = self._bits[w][s]
                assert bool(m & either) == bool(m & (l1 | l2)), f"{h} on {idx}: tier bits"

    def _count(self, what: str, **fields: object) -> None:
        value = getattr(self.stats, what) + 1
        setattr(self.stats, what, value)
        # Log the 1st, 2nd, 4th, 8th... occurrence: visible, but a flood cannot drown the log.
        if value & (value - 1) == 0:
            log.warning("kv_event_tolerated", problem=what, occurrences=value, **fields)
