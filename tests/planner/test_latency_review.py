"""What the latency estimate is judged on (issue 43): a fixed split's planner reviews its windows
as a decision would see them (``Planner.review``), and ``predict`` is the estimate the latency
rule decides on."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from planner_fakes import OSWORLD, make_cluster
from test_latency_rule import NAMES, homogeneous, window

from evinfra.planner import Split, plan
from evinfra.planner.planner import predict


def test_a_fixed_split_reviews_its_windows_as_a_decision_would_see_them():
    fixed, adaptive = make_cluster(prefill=3, adapt=False), make_cluster(prefill=3)
    for c in (fixed, adaptive):
        c.warmup()
    with pytest.raises(RuntimeError, match="no window has ended"):
        fixed.planner.review(fixed.planner.window_end - 1.0)
    end = fixed.planner.window_end
    fixed.planner.decide = fixed.planner.review  # what the probe calls instead of deciding
    slices = fixed.window([OSWORLD] * fixed.planner.config.m, drain=False)
    decision = adaptive.window([OSWORLD] * adaptive.planner.config.m, drain=False)
    assert slices == decision.slices and all(s.usable for s in slices)
    # The models are remeasured on the window, as for the decision (t̄, f moved).
    assert fixed.planner.models == adaptive.planner.models
    assert any(fixed.planner.models[n].t_bar != fixed.planner.fits[n].model.t_bar
               for n in fixed.planner.nodes)
    # The split stays; the next window starts at the review.
    assert fixed.planner.split.label == "3P6D" and fixed.planner.window_end == pytest.approx(
        end + fixed.planner.config.t_win)


def test_predict_is_what_the_latency_rule_decides_on():
    slices = window(np.random.default_rng(0), (290, 310))
    split = Split.of(NAMES, NAMES[:3])
    d = plan(homogeneous(9), split, slices, at=600.0, objective="latency")
    order, lat = predict(homogeneous(9), split, slices)
    assert order == d.order
    assert lat.e2e[:, 2].tolist() == d.e2e  # the current split's column
    two = next(c for c in d.candidates if c.prefill == 2)
    assert lat.e2e[:, 1].tolist() == two.e2e
    assert lat.e2e[:, 1].tolist() != d.e2e  # control: another split's column differs
    # TTFT = the wait for a prefill node + the prefill; E2E adds the decode.
    ok = np.isfinite(lat.wait)
    assert ok[:, 1:].all() and not ok[:, 0].all()  # one prefill node cannot keep up
    assert (lat.wait[ok] >= 0).all() and (lat.ttft[ok] > lat.wait[ok]).all()
    assert (lat.e2e[ok] > lat.ttft[ok]).all() and np.isinf(lat.ttft[~ok]).all()
    # Doubling the load makes the wait grow faster than the service time.
    heavy = [msgspec.structs.replace(s, requests=2 * s.requests) for s in slices]
    _, more = predict(homogeneous(9), split, heavy)
    assert (more.wait[:, 2] > 2 * lat.wait[:, 2]).all()
    with pytest.raises(ValueError, match="no usable slice"):
        predict(homogeneous(9), split, [msgspec.structs.replace(s, requests=0) for s in slices])


def test_the_planner_decides_with_its_configured_targets(monkeypatch):
    import evinfra.planner.planner as module

    c = make_cluster(prefill=3, objective="latency", ttft_target_s=0.4, tpot_target_s=0.01)
    c.warmup()
    seen: dict = {}
    real = module.plan
    monkeypatch.setattr(module, "plan", lambda *a, **k: seen.update(k) or real(*a, **k))
    c.window([OSWORLD] * c.planner.config.m)
    assert seen == {"at": pytest.approx(c.decisions[-1].at), "objective": "latency",
                    "latency_min_gain": 0.05, "ttft_target": 0.4, "tpot_target": 0.01,
                    "sources": None, "recent": [], "recent_sources": None}
