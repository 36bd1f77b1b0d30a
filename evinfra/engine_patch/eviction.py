"""Count-aware host eviction inside the engine: the key ``(1[R_b > 0], T_b)`` of paper 5.3 /
Algorithm E.2 lines 16-21, applied to SGLang's host-tier radix nodes (pure).

The engine cannot see ``R``. The control plane sends which blocks' counts crossed zero
(:class:`~evinfra.engine_patch.wire.CountHints`); :class:`CountAwareHostOrder` keeps the
positive set with the directory's own :class:`~evinfra.directory.eviction.HostEvictionOrder`
(same ``apply_hints`` semantics as the fake engine: a block never hinted positive counts
zero; a hint may name a block the engine does not hold yet).

SGLang evicts host memory by radix node, leaf first, ordered by a key it computes per node
(LRU's ``T_b`` under the default policy, after its session references). :meth:`key` puts
``1[R > 0]`` in front of that key: every zero-count host leaf goes before any leaf holding a
positive block, and within each group SGLang's own order (LRU) decides. A node is positive
when any of its pages is (its pages are one prefix, so a branch that counts a later page
counts the earlier ones too). GPU eviction is not touched.

Every eviction is recorded (:class:`EvictionStats`) so the rule can be checked from outside:
``violations`` counts positive nodes evicted while a zero-count host leaf was still there.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from evinfra.core.contracts import HintDelta
from evinfra.directory.eviction import HostEvictionOrder
from evinfra.engine_patch.wire import CountHints

__all__ = ["CountAwareHostOrder", "EvictionStats"]


class EvictionStats:
    """What the engine evicted from host memory, and in which group."""

    def __init__(self, keep: int = 256) -> None:
        self.zero_nodes = 0
        self.zero_blocks = 0
        self.positive_nodes = 0
        self.positive_blocks = 0
        self.violations = 0
        self.recent: deque[dict] = deque(maxlen=keep)

    def record(self, hashes: list[int], positive: bool, zero_left: bool, t: float) -> None:
        if positive:
            self.positive_nodes += 1
            self.positive_blocks += len(hashes)
            if zero_left:
                self.violations += 1
        else:
            self.zero_nodes += 1
            self.zero_blocks += len(hashes)
        self.recent.append({"t": t, "positive": positive, "blocks": list(hashes)})

    def snapshot(self) -> dict:
        return {"evicted_zero_nodes": self.zero_nodes, "evicted_zero_blocks": self.zero_blocks,
                "evicted_positive_nodes": self.positive_nodes,
                "evicted_positive_blocks": self.positive_blocks,
                "violations": self.violations, "recent": list(self.recent)}


class CountAwareHostOrder:
    """The positive set from the hints, and the host-eviction key built on it."""

    def __init__(self) -> None:
        self._order = HostEvictionOrder(count_aware=True)
        self.hints_applied = 0
        self.stats = EvictionStats()

    @property
    def positive(self) -> set[int]:
        return self._order.positive

    def apply(self, hints: CountHints) -> None:
        self._order.apply_hints(HintDelta(list(hints.positive), list(hints.zero),
                                          hints.replace))
        self.hints_applied += 1

    def is_positive(self, hashes: Iterable[int]) -> bool:
        pos = self._order.positive
        return any(h in pos for h in hashes)

    def key(self, hashes: Iterable[int], base: Any) -> tuple:
        """``(1[R > 0], base)``: ``base`` is SGLang's own key for the node (LRU)."""
        return (1 if self.is_positive(hashes) else 0, base)
