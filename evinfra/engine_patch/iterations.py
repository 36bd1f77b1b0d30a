"""The engine's last forward passes, as the planner fits them (pure).

Paper 5.1 fits iteration-time models (Eq. 1, 2) on each node's own iterations: a prefill pass
is ``(Σt_uc, ΣA, Σt_rst)`` against its time, a decode pass its batch against its time. Stock
SGLang times passes only with CUDA events, and its cumulative counters (``/v1/loads``) merge
overlapping prefills, so on a busy engine the driver could attribute almost none of them. The
scheduler hook gives each pass to :class:`IterationRecorder` as it is processed; the driver
reads the ones it has not seen (``GET /evinfra/iterations?after=N``). The last 512 are kept:
tens of seconds of decode passes on a GPU against the driver's poll every 0.5 s, and small
enough to ride in every ``get_internal_state`` answer (the route's way to the scheduler, and
so in ``/server_info``'s ``internal_states`` too).

A pass's time runs from its launch to its result processed, but no earlier than the previous
pass's result: with overlap scheduling SGLang launches a pass before it processes the
previous one's result, and the two would share that time (counted twice, a decode pass would
look up to twice as long). Without overlap a pass is launched after the previous result, and
its time is its launch to its result.

``t_rst`` is what SGLang loaded from host memory at the request's admission
(``host_loaded_length``), charged to its first chunk only: a request in the previous prefill
pass is a continuation (chunked prefill runs a request's chunks in consecutive passes), as
:class:`~evinfra.planner.itermodel.PrefillMix` reads it too. What the patch's fetcher loaded
while the request was queued is on device before the pass and costs it nothing.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Sequence

from evinfra.engine_patch.wire import IterationLog, IterationRecord

__all__ = ["IterationRecorder"]


class IterationRecorder:
    """The last ``capacity`` passes, numbered from 0."""

    def __init__(self, capacity: int = 512) -> None:
        self._ring: deque[IterationRecord] = deque(maxlen=capacity)
        self.last = -1
        self._previous: frozenset[str] = frozenset()
        self._done = float("-inf")  # when the previous pass's result was processed

    def prefill(self, launched: float, done: float, wall: float,
                items: Sequence[tuple[str, int, int, int]]) -> None:
        """A prefill pass launched at ``launched`` and processed at ``done`` (a monotonic
        clock), ``wall`` the wall clock at ``done``. ``items``: ``(rid, t_uc, t_c, loaded)``
        per request, ``loaded`` its admission's host load (charged unless the request
        continues from the previous prefill pass)."""
        prev = self._previous
        self._add(launched, done, wall, prefill=[
            (rid, t_uc, t_c, 0 if rid in prev else loaded) for rid, t_uc, t_c, loaded in items])
        self._previous = frozenset(rid for rid, *_ in items)

    def decode(self, launched: float, done: float, wall: float, batch: int, t_fwd: int,
               accepted: int) -> None:
        self._add(launched, done, wall, batch=batch, t_fwd=t_fwd, accepted=accepted)

    def _add(self, launched: float, done: float, wall: float, **fields) -> None:
        duration = done - max(launched, self._done)
        self._done = done
        self.last += 1
        self._ring.append(IterationRecord(self.last, wall - duration, duration, **fields))

    def since(self, after: int) -> IterationLog:
        """The passes numbered above ``after`` that are still kept."""
        ring = self._ring
        first = ring[0].seq if ring else self.last + 1
        skip = max(0, after + 1 - first)
        return IterationLog(self.last, list(islice(ring, skip, None)))
