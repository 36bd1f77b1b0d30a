"""The cluster KV directory: the prefix tree plus the agent-branch counts (paper 4.3).

:class:`Directory` is the single entry point the router, the service and the tests use. It
keeps the tree (where each block is) and the branch table (who still needs it) consistent:
a block a node loses in every tier is removed from the counts there (E.2 line 20), a node's
phase switch follows E.2 lines 14-15, and a lost node releases everything it held.

Pure and synchronous; time is passed in.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from evinfra.core.contracts import HintDelta
from evinfra.core.events import KVEvent, KVEventBatch
from evinfra.core.hashing import HashedPath
from evinfra.core.types import BlockHash, BranchId, NodeId, Phase, Tier
from evinfra.directory.branches import BranchStep, BranchTable
from evinfra.directory.tree import PrefixMatch, PrefixTree
from evinfra.errors import ConfigError

__all__ = ["Directory"]


class Directory:
    """Where every KV block is, per node and tier, and how many active branches need it."""

    def __init__(self, nodes: Mapping[NodeId, Phase] | Iterable[tuple[NodeId, Phase]],
                 page_size: int) -> None:
        if page_size <= 0:
            raise ConfigError("page_size must be positive", key="page_size")
        items = list(nodes.items()) if isinstance(nodes, Mapping) else list(nodes)
        self.page_size = page_size
        self.tree = PrefixTree([n for n, _ in items], page_size)
        self.branches = BranchTable(page_size, [p for _, p in items])
        self._counts = self.branches.native  # what the tree's batches hand lost blocks to

    # -- nodes -----------------------------------------------------------------------------

    @property
    def nodes(self) -> list[NodeId]:
        return self.tree.nodes

    def index(self, node: NodeId) -> int:
        idx = self.tree.node_index(node)
        if idx is None:
            raise KeyError(node)
        return idx

    def add_node(self, node: NodeId, phase: Phase) -> int:
        if self.tree.node_index(node) is not None:
            return self.index(node)
        idx = self.tree.add_node(node)
        assert self.branches.add_node(phase) == idx
        return idx

    def holders(self, block: BlockHash) -> Iterable[int]:
        """The nodes (by index) that hold ``block`` in some tier."""
        return self.tree.holders(block)

    def holds(self, block: BlockHash, idx: int) -> bool:
        return self.tree.holds(block, idx)

    def phase(self, node: NodeId) -> Phase:
        return self.branches.phase(self.index(node))

    def switch_phase(self, node: NodeId, phase: Phase) -> None:
        """E.2 lines 14-15. The node's KV stays in the tree, readable by every node."""
        self.branches.switch_phase(self.index(node), phase)

    def node_lost(self, node: NodeId) -> int:
        """A node crashed or was relaunched empty: drop its blocks and its counts."""
        idx = self.index(node)
        lost = self.tree.clear(idx)
        self.branches.release_node(idx)
        return len(lost)

    def view_lost(self, node: NodeId) -> int:
        """The driver's view of the node's KV broke (:class:`~evinfra.core.events.
        NodeKVViewLost`): forget what the tree lists there, so that nothing is routed to KV
        the node may have dropped meanwhile, and keep its counts and hints (no eviction was
        seen). Returns the blocks forgotten."""
        return len(self.tree.clear(self.index(node)))

    # -- KV events -------------------------------------------------------------------------

    def apply(self, node: NodeId, event: KVEvent) -> None:
        self.tree.apply_batch(node, [event], self._counts)

    def apply_batch(self, node: NodeId, batch: KVEventBatch) -> None:
        """Apply a node's events in order, in one native call that also zeroes the counts of
        the blocks the node lost (E.2 line 20): those it holds nowhere once the batch is
        applied (a block cleared and stored again, as in a resync, keeps its counts)."""
        self.tree.apply_batch(node, batch.events, self._counts)

    # -- requests and branches (Algorithms E.1, E.2) ---------------------------------------

    def step(self, branch: BranchId, tokens: np.ndarray | Sequence[int],
             parent: BranchId | None = None) -> BranchStep:
        """Algorithm E.1 for a request of ``branch`` (plus E.2 lines 5-8 on a rewrite)."""
        return self.branches.step(branch, tokens, parent)

    def match(self, path: Sequence[BlockHash] | HashedPath) -> PrefixMatch:
        return self.tree.match(path)

    def place(self, branch: BranchId, node: NodeId) -> None:
        """E.2 lines 9-10: the branch's request was routed (prefill) or bound (decode) to
        ``node``."""
        self.branches.place(branch, self.index(node))

    def settle(self, branch: BranchId, node: NodeId) -> list[NodeId]:
        """E.2 line 11: ``node`` holds the current version; same-phase copies are released."""
        released = self.branches.settle(branch, self.index(node))
        return [self.tree.node_name(m) for m in released]

    def __contains__(self, branch: BranchId) -> bool:
        """``branch`` is live: stepped (E.1) and not ended."""
        return branch in self.branches

    def branch_nodes(self, branch: BranchId) -> list[int]:
        """``N_β``: the indexes of the nodes where ``branch`` counts blocks (E.2 line 3)."""
        return self.branches.nodes_of(branch)

    def branch_counts(self, branch: BranchId) -> dict[NodeId, int]:
        """How many blocks ``branch`` counts on each node it is on (``|C[β, n]|``)."""
        return {self.nodes[i]: len(self.branches.counted(branch, i))
                for i in self.branches.nodes_of(branch)}

    def end(self, branch: BranchId) -> None:
        """E.2 line 13 (raises :class:`~evinfra.errors.UnknownBranchError`)."""
        self.branches.end(branch)

    def take_hints(self, node: NodeId) -> HintDelta:
        return self.branches.take_hints(self.index(node))

    def take_all_hints(self) -> list[tuple[NodeId, HintDelta]]:
        """Every node's waiting hints (nodes without any are left out)."""
        out = []
        for i in self.branches.hinted_nodes():
            delta = self.branches.take_hints(i)
            if delta.positive or delta.zero:  # crossings that cancelled leave nothing to say
                out.append((self.tree.node_name(i), delta))
        return out

    def positive_blocks(self, node: NodeId) -> list[BlockHash]:
        """Every block with ``R[b, n] > 0``."""
        return sorted(self.branches.counts(self.index(node)))

    def full_hints(self, node: NodeId) -> HintDelta:
        """The node's whole positive set as one ``replace`` hint, for an engine whose marks
        may be stale (it came back): it supersedes the notes waiting for the node."""
        self.branches.take_hints(self.index(node))
        return HintDelta(self.positive_blocks(node), [], replace=True)

    # -- reporting -------------------------------------------------------------------------

    def summary(self) -> dict[str, object]:
        """Numbers for ``/v1/evinfra/status`` and metrics."""
        per_node = {}
        for idx, name in enumerate(self.tree.nodes):
            per_node[name] = {
                "phase": self.branches.phase(idx).value,
                "blocks": self.tree.held(idx),
                "host_blocks": self.tree.held(idx, Tier.L2),
                "positive_count_blocks": len(self.branches.counts(idx)),
                "branches": len(self.branches.branches_on(idx)),
            }
        return {
            "blocks": len(self.tree),
            "entries": self.tree.entries(),
            "active_branches": len(self.branches),
            "nodes": per_node,
            "events": {f: getattr(self.tree.stats, f) for f in self.tree.stats.__struct_fields__},
        }

    def check_invariants(self) -> None:
        self.tree.check_invariants()
