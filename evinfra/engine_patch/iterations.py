"""The engine's last forward passes, as the planner fits them (pure).

Paper 5.1 fits iteration-time models (Eq. 1, 2) on each node's own iterations: a prefill pass
is ``(Σt_uc, ΣA, Σt_rst)`` against its time, a decode pass its batch against its time. Stock
SGLang times passes only with CUDA events, and its cumulative counters (``/v1/loads``) merge
overlapping prefills, so on a busy engine the driver could attribute almost none of them. The
scheduler hook gives each pass to :class:`IterationRecorder` as it is processed; the driver
reads the ones it has not seen (``GET /evinfra/iterations?after=N``).

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

    def __init__(self, capacity: int = 1024) -> None:
        self._ring: deque[IterationRecord] = deque(maxlen=capacity)
        self.last = -1
        self._previous: frozenset[str] = frozenset()

    def prefill(self, start: float, duration: float,
                items: Sequence[tuple[str, int, int, int]]) -> None:
        """``items``: ``(rid, t_uc, t_c, loaded)`` per request, ``loaded`` its admission's
        host load (charged unless the request continues from the previous prefill pass)."""
        prev = self._previous
        self._add(start, duration, prefill=[(rid, t_uc, t_c, 0 if rid in prev else loaded)
                                            for rid, t_uc, t_c, loaded in items])
        self._previous = frozenset(rid for rid, *_ in items)

    def decode(self, start: float, duration: float, batch: int, t_fwd: int,
               accepted: int) -> None:
        self._add(start, duration, batch=batch, t_fwd=t_fwd, accepted=accepted)

    def _add(self, start: float, duration: float, **fields) -> None:
        self.last += 1
        self._ring.append(IterationRecord(self.last, start, duration, **fields))

    def since(self, after: int) -> IterationLog:
        """The passes numbered above ``after`` that are still kept."""
        ring = self._ring
        first = ring[0].seq if ring else self.last + 1
        skip = max(0, after + 1 - first)
        return IterationLog(self.last, list(islice(ring, skip, None)))
