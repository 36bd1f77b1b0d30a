"""What the service tells the planner about its requests: how many are in decode (q) and
how many are in flight (n, waiting for or in prefill or in decode). Θ's decode side takes
n̄ (``evinfra/planner/README.md``, where we depart from Eq. 5), so a request queued behind a
busy prefill node must count in n and not in q, and a decoding one in both."""

from __future__ import annotations

import pytest

from evinfra.planner import Decision
from tests.control.virtual import WARMUP, VSim, prompt

WINDOW = 10.0


def test_queued_requests_count_in_flight_and_decoding_ones_in_both():
    sim = VSim(planner={"t_learn": WARMUP, "adapt": True, "t_win": WINDOW, "m": 2,
                        "hold_off": 0.0})
    decisions: list[Decision] = []
    sim.service.bus.subscribe(Decision, decisions.append)
    first_window_end = sim.service.status()["next_decision_at"]
    for n in ("n0", "n1"):
        sim.engines[n].stall()
    sinks = [sim.submit(f"r{i}", prompt(256, i), max_tokens=40_000) for i in range(6)]
    sim.run_to(first_window_end)
    queued = decisions[-1].slices
    # Submitted half a second into the window: the first slice holds them 4.5 s of 5.
    assert [s.n for s in queued] == pytest.approx([6 * (WINDOW / 2 - 0.5) / (WINDOW / 2), 6])
    assert [s.q for s in queued] == [0, 0]
    for n in ("n0", "n1"):
        sim.engines[n].resume()
    sim.run_to(first_window_end + 1.0)  # prefilled and handed over: decoding
    assert not any(s.finished for s in sinks)
    sim.run_to(first_window_end + 2 * WINDOW)
    decoding = decisions[-1].slices
    assert [s.q for s in decoding] == pytest.approx([6, 6])
    assert [s.n for s in decoding] == pytest.approx([6, 6])
    assert not any(s.finished for s in sinks)


def test_requests_waiting_at_a_windows_end_make_their_branches_active_sources():
    """The latency rule's finite source (``planner/latency.py``, ``Sources``): six agents'
    requests wait behind stalled prefill nodes across the window's end. Each branch is
    active from its request's arrival, half a second into the window, to the window's end.
    Before the service told the planner of arrivals, only requests that ended in the window
    counted: none here, and the rule took an infinite source."""
    sim = VSim(planner={"t_learn": WARMUP, "adapt": True, "t_win": WINDOW, "m": 2,
                        "hold_off": 0.0, "objective": "latency"})
    decisions: list[Decision] = []
    sim.service.bus.subscribe(Decision, decisions.append)
    first_window_end = sim.service.status()["next_decision_at"]
    for n in ("n0", "n1"):
        sim.engines[n].stall()
    for i in range(6):
        sim.submit(f"r{i}", prompt(256, i), max_tokens=40_000)
    sim.run_to(first_window_end)
    assert decisions[-1].sources == pytest.approx([6 * (WINDOW / 2 - 0.5) / (WINDOW / 2), 6])
