"""Table D.3 (paper D.4): six nodes from 4P2D, evinfra switching in place, Dynamo
relaunching, against the best static split of a sweep, through ``evinfra experiment``."""

from __future__ import annotations

import json

import msgspec

from evinfra.baselines import engine_overrides
from evinfra.cli import main
from evinfra.config import load_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.runs import RunOutcome
from evinfra.experiments.scale import FULL, QUICK


def test_the_runs_are_six_nodes_from_4p2d_with_each_systems_switch() -> None:
    config = load_config("etc/cluster.toml")
    plans = {p.key: p for p in EXPERIMENTS["tableD3"].plans(config, FULL, 1)}
    assert sorted(plans) == ["d3-static-1P", "d3-static-2P", "d3-static-3P", "d3-static-4P",
                             "d3-static-5P", "dynamo", "evinfra"]
    for p in plans.values():
        assert [n.name for n in p.config.cluster.nodes] == ["n0", "n1", "n2", "n3", "n4", "n5"]
        assert p.spec.warmup + p.spec.duration == 7200.0  # two hours
        assert p.spec.schedule[0].agents == {"cc": 84}
    assert plans["evinfra"].config.cluster.initial_prefill == 4
    assert plans["dynamo"].config.cluster.initial_prefill == 4
    assert engine_overrides(plans["evinfra"].config.policy)["switch"] == "in_place"
    assert engine_overrides(plans["dynamo"].config.policy)["switch"] == "relaunch"
    assert {p.config.policy.planner for k, p in plans.items() if "static" in k} == {
        "evinfra-fixed"}
    assert not any(p.config.planner.adapt for k, p in plans.items() if "static" in k)


def test_the_table_sums_switch_time_and_compares_with_the_sweeps_best(tmp_path) -> None:
    out = tmp_path / "d3"
    assert main(["experiment", "tableD3", "--quick", "--out", str(out), "--jobs", "1"]) == 0
    data = json.loads((out / "results.json").read_text())
    runs = {k: msgspec.convert(v, RunOutcome) for k, v in data["runs"].items()}
    assert sorted(runs) == ["d3-static-2P", "d3-static-4P", "dynamo", "evinfra"]  # 6P: none
    rows = {r[0].split(" (")[0]: r for r in data["tables"][0]["rows"]}
    ev, best = runs["evinfra"], max((runs["d3-static-2P"], runs["d3-static-4P"]),
                                    key=lambda o: (o.summary.throughput, -o.summary.e2e.mean))
    assert rows["best static"][0] == f"best static ({best.system})"
    assert rows["evinfra"][1:6] == [ev.control.final_split, ev.summary.e2e.mean,
                                    ev.summary.e2e.mean / best.summary.e2e.mean,
                                    ev.control.switches,
                                    ev.control.switches * ev.control.mean_switch_time]
    if ev.control.switches:  # in place: the config's 0.7 s each
        assert abs(rows["evinfra"][5] - 0.7 * ev.control.switches) < 1e-6
    assert rows["evinfra"][7:] == ["2P4D", 15.9, 27.0] and rows["dynamo"][7:] == [
        "3P3D", 21.9, 913.0]
    # Control: a sweep whose other split is faster makes that one the best static split.
    other = "d3-static-4P" if best.key == "d3-static-2P" else "d3-static-2P"
    faster = dict(runs)
    faster[other] = msgspec.structs.replace(runs[other], summary=msgspec.structs.replace(
        runs[other].summary, throughput=best.summary.throughput + 1.0))
    report, _ = EXPERIMENTS["tableD3"].report(faster, QUICK, "etc/cluster.toml", 1)
    assert report.tables[0].rows[-1][0] == f"best static ({runs[other].system})"
