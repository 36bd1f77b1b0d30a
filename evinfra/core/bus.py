"""The in-memory event bus: typed events, in-process subscribers, synchronous delivery.

Engines (through their drivers) publish what happened — KV events, iteration reports, node
state, request progress — and the control-plane components subscribe by event type. Delivery
is synchronous and in subscription order, so a publish is a few function calls (the
simulator publishes millions), the order of effects is deterministic, and a subscriber sees
the world exactly as it was when the event happened. A subscriber that raises is logged and
counted; it never stops the others or the publisher: one bad event must not crash the
control plane.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, TypeVar

import structlog

__all__ = ["Bus"]

log = structlog.get_logger(__name__)

E = TypeVar("E")


class Bus:
    def __init__(self) -> None:
        self._subs: dict[type, list[Callable[[Any], None]]] = defaultdict(list)
        self.errors = 0

    def subscribe(self, event_type: type[E], handler: Callable[[E], None]) -> None:
        self._subs[event_type].append(handler)

    def publish(self, event: object) -> None:
        for handler in self._subs.get(type(event), ()):
            try:
                handler(event)
            except Exception:  # noqa: BLE001 - isolation is the point
                self.errors += 1
                log.exception("bus_subscriber_failed", event_type=type(event).__name__,
                              handler=getattr(handler, "__qualname__", repr(handler)))
