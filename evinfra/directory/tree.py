"""The cluster-wide prefix tree of KV blocks (paper 4.3, Appendix A.3).

A block is keyed by its page-chained hash, so the hash alone names a block *and* its whole
prefix: the tree needs no child pointers to answer "how long a prefix of this path does node
n hold". The tables live in the native core (``evinfra/native/src/tree.cpp``): each block has
a slot with a holder bitmap per tier (L1, GPU; L2, host), one bit per node, and a prefix walk
is a hash probe per block and a running AND of the bitmaps. No per-(block, node) access time
is kept: host eviction is each engine's (paper 5.3: "each node evicts the blocks in its host
memory"), which knows its own LRU order.

Engines feed the tree with their KV events (SGLang schema). Bad events never raise: unknown
parents, removals of blocks the node does not hold, duplicate hashes and untracked media are
counted in :class:`TreeStats` and logged at powers of two, and the tree stays consistent.

When a node stops holding a block in every tier, the block is *lost* on that node: its branch
counts there are zeroed (Algorithm E.2 line 20). A batch is one step of the engine, so a block
is lost if the node holds it nowhere at the batch's end: an engine's resync (a clear, then its
whole cache stored again, in one batch) loses only what it does not store again.
``directory.Directory`` hands its batches the branch table, and the native batch passes the
lost blocks on itself.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import msgspec
import structlog

from evinfra.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from evinfra.core.hashing import HashedPath
from evinfra.core.types import BlockHash, NodeId, Tier
from evinfra.native import _native

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


_CLEARED = AllBlocksCleared()


class PrefixTree:
    """Blocks by hash and their holders per (node, tier), in the native core; nodes by a
    small index. The shell keeps the node names, the tolerated-event counters and their
    log lines."""

    def __init__(self, nodes: Iterable[NodeId], page_size: int) -> None:
        self.page_size = page_size
        self._unknown_node = 0
        self._tree = _native.Tree(page_size, BlockStored, BlockRemoved, AllBlocksCleared)
        self._index: dict[NodeId, int] = {}
        self._names: list[NodeId] = []
        for n in nodes:
            self.add_node(n)

    # -- nodes -------------------------------------------------------------------------------

    def add_node(self, node: NodeId) -> int:
        if node not in self._index:
            self._index[node] = self._tree.add_node()
            self._names.append(node)
        return self._index[node]

    def node_index(self, node: NodeId) -> int | None:
        return self._index.get(node)

    def node_name(self, index: int) -> NodeId:
        return self._names[index]

    @property
    def nodes(self) -> list[NodeId]:
        return list(self._names)

    # -- queries -----------------------------------------------------------------------------

    @property
    def stats(self) -> TreeStats:
        """Counters of applied and tolerated events (a snapshot)."""
        return TreeStats(**self._tree.counts(), unknown_node=self._unknown_node)

    def __len__(self) -> int:
        return len(self._tree)

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._tree

    def tiers(self, block: BlockHash, node: int) -> set[Tier]:
        l1, l2 = self._tree.tiers(block, node)
        return {t for t, held in ((Tier.L1, l1), (Tier.L2, l2)) if held}

    def holds(self, block: BlockHash, node: int) -> bool:
        return any(self._tree.tiers(block, node))

    def holders(self, block: BlockHash) -> list[int]:
        """Indexes of the nodes holding ``block`` in any tier."""
        return self._tree.holders(block)

    def blocks_on(self, node: int) -> set[BlockHash]:
        """The node's blocks (a scan of the slots: status and tests)."""
        return set(self._tree.blocks_on(node))

    def held(self, node: int, tier: Tier | None = None) -> int:
        """Number of blocks the node holds in ``tier`` (None: in either)."""
        return self._tree.held(node, 2 if tier is None else int(tier is Tier.L1))

    def entries(self) -> int:
        """Number of (block, node) entries."""
        return self._tree.entries()

    def memory(self) -> int:
        """Bytes of the native tables (the bench's bytes per entry)."""
        return self._tree.memory()

    def match(self, path: Sequence[BlockHash] | HashedPath) -> PrefixMatch:
        """Longest prefix of ``path`` per node (any tier, and L1) and across the cluster: one
        native walk, a hash probe per block until a block no node holds. A
        :class:`HashedPath` is read as its int64 array, with no conversion per block."""
        return PrefixMatch(*self._tree.match(path.array if isinstance(path, HashedPath) else path))

    # -- KV events ---------------------------------------------------------------------------

    def apply(self, node: NodeId, event: KVEvent) -> list[BlockHash]:
        """Apply one KV event of ``node``; return the blocks the node lost entirely."""
        return self.apply_batch(node, [event])

    def apply_batch(self, node: NodeId, events: Sequence[KVEvent],
                    counts: _native.BranchTable | None = None) -> list[BlockHash]:
        """Apply a node's KV events in order, in one native call; return the blocks the node
        lost entirely, in order. Given the directory's native branch table (``counts``,
        :attr:`BranchTable.native`), the same call hands it those blocks instead (E.2 line
        20, :meth:`BranchTable.evicted`), so they never become Python objects, and returns
        none."""
        idx = self._index.get(node)
        if idx is None:
            for _ in events:
                self._unknown_node += 1
                _tolerated("unknown_node", self._unknown_node, node=node)
            return []
        lost, problems = self._tree.apply_batch(idx, events, counts)
        if problems is not None:
            for what, occurrences, fields in problems:
                _tolerated(what, occurrences, node=node, **fields)
        return lost

    def clear(self, node: int) -> list[BlockHash]:
        """The node dropped everything (a crash, a relaunch); its blocks, in the order they
        got their slots."""
        return self._tree.apply_batch(node, [_CLEARED])[0]

    # -- checks ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the map, the slots, the holder bits and the held counts agree (tests)."""
        try:
            self._tree.check()
        except RuntimeError as e:
            raise AssertionError(str(e)) from None


def _tolerated(what: str, occurrences: int, **fields: object) -> None:
    """Log the 1st, 2nd, 4th, 8th... occurrence of a tolerated problem (the native core
    reports only those): visible, but a flood cannot drown the log."""
    if occurrences & (occurrences - 1) == 0:
        log.warning("kv_event_tolerated", problem=what, occurrences=occurrences, **fields)
