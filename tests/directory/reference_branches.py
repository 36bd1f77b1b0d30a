"""The branch table as it was in Python before the native core (issue 37), kept as the oracle
of ``tests/property/test_branch_table_machine.py``: the native table must give the same
counts, the same answers and the same hint deltas, blocks in the same order (the engines
evict in that order, so the simulation reports depend on it). Never used by the control plane.

Algorithms E.1 and E.2 of the paper; see ``evinfra/directory/branches.py`` for the
representation (``C[β, n]`` as a prefix length per node minus holes) and the hint notes. One
change from the original: the branches on a node are a dict in arrival order, not a set.
"""

from __future__ import annotations

from collections import _count_elements  # type: ignore[attr-defined]  # Counter's C loop
from typing import Iterable, Sequence

import numpy as np

from evinfra.core.contracts import HintDelta
from evinfra.core.hashing import HashedPath, PathHasher
from evinfra.core.types import BlockHash, BranchId, Phase
from evinfra.directory.branches import BranchStep
from evinfra.errors import UnknownBranchError

__all__ = ["ReferenceBranchTable"]


class _Branch:
    __slots__ = ("id", "version", "path", "k", "holes", "_index", "_indexed")

    def __init__(self, branch: BranchId) -> None:
        self.id = branch
        self.version = 1
        self.path: HashedPath | None = None
        # C[β, n] = path.hashes[:k[n]] minus holes[n] (block -> its index in the path).
        self.k: dict[int, int] = {}
        self.holes: dict[int, dict[BlockHash, int]] = {}
        # block -> its first index, for the leading ``_indexed`` blocks of the path.
        self._index: dict[BlockHash, int] = {}
        self._indexed = 0

    @property
    def hashes(self) -> list[BlockHash]:
        return self.path.hashes if self.path is not None else []

    def position(self, h: BlockHash) -> int | None:
        """Index of the first ``h`` in the path. Evictions ask; the index grows with the
        path (a request appends a few pages), so no one scans a path per evicted block."""
        hashes, n = self.hashes, self._indexed
        if n < len(hashes):
            index = self._index
            for i in range(n, len(hashes)):
                if hashes[i] not in index:
                    index[hashes[i]] = i
            self._indexed = len(hashes)
        return self._index.get(h)

    def cut(self, keep: int) -> None:
        """The path is rewritten after its first ``keep`` blocks: drop the rest from the
        index (called while ``path`` is still the old one)."""
        if self._indexed > keep:
            index = self._index
            for h in self.hashes[keep:self._indexed]:
                if index.get(h, -1) >= keep:
                    del index[h]
            self._indexed = keep


