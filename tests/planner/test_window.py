"""Slice statistics of a planning window (Algorithm E.3 line 15)."""

from __future__ import annotations

import pytest

from evinfra.core.events import PrefillItem
from evinfra.core.types import qk_pairs
from evinfra.planner import Window


def test_q_and_n_are_time_weighted_per_slice_and_carry_over():
    w = Window(start=100.0, length=40.0, m=4, q=8, n=9)  # slices of 10 s
    w.set_population(90.0, 10, 30)  # before the window: only the level at its start counts
    w.set_population(105.0, 20, 25)
    w.set_population(125.0, 0, 40)
    w.set_population(200.0, 5, 5)  # after the window
    slices = w.close()
    assert [s.q for s in slices] == pytest.approx([(10 * 5 + 20 * 5) / 10, 20, (20 * 5) / 10, 0])
    assert [s.n for s in slices] == pytest.approx([(30 * 5 + 25 * 5) / 10, 25,
                                                   (25 * 5 + 40 * 5) / 10, 40])
    assert [s.start for s in w.close()] == [100, 110, 120, 130]


def test_work_means_are_means_of_the_terms():
    w = Window(start=0.0, length=600.0, m=10, q=0, n=0)
    work = [(1000, 50_000, 300), (30_000, 0, 100)]
    for t_uc, t_c, t_out in work:
        w.add_request(61.0, t_uc, t_c, t_out)
    w.add_request(-1.0, 9, 9, 9)
    w.add_request(600.0, 9, 9, 9)
    w.add_decode(70.0, batch=10, accepted=18)
    s = w.close()[1]
    assert s.requests == 2 and s.usable
    assert s.t_uc == pytest.approx(15_500) and s.t_c == pytest.approx(25_000)
    assert s.A == pytest.approx((qk_pairs(1000, 50_000) + qk_pairs(30_000, 0)) / 2)
    assert s.t_out == pytest.approx(200) and s.t_acc == pytest.approx(1.8)
    # Decode KV per request over time: contexts 51,300 and 30,100 weighted by t_out 300 and
    # 100 (the plain mean would be 40,700).
    assert s.kv == pytest.approx(46_000)
    assert [x.requests for x in w.close()] == [0, 2] + [0] * 8


def test_t_acc_falls_back_to_the_window_and_ignores_unreported_acceptance():
    w = Window(start=0.0, length=20.0, m=2, q=0, n=0)
    w.add_decode(1.0, batch=4, accepted=8)
    w.add_decode(2.0, batch=4, accepted=4)
    w.add_decode(15.0, batch=4, accepted=0)  # the engine did not report accepted tokens
    a, b = w.close()
    assert a.t_acc == pytest.approx(1.5) and b.t_acc == pytest.approx(1.5)
    assert not Window(start=0.0, length=20.0, m=2, q=0, n=0).close()[0].usable


def test_remeasure_own_pooled_or_previous():
    w = Window(start=0.0, length=600.0, m=10, q=0, n=0)
    w.add_prefill(1.0, "p1", [PrefillItem("a", 8000, 10_000, 5_000)])
    w.add_prefill(2.0, "p2", [PrefillItem("b", 4000, 30_000, 0)])
    w.add_prefill(700.0, "p2", [PrefillItem("c", 1, 1, 1)])  # outside the window
    previous = {"p1": (100.0, 0.9), "p2": (100.0, 0.9), "d1": (100.0, 0.9)}
    got = w.remeasure(previous)
    assert got["p1"] == pytest.approx((8000, 0.5))
    assert got["p2"] == pytest.approx((4000, 0.0))
    assert got["d1"] == pytest.approx((6000, 5_000 / 40_000))
    assert Window(start=0.0, length=600.0, m=10, q=0, n=0).remeasure(previous) == previous
