"""A deliberately naive model of the directory, written from the paper's pseudocode alone.

Used by the property tests (as the oracle) and by ``bench.directory`` (as the baseline of the
speed-up ratio); never by the control plane. Every operation is the literal set arithmetic of
Algorithms E.1 and E.2: paths are hashed from scratch, ``C[β, n]`` are Python sets, ``R`` is
recounted by ``Count``, lookups walk every node separately. Slow on purpose, obvious on purpose.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from evinfra.core.hashing import block_hashes
from evinfra.core.types import BlockHash, BranchId, NodeId, Phase, Tier

__all__ = ["ReferenceDirectory"]


class _RefBranch:
    def __init__(self) -> None:
        self.v = 1
        self.pi: list[BlockHash] = []
        self.tokens: list[int] = []
        self.C: dict[NodeId, set[BlockHash]] = {}


class ReferenceDirectory:
    def __init__(self, nodes: dict[NodeId, Phase], page_size: int) -> None:
        self.page_size = page_size
        self.phase = dict(nodes)
        self.held: dict[tuple[NodeId, Tier], set[BlockHash]] = {
            (n, t): set() for n in nodes for t in Tier}
        self.S: dict[BranchId, _RefBranch] = {}
        self.R: dict[tuple[BlockHash, NodeId], int] = {}

    # -- tree ----------------------------------------------------------------------------

    def holds(self, node: NodeId, b: BlockHash) -> bool:
        return any(b in self.held[node, t] for t in Tier)

    def store(self, node: NodeId, blocks: Iterable[BlockHash], tier: Tier) -> None:
        for b in blocks:
            self.held[node, tier].add(b)

    def remove(self, node: NodeId, blocks: Iterable[BlockHash], tier: Tier,
               batch: set[BlockHash] | None = None) -> None:
        """``batch``: the blocks that left the node earlier in the batch being applied (see
        :meth:`batch_over`); None for an event applied alone."""
        for b in blocks:
            if b not in self.held[node, tier]:
                continue  # an unknown removal changes nothing
            self.held[node, tier].discard(b)
            if not self.holds(node, b):
                if batch is None:
                    self._evicted(node, b)
                else:
                    batch.add(b)

    def clear(self, node: NodeId, batch: set[BlockHash] | None = None) -> None:
        for t in Tier:
            for b in list(self.held[node, t]):
                self.remove(node, [b], t, batch)

    def forget(self, node: NodeId) -> None:
        """The view of the node was lost: it lists nothing, and no count changes."""
        for t in Tier:
            self.held[node, t].clear()

    def batch_over(self, node: NodeId, left: set[BlockHash]) -> None:
        """A batch of events is applied at once: a block that left the node during it is lost
        only if the node holds it nowhere at its end (a resync clears and stores again)."""
        for b in left:
            if not self.holds(node, b):
                self._evicted(node, b)

    def own_prefix(self, node: NodeId, path: Sequence[BlockHash],
                   tier: Tier | None = None) -> int:
        n = 0
        for b in path:
            ok = b in self.held[node, tier] if tier else self.holds(node, b)
            if not ok:
                break
            n += 1
        return n

    def union_prefix(self, path: Sequence[BlockHash]) -> int:
        n = 0
        for b in path:
            if not any(self.holds(m, b) for m in self.phase):
                break
            n += 1
        return n

    # -- Algorithm E.1 -------------------------------------------------------------------

    def step(self, beta: BranchId, tokens: list[int], parent: BranchId | None = None
             ) -> tuple[int, list[BlockHash], list[BlockHash]]:
        pi_new = block_hashes(tokens, self.page_size)
        if beta not in self.S:
            self.S[beta] = _RefBranch()
            pi_old: list[BlockHash] = []
        else:
            pi_old = self.S[beta].pi
            if pi_new[: len(pi_old)] != pi_old:
                self.S[beta].v += 1
                # E.2 lines 6-7: release the dropped history once per node.
                for m in self.N(beta):
                    self.count(beta, m, self.S[beta].C[m] & set(pi_new))
        self.S[beta].pi = pi_new
        self.S[beta].tokens = list(tokens)
        return self.S[beta].v, pi_old, pi_new

    # -- Algorithm E.2 -------------------------------------------------------------------

    def N(self, beta: BranchId) -> list[NodeId]:
        return [m for m, c in self.S[beta].C.items() if c]

    def count(self, beta: BranchId, n: NodeId, pi: Iterable[BlockHash]) -> None:
        pi = set(pi)
        C = self.S[beta].C.get(n, set())
        for b in pi - C:
            self.R[b, n] = self.R.get((b, n), 0) + 1
        for b in C - pi:
            self.R[b, n] = self.R[b, n] - 1
        self.S[beta].C[n] = pi

    def release(self, beta: BranchId, n: NodeId) -> None:
        self.count(beta, n, set())

    def place(self, beta: BranchId, n: NodeId) -> None:
        self.count(beta, n, self.S[beta].pi)

    def settle(self, beta: BranchId, n: NodeId) -> None:
        if n not in self.N(beta):
            return
        for m in self.N(beta):
            if m != n and self.phase[m] == self.phase[n]:
                self.release(beta, m)

    def end(self, beta: BranchId) -> None:
        for m in self.N(beta):
            self.release(beta, m)
        del self.S[beta]

    def switch_phase(self, n: NodeId, phase: Phase) -> None:
        old = self.phase[n]
        self.phase[n] = phase
        if old is Phase.DECODE and phase is Phase.PREFILL:
            for beta in list(self.S):
                if n in self.N(beta):
                    self.release(beta, n)

    def _evicted(self, n: NodeId, b: BlockHash) -> None:
        for beta in self.S.values():
            beta.C.get(n, set()).discard(b)
        self.R[b, n] = 0

    def counts_from_sets(self) -> dict[tuple[BlockHash, NodeId], int]:
        """``R`` recomputed from the ``C`` sets: what every count must equal."""
        out: dict[tuple[BlockHash, NodeId], int] = {}
        for beta in self.S.values():
            for n, C in beta.C.items():
                for b in C:
                    out[b, n] = out.get((b, n), 0) + 1
        return out
