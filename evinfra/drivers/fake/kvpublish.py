"""A node's KV event publisher, with the faults a real ZMQ link has.

Each state change of the engine becomes one ``KVEventBatch`` with the next sequence number, as
SGLang's publisher numbers its messages. For tests the publisher can lose a batch (its number
is skipped, as a subscriber that missed a message sees), deliver it twice, or deliver it after
the next one: with seeded probabilities from the config, or once on demand.
"""

from __future__ import annotations

import numpy as np

from evinfra.core.bus import Bus
from evinfra.core.events import KVEvent, KVEventBatch, NodeKVEvents

__all__ = ["KVPublisher"]


class KVPublisher:
    def __init__(self, node: str, bus: Bus, rng: np.random.Generator, drop: float = 0.0,
                 duplicate: float = 0.0, reorder: float = 0.0) -> None:
        self.node = node
        self.seq = -1
        """The last sequence number used (SGLang's first message is 0)."""
        self._bus = bus
        self._rng = rng
        self._p = (drop, duplicate, reorder)
        self._once = {"drop": 0, "duplicate": 0, "reorder": 0}
        self._held: tuple[NodeKVEvents, int] | None = None  # a batch and its copies

    def drop_next(self, n: int = 1) -> None:
        self._once["drop"] += n

    def duplicate_next(self, n: int = 1) -> None:
        self._once["duplicate"] += n

    def reorder_next(self, n: int = 1) -> None:
        """Hold the next ``n`` batches back, each until the batch after it is out."""
        self._once["reorder"] += n

    def publish(self, ts: float, events: list[KVEvent]) -> None:
        self.seq += 1
        msg = NodeKVEvents(self.node, self.seq, KVEventBatch(ts, events, 0))
        if self._fault("drop", 0):
            return
        copies = 2 if self._fault("duplicate", 1) else 1
        if self._held is None and self._fault("reorder", 2):
            self._held = (msg, copies)
            return
        for _ in range(copies):
            self._bus.publish(msg)
        if self._held is not None:
            (held, n), self._held = self._held, None
            for _ in range(n):
                self._bus.publish(held)

    def _fault(self, kind: str, i: int) -> bool:
        if self._once[kind]:
            self._once[kind] -= 1
            return True
        return bool(self._p[i]) and float(self._rng.random()) < self._p[i]
