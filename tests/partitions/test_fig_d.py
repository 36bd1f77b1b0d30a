"""``evinfra experiment figD1`` and ``figD2``: what they plan (sizes, the paper's split, the
groups' constant aggregate, one agent population for every system), and figD2 end to end at
a micro scale through its tables."""

from __future__ import annotations

import json
from collections import Counter

import msgspec
import pytest

from evinfra.config import parse_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.report import write
from evinfra.experiments.runs import run_plans
from evinfra.experiments.scale import FULL, QUICK

CONFIG = parse_config({})  # the paper's defaults: nine nodes
MICRO = msgspec.structs.replace(QUICK, name="micro", warmup=60.0, duration=120.0,
                                agents=1 / 128, t_learn=60.0, t_win=60.0, m=3, hold_off=10.0)


def test_fig_d1_sizes_the_cluster_at_the_papers_ratio():
    plans = EXPERIMENTS["figD1"].plans(CONFIG, FULL, 1)
    by = {p.key: p for p in plans}
    for n, prefill in ((9, 3), (16, 6), (32, 12), (64, 24)):  # 24P40D on 64 nodes
        static, ev = by[f"{n}-static"], by[f"{n}-evinfra"]
        assert len(static.config.cluster.nodes) == n == len(ev.config.cluster.nodes)
        assert static.config.cluster.initial_prefill == prefill == ev.config.cluster.initial_prefill
        assert static.config.policy.name == "static-sglang" and not static.config.planner.adapt
        assert ev.config.policy.name == "evinfra" and ev.config.planner.adapt
        assert static.spec.schedule[0].agents == {"cc": 40 * n} == ev.spec.schedule[0].agents


@pytest.mark.parametrize("scale", [FULL, QUICK])
def test_fig_d2_keeps_the_aggregate_while_two_partitions_shift(scale):
    plans = EXPERIMENTS["figD2"].plans(CONFIG, scale, 1)
    ev = [p for p in plans if p.key.startswith("evinfra-")]
    assert len(ev) == 8 and len(plans) == 24
    nodes = 96 if scale is FULL else 9
    assert all(len(p.config.cluster.nodes) == nodes for p in plans)
    if scale is FULL:
        assert sum(max(sum(ph.agents.values()) for ph in p.spec.schedule) for p in ev) == 30_720
    # The cluster's composition at each scored third is the same; two partitions change.
    edges = [scale.warmup + scale.duration * k / 3 + 1 for k in range(3)]
    totals, shifting = [], 0
    for p in ev:
        seen = []
        for t in edges:
            acc = 0.0
            for ph in p.spec.schedule:
                acc += ph.duration
                if t < acc:
                    seen.append(dict(ph.agents))
                    break
        shifting += len({tuple(sorted(s.items())) for s in seen}) > 1
        totals.append(seen)
    assert shifting == 2
    per_third = [sum((Counter(t[k]) for t in totals), Counter()) for k in range(3)]
    assert per_third[0] == per_third[1] == per_third[2]
    # Every system serves the same agents in a partition: the gains compare like with like.
    seeds = {(p.key.split("-p")[-1], p.seed) for p in plans}
    assert len(seeds) == 8 and len({s for _, s in seeds}) == 8


def test_fig_d2_micro_reports_each_partitions_gain_and_imbalance(tmp_path):
    plans = EXPERIMENTS["figD2"].plans(CONFIG, MICRO, 2)
    runs = run_plans(plans, jobs=2)
    report, plots = EXPERIMENTS["figD2"].report(runs, MICRO, "defaults", 2)
    write(tmp_path, report, plots)
    data = json.loads((tmp_path / "results.json").read_text())
    per = next(t for t in data["tables"] if t["title"] == "Per partition")
    assert [r[0] for r in per["rows"]] == [f"p{i}" for i in range(8)]
    assert [r[1] for r in per["rows"]] == ["steady"] * 6 + ["to-codex", "to-cc"]
    for r in per["rows"]:
        assert r[4] == pytest.approx(r[3] / r[2], rel=1e-3)  # the gain is evinfra / static
    cluster = {r[0]: r[1] for r in next(t for t in data["tables"]
                                        if t["title"] == "The cluster beside the paper")["rows"]}
    assert "P/D ratio variation of the cluster (evinfra)" in cluster
    assert cluster["worst partition's queueing / cluster average (static)"] >= 1.0
    assert (tmp_path / "figD2.png").stat().st_size > 0