class ReferenceBranchTable:
    """The branch table ``S`` and the counts ``R`` (Algorithms E.1, E.2), in Python."""

    def __init__(self, page_size: int, phases: Sequence[Phase] = ()) -> None:
        self.hasher = PathHasher(page_size)
        self._branches: dict[BranchId, _Branch] = {}
        self._R: list[dict[BlockHash, int]] = []
        # The branches on each node in the order they came. The Python table kept a set of
        # str, whose order (and with it the order of release_node's hints) followed the hash
        # seed; the native table releases in arrival order, and so does this copy.
        self._on: list[dict[BranchId, None]] = []
        self._phase: list[Phase] = []
        # Per node, the blocks whose count is on the other side of zero than the last hint
        # said: True, positive now. Between two hints there is usually one crossing (a path
        # counted on a node, or released there): it waits as it came, in ``_slice``, and
        # joins the dict only when a second one comes.
        self._notes: list[dict[BlockHash, bool]] = []
        self._slice: list[tuple[list[BlockHash], bool] | None] = []
        self._hinted: set[int] = set()  # nodes with notes
        for p in phases:
            self.add_node(p)

    # -- nodes ---------------------------------------------------------------------------

    def add_node(self, phase: Phase) -> int:
        self._R.append({})
        self._on.append({})
        self._phase.append(phase)
        self._notes.append({})
        self._slice.append(None)
        return len(self._R) - 1

    def phase(self, node: int) -> Phase:
        return self._phase[node]

    # -- queries -------------------------------------------------------------------------

    def __contains__(self, branch: BranchId) -> bool:
        return branch in self._branches

    def __len__(self) -> int:
        return len(self._branches)

    def branches(self) -> list[BranchId]:
        return list(self._branches)

    def version(self, branch: BranchId) -> int:
        return self._get(branch).version

    def path(self, branch: BranchId) -> HashedPath | None:
        return self._get(branch).path

    def nodes_of(self, branch: BranchId) -> list[int]:
        """``N_β``: the nodes where the branch holds counts."""
        return sorted(self._get(branch).k)

    def branches_on(self, node: int) -> set[BranchId]:
        return set(self._on[node])

    def counted(self, branch: BranchId, node: int) -> set[BlockHash]:
        """``C[β, n]`` as a set (tests and status; O(k))."""
        b = self._get(branch)
        k = b.k.get(node, 0)
        return set(b.hashes[:k]) - set(b.holes.get(node, ()))

    def count(self, block: BlockHash, node: int) -> int:
        """``R[b, n]``."""
        return self._R[node].get(block, 0)

    def counts(self, node: int) -> dict[BlockHash, int]:
        """The positive counts of a node (read-only view)."""
        return self._R[node]

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
            b = self._branches[branch] = _Branch(branch)
            base_branch = self._branches.get(parent) if parent is not None else None
            base = base_branch.path if base_branch is not None else None
            path = self.hasher.start(tokens, base)
            b.path = path
            return BranchStep(branch, b.version, False, path, 0)
        old = b.path
        path = self.hasher.hash(tokens, old)
        old_len = len(old) if old is not None else 0
        rewritten = path.shared < old_len
        if rewritten:
            b.version += 1
            keep = path.shared
            for n in list(b.k):
                self._trim(b, n, keep)
            b.cut(keep)
        b.path = path
        return BranchStep(branch, b.version, rewritten, path, old_len)

    # -- Algorithm E.2 --------------------------------------------------------------------

    def place(self, branch: BranchId, node: int) -> None:
        """E.2 lines 9-10: ``Count(β, n, π_β)``: new blocks +1, reused blocks keep counts.

        ``C[β, n]`` is a prefix of ``π_β`` (minus holes), so ``π_β \\ C`` is the tail past
        ``k`` plus the holes; ``C \\ π_β`` is empty."""
        b = self._get(branch)
        hashes = b.hashes
        if not hashes:
            return
        k = b.k.get(node, 0)
        holes = b.holes.pop(node, None)
        self._inc_all(node, hashes[k:])
        if holes:
            self._inc_all(node, holes)
        b.k[node] = len(hashes)
        self._on[node][branch] = None

    def settle(self, branch: BranchId, node: int) -> list[int]:
        """E.2 line 11: ``node`` now holds the branch's current version, so the branch's
        counts on other nodes of the same phase are released (a P2P or D2D move). Nodes of
        the other phase keep theirs (line 12). Returns the released nodes."""
        b = self._get(branch)
        if node not in b.k:
            return []
        phase = self._phase[node]
        released = [m for m in b.k if m != node and self._phase[m] is phase]
        for m in released:
            self._release(b, m)
        return released

    def end(self, branch: BranchId) -> None:
        """E.2 line 13: release every count of the branch and forget it."""
        b = self._branches.pop(branch, None)
        if b is None:
            raise UnknownBranchError(branch)
        for n in list(b.k):
            self._release(b, n)

    def switch_phase(self, node: int, phase: Phase) -> None:
        """E.2 lines 14-15: D->P resets the node's counts to free its memory; a switch to
        decode (or out of the collocated warm-up) keeps them to preserve its KV."""
        old = self._phase[node]
        self._phase[node] = phase
        if old is Phase.DECODE and phase is Phase.PREFILL:
            self.release_node(node)

    def release_node(self, node: int) -> None:
        """``Release(β, n)`` for every branch on ``node`` (a D->P switch, a lost node)."""
        for branch in list(self._on[node]):
            self._release(self._branches[branch], node)

    def evicted(self, node: int, blocks: Iterable[BlockHash]) -> None:
        """E.2 line 20: the node lost these blocks; zero their counts and remove them from
        every ``C[β, n]``. Only positive-count blocks cost anything beyond a dict lookup.

        A batch is mostly runs of blocks of the same branches (a leaf segment goes at once),
        so the holders of the previous block are asked first and the node's other branches
        only while the block's count is not accounted for."""
        R = self._R[node]
        emptied: list[_Branch] = []
        recent: list[_Branch] = []
        zeroed: list[BlockHash] = []
        for h in blocks:
            r = R.get(h)
            if not r:
                continue
            holders: list[_Branch] = []
            for b in recent:
                if self._hole(b, node, h, emptied):
                    holders.append(b)
                    if len(holders) == r:
                        break
            if len(holders) < r:
                asked = {b.id for b in recent}
                for branch in self._on[node]:
                    if branch in asked:
                        continue
                    b = self._branches[branch]
                    if self._hole(b, node, h, emptied):
                        holders.append(b)
                        if len(holders) == r:
                            break
            recent = holders
            del R[h]
            zeroed.append(h)
        if zeroed:
            self._crossed(node, zeroed, False)
        for b in emptied:
            del b.k[node], b.holes[node]
            self._on[node].pop(b.id, None)

    @staticmethod
    def _hole(b: _Branch, node: int, h: BlockHash, emptied: list[_Branch]) -> bool:
        """Take ``h`` out of ``C[β, n]`` if it is there; note β if that empties it."""
        k = b.k[node]
        i = b.position(h)
        if i is None or i >= k:
            return False
        holes = b.holes.setdefault(node, {})
        if h in holes:
            return False
        holes[h] = i
        if len(holes) == k:  # C[β, n] is empty: n leaves N_β
            emptied.append(b)
        return True

    # -- hints ------------------------------------------------------------------------------

    def take_hints(self, node: int) -> HintDelta:
        """Blocks whose count on ``node`` crossed zero since the last call (and not back)."""
        self._hinted.discard(node)
        one = self._slice[node]
        if one is not None:
            self._slice[node] = None
            blocks, up = one
            return HintDelta(blocks, []) if up else HintDelta([], blocks)
        notes = self._notes[node]
        self._notes[node] = {}
        pos = [h for h, up in notes.items() if up]
        zero = [h for h, up in notes.items() if not up] if len(pos) < len(notes) else []
        return HintDelta(pos, zero)

    def hinted_nodes(self) -> list[int]:
        """Nodes with hints waiting to be taken (ascending)."""
        return sorted(self._hinted)

    # -- internals --------------------------------------------------------------------------

    def _get(self, branch: BranchId) -> _Branch:
        b = self._branches.get(branch)
        if b is None:
            raise UnknownBranchError(branch)
        return b

    def _inc_all(self, node: int, hashes: list[BlockHash] | dict[BlockHash, int]) -> None:
        """``R[b, n] += 1`` for each block, in one C loop; the blocks that were at zero are
        noted for the next hint. Usually all were (a path counted on a node new to it, a
        request's new pages) or none (a fork's pages its parent counts there), which the
        size of ``R`` tells; otherwise they are the blocks now at one (a path's blocks are
        distinct)."""
        R = self._R[node]
        before = len(R)
        _count_elements(R, hashes)
        added = len(R) - before
        if added == len(hashes):
            self._crossed(node, hashes, True)
        elif added:
            # Counts do not grow along a path (a branch that counts a block counts its
            # prefix), so the blocks now at one are usually a path's tail: checked in a C
            # loop. Holes (a dict), or anything else, take the filter.
            ones = hashes[len(hashes) - added:] if type(hashes) is list else []
            if list(map(R.__getitem__, ones)).count(1) != added:
                ones = [h for h in hashes if R[h] == 1]
            self._crossed(node, ones, True)

    def _dec_all(self, node: int, hashes: Iterable[BlockHash]) -> None:
        """``R[b, n] -= 1`` for each block (all counted); a count that reaches zero is
        noted for the next hint."""
        R = self._R[node]
        crossed = []
        for h in hashes:
            r = R[h]
            if r == 1:
                del R[h]
                crossed.append(h)
            else:
                R[h] = r - 1
        if crossed:
            self._crossed(node, crossed, False)

    def _crossed(self, node: int, blocks: list[BlockHash] | dict[BlockHash, int],
                 up: bool) -> None:
        """Note distinct blocks whose count crossed zero (``up``: became positive). A note
        already there is the opposite crossing since the last hint: the two cancel. So the
        notes stay bounded by the blocks the last hint got wrong, whether or not anyone
        takes the hints (a directory without engines)."""
        self._hinted.add(node)
        notes, one = self._notes[node], self._slice[node]
        if one is not None:
            self._slice[node] = None
            notes.update(dict.fromkeys(*one))
        elif not notes:
            self._slice[node] = (list(blocks), up)
            return
        if notes.keys().isdisjoint(blocks):
            notes.update(dict.fromkeys(blocks, up))
        else:
            pop = notes.pop
            for h in blocks:
                if pop(h, None) is None:
                    notes[h] = up

    def _trim(self, b: _Branch, node: int, keep: int) -> None:
        """``Count(β, n, C[β, n] ∩ π_new)`` where ``π_new`` shares ``keep`` leading blocks."""
        k = b.k[node]
        if k <= keep:
            return
        holes = b.holes.get(node)
        drop = b.hashes[keep:k]
        self._dec_all(node, [h for h in drop if h not in holes] if holes else drop)
        if holes:
            for h in [h for h, i in holes.items() if i >= keep]:
                del holes[h]
            if not holes:
                del b.holes[node]
        if keep:
            b.k[node] = keep
        else:
            del b.k[node]
            self._on[node].pop(b.id, None)

    def _release(self, b: _Branch, node: int) -> None:
        if node in b.k:
            self._trim(b, node, 0)
