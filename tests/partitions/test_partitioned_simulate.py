"""``evinfra simulate --partitions``: each partition its own control plane; one merged
report, byte-identical whether the partitions play serially, in processes or on a local Ray."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from evinfra.cli import main

# A small cluster: 3 fake nodes per partition, the planner deciding within the run.
CONFIG = """
[cluster]
initial_prefill = 1
nodes = [{ name = "n0" }, { name = "n1" }, { name = "n2" }]
[planner]
t_learn = 60.0
t_win = 60.0
m = 3
hold_off = 10.0
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("cfg") / "cluster.toml"
    f.write_text(CONFIG)
    return f


def simulate(config: Path, out: Path, *extra: str, seed: int = 3) -> bytes:
    args = ["simulate", "--config", str(config), "--workload", "cc", "--agents", "24",
            "--warmup", "60", "--duration", "180", "--seed", str(seed), "--partitions", "8",
            "--out", str(out), "--no-progress", "--log-level", "error", *extra]
    assert main(args) == 0
    return (out / "report.json").read_bytes()


@pytest.fixture(scope="module")
def serial(config, tmp_path_factory) -> bytes:
    return simulate(config, tmp_path_factory.mktemp("serial"))


def test_the_merged_report_covers_the_cluster_and_each_partition(serial):
    r = json.loads(serial)
    assert r["run"]["partitions"] == 8 and r["cluster"]["nodes"] == 24
    parts = r["partitions"]
    assert [p["name"] for p in parts] == [f"p{i}" for i in range(8)]
    # The cluster's requests are the partitions' requests, its latencies theirs pooled.
    assert r["cluster"]["summary"]["requests"] == sum(p["summary"]["requests"] for p in parts)
    assert r["cluster"]["summary"]["requests"] > 0
    busy = [p for p in parts if p["summary"]["requests"]]
    assert min(p["summary"]["ttft"]["p95"] for p in busy) <= r["cluster"]["summary"]["ttft"]["p95"] \
        <= max(p["summary"]["ttft"]["p95"] for p in busy)
    assert len(r["cluster"]["prefill_per_minute"]) == 3
    assert r["cluster"]["prefill_per_minute"] == [
        sum(p["prefill_per_minute"][m] for p in parts) for m in range(3)]
    assert r["cluster"]["queueing_imbalance"] >= 1.0
    assert {"queueing_vs_cluster_max", "pd_ratio_variation", "control"} <= set(parts[0])


def test_the_same_seed_gives_the_same_bytes_in_worker_processes(config, serial, tmp_path):
    assert simulate(config, tmp_path / "jobs", "--jobs", "2") == serial
    # The control: another seed is another run.
    assert simulate(config, tmp_path / "other", seed=4) != serial


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is the optional extra evinfra[ray]")
def test_the_same_seed_gives_the_same_bytes_on_a_local_ray(config, serial, tmp_path):
    assert simulate(config, tmp_path / "ray", "--ray") == serial


def test_bad_partition_arguments_are_one_line_errors(config, tmp_path, capsys):
    base = ["simulate", "--config", str(config), "--workload", "cc", "--agents", "4",
            "--out", str(tmp_path)]
    for extra, says in [(["--partitions", "0"], "--partitions must be at least 1"),
                        (["--partitions", "2", "--jobs", "0"], "--jobs must be at least 1"),
                        (["--partitions", "2", "--binding", "groups"], "needs --workload shift")]:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


GROUPS = """
[[groups]]
name = "steady"
partitions = 2
schedule = [[240, {cc = 3}]]

[[groups]]
name = "to-codex"
partitions = 1
schedule = [[120, {cc = 3, codex = 0}], [120, {cc = 0, codex = 3}]]
"""


def test_constraint_groups_give_partitions_their_own_composition(config, tmp_path):
    groups = tmp_path / "groups.toml"
    groups.write_text(GROUPS)
    out = tmp_path / "groups"
    assert main(["simulate", "--config", str(config), "--workload", "shift", "--groups",
                 str(groups), "--partitions", "3", "--warmup", "60", "--duration", "180",
                 "--out", str(out), "--no-progress", "--log-level", "error"]) == 0
    r = json.loads((out / "report.json").read_text())
    assert r["run"]["binding"] == "groups"
    assert [p["group"] for p in r["partitions"]] == ["steady", "steady", "to-codex"]
    assert all(p["summary"]["requests"] > 0 for p in r["partitions"])
    assert "to-codex: 1 x 120 s {'cc': 3, 'codex': 0}" in r["run"]["load"]
    wrong = tmp_path / "wrong.toml"
    wrong.write_text(GROUPS.replace("partitions = 2", "partitions = 3"))
    assert main(["simulate", "--config", str(config), "--workload", "shift", "--groups",
                 str(wrong), "--partitions", "3", "--out", str(out)]) == 2


def test_partition_flags_without_partitions_are_refused(config, tmp_path, capsys):
    assert main(["simulate", "--config", str(config), "--workload", "cc", "--agents", "2",
                 "--jobs", "2", "--out", str(tmp_path)]) == 2
    assert "go with --partitions" in capsys.readouterr().err
