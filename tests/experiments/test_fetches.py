"""Fig. D.3's profile of peer fetches: bins, percentiles and the scored window."""

from __future__ import annotations

import pytest

from evinfra.core.bus import Bus
from evinfra.core.events import PrefillDone, RequestDone
from evinfra.experiments.fetches import FetchRecorder


def _request(bus: Bus, rid: str, fetched: int, fetch_s: float, arrival: float,
             start: float) -> None:
    bus.publish(PrefillDone(request=rid, node="n0", time=start + 0.1, cached=fetched,
                            fetched=fetched, computed=10, fetch_s=fetch_s))
    bus.publish(RequestDone(request=rid, branch="b", arrival=arrival, end=start + 1.0,
                            status="ok", prompt_tokens=fetched + 10, output_tokens=1,
                            prefill_start=start, prefill_node="n0"))


def test_fetches_are_binned_by_powers_of_two_with_their_queueing() -> None:
    bus = Bus()
    rec = FetchRecorder(bus)
    for i, (tokens, s) in enumerate([(64, 0.002), (100, 0.004), (127, 0.006), (128, 0.01)]):
        _request(bus, f"r{i}", tokens, s, arrival=100.0, start=100.5 + i)
    _request(bus, "local", 0, 0.0, arrival=100.0, start=101.0)  # no fetch: not a row
    _request(bus, "early", 64, 0.5, arrival=10.0, start=20.0)  # before the scored window
    bins = rec.bins(50.0, 200.0)
    assert [(b.low, b.count) for b in bins] == [(64, 3), (128, 1)]
    assert bins[0].fetch_p50 == pytest.approx(0.004)
    assert bins[0].fetch_p10 == pytest.approx(0.0024) and bins[0].fetch_p90 == pytest.approx(0.0056)
    assert bins[0].queueing_p50 == pytest.approx(1.5)
    assert bins[1].queueing_p50 == pytest.approx(3.5)
    # Control: the early request's slow fetch is in the profile once its window is scored.
    assert [(b.low, b.count, b.fetch_p90) for b in rec.bins(0.0, 200.0)][0][:2] == (64, 4)
    assert rec.bins(0.0, 200.0)[0].fetch_p90 > bins[0].fetch_p90
