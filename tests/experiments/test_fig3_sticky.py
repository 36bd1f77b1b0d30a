"""Fig. 3(c)'s sticky-session router beside cache-aware routing, through fig3's plans,
follow-ups and report."""

from __future__ import annotations

import msgspec

from evinfra.config import load_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.runs import run_plans
from evinfra.experiments.scale import QUICK

MICRO = msgspec.structs.replace(QUICK, name="micro", warmup=120.0, duration=240.0,
                                agents=1 / 16, sweep=(4,))


def test_fig3c_runs_the_gateways_sticky_sessions_at_the_best_static_split() -> None:
    config = load_config("etc/cluster.toml")
    fig3 = EXPERIMENTS["fig3"]
    sweep = [p for p in fig3.plans(config, MICRO, 1) if "-static-" in p.key]
    runs = run_plans(sweep, jobs=1)
    later = {p.key: p for p in fig3.followups(config, MICRO, 1, runs)}
    sticky = later["router-sticky-sglang"]
    assert sticky.system == "sticky" and sticky.config.policy.name == "sticky-sglang"
    assert sticky.config.cluster.initial_prefill == 4 and not sticky.config.planner.adapt
    runs.update(run_plans([sticky], jobs=1))
    report, _ = fig3.report(runs, MICRO, "etc/cluster.toml", 1)
    c = next(t for t in report.tables if t.title.startswith("(c) Routers"))
    rows = {r[0]: r for r in c.rows}
    assert set(rows) == {"static 4P5D", "sticky"}  # the cache-aware run is the sweep's
    assert "sticky 34 s" in c.note
    s, ca = runs["router-sticky-sglang"].summary, runs["cc-static-4P"].summary
    assert rows["sticky"][1:5] == [s.ttft.p95, s.e2e.mean, 100 * s.lost_kv_reuse,
                                   s.uncached_tokens_per_request]
    # Control: the same load, routed by session instead of by prefix, computes other tokens.
    assert s.uncached_tokens_per_request != ca.uncached_tokens_per_request
