"""Time for the control plane: one protocol, a wall clock and a virtual clock.

Control-plane code never calls ``time.*`` or ``asyncio.sleep``: it asks a :class:`Clock` for
``now()`` and schedules callbacks with ``call_at``. :class:`WallClock` runs them on the
asyncio loop (``serve``); :class:`VirtualClock` is a discrete-event loop whose time jumps to
the next callback (``simulate``). The two differ by one class, not by a fork of the code that
uses them (after trio's ``Clock`` and SimPy's ``rt.py``).

Same-time callbacks run first-in first-out: the virtual heap key is ``(time, seq)`` with
``seq`` from a per-clock counter, so a run is deterministic.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from typing import Any, Callable, Protocol

__all__ = ["Clock", "Timer", "VirtualClock", "WallClock"]


class Timer(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock."""

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Timer:
        """Run ``callback(*args)`` at ``when`` (or as soon as possible if in the past)."""

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        """``call_at(now() + delay, ...)``."""


class WallClock:
    """Real time on the running asyncio loop (``loop.time()``, monotonic)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()

    def now(self) -> float:
        return self._loop.time()

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Timer:
        return self._loop.call_at(when, callback, *args)

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        return self._loop.call_later(max(0.0, delay), callback, *args)


class _Entry:
    __slots__ = ("callback", "args", "cancelled")

    def __init__(self, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.callback = callback
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """Simulated time: ``run`` pops callbacks in ``(time, seq)`` order and jumps to each."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._heap: list[tuple[float, int, _Entry]] = []
        self._seq = itertools.count()
        self.steps = 0

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[..., Any], *args: Any) -> Timer:
        entry = _Entry(callback, args)
        heapq.heappush(self._heap, (max(when, self._now), next(self._seq), entry))
        return entry

    def call_later(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        return self.call_at(self._now + max(0.0, delay), callback, *args)

    def peek(self) -> float | None:
        """Time of the next live callback, or None when nothing is scheduled."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def run(self, until: float | None = None) -> None:
        """Run callbacks until none is left or the next one is after ``until`` (then time
        stops at ``until``)."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            when, _, entry = heap[0]
            if until is not None and when > until:
                break
            pop(heap)
            if entry.cancelled:
                continue
            self._now = when
            self.steps += 1
            entry.callback(*entry.args)
        if until is not None and until > self._now:
            self._now = until
