"""The latency estimate's prefill queue (issue 43): a finite source (agents stop sending while
they wait, so at most the window's active sources queue) and batched prefill (a request's
prefill takes its batch's time)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from planner_fakes import OSWORLD, make_cluster
from test_latency_rule import NAMES, homogeneous, slice_of, window

from evinfra.core.events import RequestDone
from evinfra.planner import Split
from evinfra.planner.latency import Sources, predict_e2e
from evinfra.planner.planner import predict

D = np.array([[0.01, 0.01], [0.0, 0.0], [0.0, 0.0]])  # decode: 10 ms, no batch term
ONE = (np.array([100.0]), np.array([1.0]), 8 / 256, 2)  # n_iter, t_acc, k/E, t_fwd


def one_prefill_node(rate: float, **kw):
    """Two nodes, the candidate 1P1D: one prefill node of rate 1 request/s."""
    return predict_e2e(np.array([[1.0, 1.0]]), D, np.array([rate]), *ONE, **kw)


def test_the_finite_source_wait_by_hand():
    """M/M/1//2 serving 0.8/s at μ = 1: p = (1, 2, 2)/5 at r = γ/μ = 1, so the throughput is
    μ(p1 + p2) = 0.8 and W_q = L_q/λ = p2/0.8 = 0.5 s (Sakasegawa's M/M/1: 4 s)."""
    lat = one_prefill_node(0.8, sources=np.array([2.0]))
    assert lat.wait[0, 0] == pytest.approx(0.5, rel=1e-6)
    assert one_prefill_node(0.8).wait[0, 0] == pytest.approx(0.8 / 0.2)  # infinite source
    # Many sources: the M/M/1 wait (Sakasegawa's formula is exact at c = 1).
    many = one_prefill_node(0.7, sources=np.array([5000.0]))
    assert many.wait[0, 0] == pytest.approx(0.7 / 0.3, rel=0.01)
    # Sources alone with a server each never wait.
    assert one_prefill_node(0.8, sources=np.array([1.0])).wait[0, 0] == 0.0


def test_a_finite_source_saturates_instead_of_exploding():
    """At and past capacity an infinite source waits forever; 20 sources at most wait for
    the 19 others: (N − c)/μ_P. The wait grows with the rate up to that bound."""
    rates = [0.5, 0.9, 0.99, 0.999, 1.0, 1.5]
    finite = [one_prefill_node(r, sources=np.array([20.0])) for r in rates]
    waits = [x.wait[0, 0] for x in finite]
    assert all(a < b for a, b in zip(waits, waits[1:-1])) and waits[-2] == waits[-1] == 19.0
    assert np.isinf(one_prefill_node(1.0).wait[0, 0]) and np.isinf(one_prefill_node(1.5).e2e).all()
    # Capacity: the multiple of the rate the candidate keeps up with, source or not.
    assert [x.capacity[0, 0] for x in finite] == pytest.approx([1 / r for r in rates])
    assert np.isfinite(finite[-1].e2e).all() and finite[-1].capacity[0, 0] < 1


def test_a_prefill_takes_its_batchs_time():
    """A node prefills the requests waiting for it together: b = 1 + L_q/c of them, at most
    t̄/t_uc; TTFT = wait + b·S. Without a batch (or a queue) the prefill is S."""
    light = one_prefill_node(0.1, sources=np.array([20.0]), batch=np.array([[4.0]]))
    assert light.prefill[0, 0] == pytest.approx(1.0, rel=0.02)  # L_q ≈ 0.01
    heavy = one_prefill_node(0.7, sources=np.array([20.0]), batch=np.array([[4.0]]))
    lq = heavy.wait[0, 0] * 0.7
    assert 2.0 > lq > 1.0 and heavy.prefill[0, 0] == pytest.approx(1.0 + lq)
    assert heavy.ttft[0, 0] == pytest.approx(heavy.wait[0, 0] + heavy.prefill[0, 0])
    # L_q ≈ 7 waiting: behind a backed-up queue a prompt of a quarter of t̄ shares its
    # iteration with 3 others and, starting at a uniform offset, spans 1 + 1/4 of them
    # (its neighbours fill one iteration's t̄): (1 + 4)·S. A prompt of two t̄ spans 3 (1.5 S).
    capped = one_prefill_node(0.99, sources=np.array([20.0]), batch=np.array([[4.0]]))
    assert capped.prefill[0, 0] == 5.0
    long = one_prefill_node(0.99, sources=np.array([20.0]), batch=np.array([[0.5]]))
    assert long.prefill[0, 0] == 1.5
    alone = one_prefill_node(0.01, sources=np.array([20.0]), batch=np.array([[0.5]]))
    assert alone.prefill[0, 0] == pytest.approx(1.0, abs=1e-3)  # no queue: its own S
    unbatched = one_prefill_node(0.9, sources=np.array([20.0]))
    assert unbatched.prefill[0, 0] == unbatched.service[0, 0] == 1.0


def test_the_planner_batches_up_to_its_prefill_nodes_mean_t_bar():
    """``predict`` passes each candidate's prefill nodes' mean t̄ over the slice's t_uc as the
    batch. At 1P a queue forms: prompts of ~2.3K tokens share 8,192-token iterations with
    several others, prompts of ~9K share only their first and last iteration (at most
    ``1 + t̄/t_uc`` < 2 of their own time)."""
    slices = window(np.random.default_rng(0), (290, 310))
    split = Split.of(NAMES, NAMES[:2])
    sources = [400.0] * len(slices)
    _, lat = predict(homogeneous(9), split, slices, sources)
    short = np.array([s.t_uc < 8192 for s in slices])
    assert short.sum() == 5 and (lat.wait[:, 0] > 0.1 * lat.service[:, 0]).all()
    assert (lat.prefill[short, 0] > 1.1 * lat.service[short, 0]).all()
    assert (lat.prefill[~short, 0] > lat.service[~short, 0]).all()
    assert (lat.prefill[~short, 0] < 2 * lat.service[~short, 0]).all()
    lq = lat.wait[:, 0] * np.array([s.requests / s.length for s in slices])  # one node: c = 1
    t_uc = np.array([s.t_uc for s in slices])
    np.testing.assert_allclose(lat.prefill[:, 0],
                               np.minimum(1 + lq, 1 + 8192 / t_uc) * lat.service[:, 0])
    one = [msgspec.structs.replace(x, t_bar=1.0) for x in homogeneous(9)]  # t̄ ≪ every t_uc
    _, unbatched = predict(one, split, slices, sources)
    np.testing.assert_allclose(unbatched.prefill, unbatched.service, rtol=1e-3)
    with pytest.raises(ValueError, match="3 source counts for 10 slices"):
        predict(homogeneous(9), split, slices, [1.0, 2.0, 3.0])


def test_sources_are_the_branches_active_in_each_slice():
    s = Sources(100.0, 200.0, 4)
    assert s.per_slice() is None  # none seen: an infinite source
    s.add("a", 90.0, 110.0)  # in flight at the start: counts from the start
    s.add("a", 140.0, 160.0)  # active 100-160
    s.add("b", 120.0, 199.0)  # active 120-199
    s.add("c", 150.0, 210.0)  # ends after the window: another window's
    assert s.per_slice() == pytest.approx([1.0 + 0.2, 2.0, 1.0 + 0.4, 0.96])
    # Requests in flight at the window's end keep their branches active to it: a from its
    # first request (100), c from its waiting one (150), d, never done, from the start.
    waiting = {"a": 170.0, "c": 150.0, "d": 80.0}
    assert s.per_slice(waiting) == pytest.approx([2.2, 3.0, 4.0, 3.96])
    assert s.per_slice() == pytest.approx([1.0 + 0.2, 2.0, 1.0 + 0.4, 0.96])  # unchanged
    assert Sources(100.0, 200.0, 4).per_slice({"d": 150.0}) == pytest.approx([0, 0, 1, 1])


def test_the_planner_measures_its_sources_and_decides_with_them(monkeypatch):
    import evinfra.planner.planner as module

    c = make_cluster(prefill=3, objective="latency")
    c.warmup()
    p = c.planner
    start, dt = p.window_end - p.config.t_win, p.config.t_win / p.config.m
    for k in range(30):  # 30 branches, each sending every dt/2 over the whole window
        for j in range(2 * p.config.m):
            t = start + j * dt / 2
            p.observe_done(RequestDone(request=f"r{k}.{j}", branch=f"b{k}", arrival=t,
                                       end=t + dt / 4, status="ok", prompt_tokens=1,
                                       output_tokens=1))
    seen: dict = {}
    real = module.plan
    monkeypatch.setattr(module, "plan", lambda *a, **k: seen.update(k) or real(*a, **k))
    c.window([OSWORLD] * p.config.m)
    assert p.sources[:-1] == pytest.approx([30.0] * (p.config.m - 1))
    assert p.sources[-1] == pytest.approx(30 * 0.75)  # the last request ends at 3/4 of it
    assert seen["sources"] == p.sources and seen["objective"] == "latency"
    # The next window counts afresh.
    c.window([OSWORLD] * p.config.m)
    assert p.sources is None


def test_a_branch_waiting_at_the_windows_end_stays_an_active_source():
    """b0's second request arrives in the window's first slice and is still in flight when
    the window closes: b0 is active to the window's end, and through the whole next window
    while it waits. b1 (the control) sends no second request: it counts up to its request's
    end only. The decision carries the sources the latency rule used."""
    c = make_cluster(prefill=3, objective="latency")
    c.warmup()
    p = c.planner
    m, start = p.config.m, p.window_end - p.config.t_win
    dt = p.config.t_win / m

    def done(branch: str, k: int, arrival: float, end: float) -> RequestDone:
        return RequestDone(request=f"{branch}.{k}", branch=branch, arrival=arrival, end=end,
                           status="ok", prompt_tokens=1, output_tokens=1)

    for b in ("b0", "b1"):
        p.observe_arrival(b, start)
        p.observe_done(done(b, 0, start, start + dt / 2))
    p.observe_arrival("b0", start + dt / 2)
    c.window([OSWORLD] * m)
    assert p.sources == pytest.approx([1.5] + [1.0] * (m - 1))
    assert c.decisions[-1].sources == p.sources
    c.window([OSWORLD] * m)
    assert p.sources == pytest.approx([1.0] * m)
    t = p.window_end - p.config.t_win
    p.observe_done(done("b0", 1, start + dt / 2, t + dt / 4))
    c.window([OSWORLD] * m)
    assert p.sources == pytest.approx([0.25] + [0.0] * (m - 1))
    c.window([OSWORLD] * m)
    assert p.sources is None  # nothing in flight, nothing done: an infinite source


def test_a_decode_node_runs_at_most_what_its_gpu_kv_holds():
    """One decode node, T_D^iter(B) = 10 ms + 1 ms·B, 100 iterations per request, 5 req/s:
    the population that serves the rate is B* = 500·0.01/(1 − 0.5) = 10. A node that holds
    20 keeps the estimate as without a bound; one that holds 8 cannot serve the rate
    (E2E inf, capacity 8/(500·0.018) < 1). The control, no bound, keeps up."""
    d = np.array([[0.01, 0.01], [0.0, 0.0], [0.001, 0.001]])
    args = (np.array([[100.0, 100.0]]), d, np.array([5.0]), *ONE)
    free = predict_e2e(*args)
    assert np.isfinite(free.e2e[0, 0]) and free.capacity[0, 0] == pytest.approx(1 / 0.5)
    roomy = predict_e2e(*args, cap=np.array([[20.0]]))
    assert roomy.e2e[0, 0] == free.e2e[0, 0] and roomy.tpot[0, 0] == free.tpot[0, 0]
    assert roomy.capacity[0, 0] == pytest.approx(20 / (500 * 0.03))  # B* = 20 at 4/3 the rate
    tight = predict_e2e(*args, cap=np.array([[8.0]]))
    assert np.isinf(tight.e2e[0, 0]) and np.isinf(tight.tpot[0, 0])
    assert tight.capacity[0, 0] == pytest.approx(8 / (500 * 0.018))
    assert predict_e2e(*args, cap=np.array([[np.inf]])).e2e[0, 0] == free.e2e[0, 0]


def test_the_planner_bounds_each_candidates_decode_by_its_nodes_gpu_kv():
    """4 req/s of 203K-token contexts: a GB300 node's 2.06M tokens hold 10 of them, so 8P1D's
    one decode node cannot serve the rate (Θ's bound, ``planner.py`` ``_theta``) and 7P2D
    can. The control, nodes that report no capacity: 8P1D keeps up."""
    names = [f"n{i}" for i in range(9)]
    slices = [slice_of([(3000, 200_000, 300)] * 240, 50, 60.0 * i) for i in range(10)]
    split = Split.of(names, names[:6])
    _, free = predict(homogeneous(9), split, slices)
    gb300 = [msgspec.structs.replace(x, kv_tokens=2_060_000) for x in homogeneous(9)]
    _, bound = predict(gb300, split, slices)
    assert np.isfinite(free.e2e[:, 7]).all() and (free.capacity[:, 7] > 4).all()
    assert np.isinf(bound.e2e[:, 7]).all() and (bound.capacity[:, 7] < 1).all()
    assert np.isfinite(bound.e2e[:, 6]).all() and (bound.capacity[:, 6] > 1).all()
    assert (bound.e2e[:, :7] == free.e2e[:, :7]).all()
