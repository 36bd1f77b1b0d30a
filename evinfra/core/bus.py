"""The in-memory event bus: typed events, in-process subscribers, run to completion.

Engines (through their drivers) publish what happened — KV events, iteration reports, node
state, request progress — and the control-plane components subscribe by event type.

**Run to completion.** A handler, and a command of the control plane (``Bus.running``),
runs to its end before any event it causes is seen: an event published meanwhile waits in
a queue and is delivered, in publication order, after the handler or command returns. So a
command to an engine never has its answer delivered inside it, whether the engine answers
at once (the fake engines, on the simulator's clock) or from its own I/O task (SGLang): the
simulator and ``serve`` see the same interleavings. An event published with nothing running
is delivered at once, to its subscribers in subscription order.

A subscriber that raises is logged and counted; it never stops the others or the publisher:
one bad event must not crash the control plane.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, Callable, TypeVar

import structlog

__all__ = ["Bus"]

log = structlog.get_logger(__name__)

E = TypeVar("E")


class Bus:
    def __init__(self) -> None:
        self._subs: dict[type, list[Callable[[Any], None]]] = defaultdict(list)
        self._queue: deque[object] = deque()
        self._busy = 0  # commands running, plus one while delivering
        self.errors = 0

    def subscribe(self, event_type: type[E], handler: Callable[[E], None]) -> None:
        self._subs[event_type].append(handler)

    def publish(self, event: object) -> None:
        queue = self._queue
        if self._busy:
            queue.append(event)
        elif queue:  # left over by a delivery that a BaseException cut short: in order
            queue.append(event)
            self._deliver(queue.popleft())
        else:
            self._deliver(event)

    def running(self) -> "Bus":
        """``with bus.running():`` a command runs: what it causes is delivered after it.
        Nested (a command inside a handler or another command), it changes nothing."""
        return self

    def __enter__(self) -> None:
        self._busy += 1

    def __exit__(self, *exc: object) -> None:
        self._busy -= 1
        if not self._busy and self._queue:
            self._deliver(self._queue.popleft())

    def _deliver(self, event: object) -> None:
        """``event``, then what its handlers publish, until the queue is empty."""
        queue, subs = self._queue, self._subs
        self._busy += 1
        try:
            while True:
                for handler in subs.get(type(event), ()):
                    try:
                        handler(event)
                    except Exception:  # noqa: BLE001 - isolation is the point
                        self.errors += 1
                        log.exception("bus_subscriber_failed", event_type=type(event).__name__,
                                      handler=getattr(handler, "__qualname__", repr(handler)))
                if not queue:
                    break
                event = queue.popleft()
        finally:
            self._busy -= 1
