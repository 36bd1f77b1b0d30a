"""Agent branches and their block counts: Algorithms E.1 and E.2 of the paper.

For each branch ``β`` the table keeps its version ``v_β``, the path ``π_β`` of its last
request, and on each node the blocks it counts there, ``C[β, n]``. For each node and block,
``R[b, n]`` is the number of active branches whose ``C[β, n]`` contains ``b``.

Representation (why it is cheap): within one version a branch's paths only grow, and a
rewrite trims every ``C[β, m]`` to the prefix it shares with the new path (E.2 line 7). So
``C[β, n]`` is always ``π_β[:k] − holes``: a prefix length ``k`` per node plus the few blocks
of that prefix the node evicted (E.2 line 20). An appended request then costs O(new blocks),
a release O(k), and nothing ever walks the whole context to diff two sets.

Eviction hints: every time ``R[b, n]`` crosses zero the table notes the block for node
``n``'s next hint, and a block that crosses back before then drops its note (the node's view
of it is right again), so a driver pushes just the blocks whose count became positive or zero
since the last hint, in the order they were noted (the engines evict in that order).

The counts, the paths' hashes and the notes live in the native core
(``evinfra/native/src/branches.cpp``), one call per operation; this shell hashes the
requests, keeps each branch's :class:`HashedPath` and maps branch ids to native handles.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from evinfra.core.contracts import HintDelta
from evinfra.core.hashing import HashedPath, PathHasher
from evinfra.core.types import BlockHash, BranchId, Phase
from evinfra.errors import UnknownBranchError
from evinfra.native import _native

__all__ = ["BranchStep", "BranchTable", "HintDelta"]

# The native table compares phases only for equality (E.2 line 11): it stores their index here.
_PHASES = tuple(Phase)
_CODES = {p: i for i, p in enumerate(_PHASES)}


class BranchStep(msgspec.Struct, frozen=True):
    """Output of Algorithm E.1 for one request."""

    branch: BranchId
    version: int
    rewritten: bool
    path: HashedPath
    old_len: int
    """``len(π_old)`` in blocks."""


class _Branch:
    __slots__ = ("handle", "path")

    def __init__(self, handle: int, path: HashedPath) -> None:
        self.handle = handle
        self.path = path


class BranchTable:
    """The branch table ``S`` and the counts ``R`` (Algorithms E.1, E.2)."""

    def __init__(self, page_size: int, phases: Sequence[Phase] = ()) -> None:
        self.hasher = PathHasher(page_size)
        self._table = _native.BranchTable()
        self._branches: dict[BranchId, _Branch] = {}
        self._ids: dict[int, BranchId] = {}  # native handle -> branch
        for p in phases:
            self.add_node(p)

    # -- nodes ---------------------------------------------------------------------------

    def add_node(self, phase: Phase) -> int:
        return self._table.add_node(_CODES[phase])

    def phase(self, node: int) -> Phase:
        return _PHASES[self._table.phase(node)]

    # -- queries -------------------------------------------------------------------------

    def __contains__(self, branch: BranchId) -> bool:
        return branch in self._branches

    def __len__(self) -> int:
        return len(self._branches)

    def branches(self) -> list[BranchId]:
        return list(self._branches)

    def version(self, branch: BranchId) -> int:
        return self._table.version(self._get(branch).handle)

    def path(self, branch: BranchId) -> HashedPath:
        return self._get(branch).path

    def nodes_of(self, branch: BranchId) -> list[int]:
        """``N_β``: the nodes where the branch holds counts (ascending)."""
        return self._table.nodes_of(self._get(branch).handle)

    def branches_on(self, node: int) -> set[BranchId]:
        ids = self._ids
        return {ids[h] for h in self._table.branches_on(node)}

    def counted(self, branch: BranchId, node: int) -> set[BlockHash]:
        """``C[β, n]`` as a set (tests and status; O(k))."""
        return set(self._table.counted(self._get(branch).handle, node))

    def count(self, block: BlockHash, node: int) -> int:
        """``R[b, n]``."""
        return self._table.count(block, node)

    def counts(self, node: int) -> dict[BlockHash, int]:
        """The positive counts of a node, as a new dict (tests and status; O(blocks))."""
        return self._table.counts(node)

    @property
    def native(self) -> _native.BranchTable:
        """The native table: a tree's batch hands it the blocks a node lost (E.2 line 20)."""
        return self._table

    def waiting(self, node: int) -> int:
        """How many blocks wait for the node's next hint."""
        return self._table.waiting(node)

    # -- Algorithm E.1 (and E.2 lines 5-8) ----------------------------------------------

    def step(self, branch: BranchId, tokens: np.ndarray | Sequence[int],
             parent: BranchId | None = None) -> BranchStep:
        """Register a request of ``branch`` and return ``(v_β, π_old, π_new)``.

        A new branch (forked or a sub-agent when ``parent`` is known) starts at version 1
        with an empty previous path; its tokens are hashed against the parent's last path so
        a fork pays only for its new pages (a fresh context, against the last path that
        starts with the same page: a shared system prompt). A rewritten context bumps the
        version and trims the branch's counts on every node to the prefix the new path
        keeps (E.2 line 7).
        """
        b = self._branches.get(branch)
        if b is None:
            base = self._branches.get(parent) if parent is not None else None
            path = self.hasher.start(tokens, base.path if base is not None else None)
            handle = self._table.add_branch(path.hashes)
            self._branches[branch] = _Branch(handle, path)
            self._ids[handle] = branch
            return BranchStep(branch, 1, False, path, 0)
        old_len = len(b.path)
        # Hashed against the branch's own last path, the new one starts with ``shared`` of its
        # blocks: the native table reads only the pages past them (O(new pages)).
        path = self.hasher.hash(tokens, b.path)
        keep = path.shared
        version = self._table.step(b.handle, keep, path.hashes)
        b.path = path
        return BranchStep(branch, version, keep < old_len, path, old_len)

    # -- Algorithm E.2 --------------------------------------------------------------------

    def place(self, branch: BranchId, node: int) -> None:
        """E.2 lines 9-10: ``Count(β, n, π_β)``: new blocks +1, reused blocks keep counts.

        ``C[β, n]`` is a prefix of ``π_β`` (minus holes), so ``π_β \\ C`` is the tail past
        ``k`` plus the holes; ``C \\ π_β`` is empty."""
        self._table.place(self._get(branch).handle, node)

    def settle(self, branch: BranchId, node: int) -> list[int]:
        """E.2 line 11: ``node`` now holds the branch's current version, so the branch's
        counts on other nodes of the same phase are released (a P2P or D2D move). Nodes of
        the other phase keep theirs (line 12). Returns the released nodes, in the order the
        branch was placed on them."""
        return self._table.settle(self._get(branch).handle, node)

    def end(self, branch: BranchId) -> None:
        """E.2 line 13: release every count of the branch and forget it."""
        b = self._branches.pop(branch, None)
        if b is None:
            raise UnknownBranchError(branch)
        del self._ids[b.handle]
        self._table.end(b.handle)

    def switch_phase(self, node: int, phase: Phase) -> None:
        """E.2 lines 14-15: D->P resets the node's counts to free its memory; a switch to
        decode (or out of the collocated warm-up) keeps them to preserve its KV."""
        old = self.phase(node)
        self._table.set_phase(node, _CODES[phase])
        if old is Phase.DECODE and phase is Phase.PREFILL:
            self.release_node(node)

    def release_node(self, node: int) -> None:
        """``Release(β, n)`` for every branch on ``node`` (a D->P switch, a lost node)."""
        self._table.release_node(node)

    def evicted(self, node: int, blocks: Sequence[BlockHash]) -> None:
        """E.2 line 20: the node lost these blocks; zero their counts and remove them from
        every ``C[β, n]``. Only positive-count blocks cost anything beyond a hash probe."""
        self._table.evicted(node, blocks)

    # -- hints ------------------------------------------------------------------------------

    def take_hints(self, node: int) -> HintDelta:
        """Blocks whose count on ``node`` crossed zero since the last call (and not back)."""
        positive, zero = self._table.take_hints(node)
        return HintDelta(positive, zero)

    def hinted_nodes(self) -> list[int]:
        """Nodes with hints waiting to be taken (ascending)."""
        return self._table.hinted_nodes()

    # -- internals --------------------------------------------------------------------------

    def _get(self, branch: BranchId) -> _Branch:
        b = self._branches.get(branch)
        if b is None:
            raise UnknownBranchError(branch)
        return b
