"""Closed loop (fixed concurrency, replacement, schedules); open loop (Poisson, admission cap)."""

from __future__ import annotations

import numpy as np
from workload_fakes import INF, EchoBackend, u32

from evinfra.workloads import (
    Call, Pause, Phase, Runner, Spawn, TraceWorkload, poisson_arrivals,
)


def varied(name: str, count: int = 10**6, pause: float = 1.0) -> TraceWorkload:
    """Agents of 1-5 calls (by index), so they finish at different times."""

    def program(i: int):
        for _ in range(1 + i % 5):
            yield Call(u32([1000 + i % 7]), 1 + i % 3)
            yield Pause(pause * (1 + i % 4))

    return TraceWorkload(name, count, lambda i: Spawn(program(i), task=u32([2000 + i])))


def probe(clock, until: float, every: float, check) -> None:
    """Call ``check(now)`` every ``every`` seconds (offset by half a step from events)."""
    t = every / 2
    while t < until:
        clock.call_at(t, check, t)
        t += every


def test_closed_loop_replaces_finished_agents_and_keeps_concurrency():
    backend = EchoBackend(delay=0.7)
    runner = Runner(backend, {"a": varied("a")}, stop_at=200.0)
    runner.closed_loop([Phase(INF, {"a": 12})])
    seen = []
    probe(backend.clock, 200.0, 0.9, lambda t: seen.append(runner.active_agents))
    backend.clock.run(until=200.0)
    assert seen and all(n == 12 for n in seen)
    assert runner.stats.finished > 100  # many agents finished, each replaced at once
    assert runner.stats.admitted == runner.stats.finished + 12


def test_schedule_changes_the_composition():
    backend = EchoBackend(delay=0.5)
    runner = Runner(backend, {"a": varied("a"), "b": varied("b")}, stop_at=90.0)
    runner.closed_loop([Phase(30.0, {"a": 6}), Phase(30.0, {"a": 2, "b": 4}),
                        Phase(30.0, {"b": 1})])
    seen = {}
    probe(backend.clock, 90.0, 1.0, lambda t: seen.__setitem__(t, dict(runner.active)))
    backend.clock.run(until=90.0)
    assert all(v == {"a": 6, "b": 0} for t, v in seen.items() if t < 30)
    # A lowered count drains as agents finish (no replacement); a raised one fills at once.
    assert all(v["b"] == 4 and v["a"] <= 6 for t, v in seen.items() if 30 < t < 60)
    assert all(v["a"] == 2 for t, v in seen.items() if 45 < t < 60)
    assert all(v == {"a": 0, "b": 1} for t, v in seen.items() if 75 < t < 90)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    def first(seed, n=2000):
        it = poisson_arrivals({"a": 0.5, "b": 1.5}, seed)
        return [next(it) for _ in range(n)]

    a, b = first(1), first(1)
    assert a == b and a != first(2)
    times = np.array([x.time for x in a])
    assert np.all(np.diff(times) > 0)
    assert abs(times[-1] / len(times) - 0.5) < 0.05  # mean gap 1 / (0.5 + 1.5)
    share = sum(x.workload == "a" for x in a) / len(a)
    assert abs(share - 0.25) < 0.04


def test_open_loop_starts_agents_at_their_arrivals():
    it = poisson_arrivals({"a": 0.2}, seed=3)
    arrivals = [next(it) for _ in range(100)]
    backend = EchoBackend(delay=0.5)
    runner = Runner(backend, {"a": varied("a")})
    runner.open_loop(arrivals)
    backend.clock.run()
    firsts = sorted(rec.send_time for rec in runner.records if rec.request_id.endswith(":0#1"))
    assert firsts == [a.time for a in arrivals]
    assert runner.stats.arrived == runner.stats.admitted == runner.stats.finished == 100
    assert all(rec.queued == 0.0 for rec in runner.records)


def test_admission_cap_queues_agents_and_charges_the_wait_to_the_first_request():
    backend = EchoBackend(delay=1.0)
    runner = Runner(backend, {"a": varied("a", pause=20.0)}, stop_at=2000.0)
    runner.open_loop(poisson_arrivals({"a": 0.1}, seed=5), max_active=3)
    peak = []
    probe(backend.clock, 2000.0, 2.0,
          lambda t: peak.append((runner.active_agents, runner.waiting_agents)))
    backend.clock.run()
    assert max(a for a, _ in peak) == 3 and max(w for _, w in peak) > 0
    firsts = [rec for rec in runner.records if rec.request_id.endswith(":0#1")]
    queued = [rec for rec in firsts if rec.queued > 0]
    assert queued, "some agents waited for admission"
    # FIFO: agents start in arrival (index) order; only first requests carry the wait.
    order = [int(rec.agent_id.split("-")[1]) for rec in sorted(firsts, key=lambda r: r.send_time)]
    assert order == sorted(order)
    assert all(rec.queued == 0.0 for rec in runner.records if not rec.request_id.endswith(":0#1"))
    it = poisson_arrivals({"a": 0.1}, seed=5)
    arrival = {i: next(it).time for i in range(len(firsts))}
    for rec in queued:
        i = int(rec.agent_id.split("-")[1])
        assert abs(rec.send_time - rec.queued - arrival[i]) < 1e-9
