"""Peer fetches against the queueing they hide behind (paper D.6, Figure D.3).

A prefill node fetches a request's prefix KV from a peer's host memory as soon as the request
arrives, so the fetch overlaps the request's queueing delay (arrival to prefill start). The
paper profiles the fetch time against the fetched tokens in power-of-two bins (median and
10th-90th percentiles) beside the median queueing delay, from minute 30 to 85 of its fixed-split
run: 7 ms median below 16K tokens, 129 ms at 64K-128K, queueing at least 3.9x the fetch in every
bin. :class:`FetchRecorder` gathers the same from the bus (``PrefillDone.fetch_s``, the
engines' own report, and ``RequestDone``'s arrival and prefill start).
"""

from __future__ import annotations

import msgspec
import numpy as np

from evinfra.core.bus import Bus
from evinfra.core.events import PrefillDone, RequestDone

__all__ = ["FetchBin", "FetchRecorder"]


class FetchBin(msgspec.Struct, frozen=True):
    """Requests whose fetched tokens lie in ``[low, 2 * low)``."""

    low: int
    count: int
    fetch_p10: float
    fetch_p50: float
    fetch_p90: float
    """Seconds from the fetch's start to the KV in the node's host memory."""
    queueing_p50: float
    """Median seconds from arrival to the start of prefill, of the same requests."""


def _r(x: float) -> float:
    return float(f"{float(x):.6g}")


class FetchRecorder:
    def __init__(self, bus: Bus) -> None:
        self._fetch: dict[str, tuple[int, float]] = {}  # request -> (tokens, seconds)
        self._done: list[tuple[float, int, float, float]] = []  # (prefill start, tokens, s, queueing)
        bus.subscribe(PrefillDone, self._on_prefill)
        bus.subscribe(RequestDone, self._on_done)

    def _on_prefill(self, ev: PrefillDone) -> None:
        if ev.fetched > 0 and ev.fetch_s > 0:
            self._fetch[ev.request] = (ev.fetched, ev.fetch_s)

    def _on_done(self, d: RequestDone) -> None:
        got = self._fetch.pop(d.request, None)
        if got is not None and d.prefill_start is not None:
            self._done.append((d.prefill_start, got[0], got[1], d.prefill_start - d.arrival))

    def bins(self, start: float, end: float) -> list[FetchBin]:
        """The fetches of requests whose prefill started in ``[start, end)``, by power-of-two
        bins of fetched tokens."""
        by: dict[int, list[tuple[float, float]]] = {}
        for t, tokens, s, q in self._done:
            if start <= t < end:
                by.setdefault(1 << (tokens.bit_length() - 1), []).append((s, q))
        out = []
        for low, xs in sorted(by.items()):
            s = np.array([x for x, _ in xs])
            q = np.array([x for _, x in xs])
            out.append(FetchBin(low=low, count=len(xs), fetch_p10=_r(np.percentile(s, 10)),
                                fetch_p50=_r(np.median(s)), fetch_p90=_r(np.percentile(s, 90)),
                                queueing_p50=_r(np.median(q))))
        return out
