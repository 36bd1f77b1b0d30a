"""The simulator end to end, through ``evinfra simulate``'s own entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evinfra.cli import main
from tests.sim.small_cluster import SMALL


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("sim") / "small.toml"
    p.write_text(SMALL)
    return p


def simulate(config: Path, out: Path, *extra: str) -> dict:
    code = main(["simulate", "--config", str(config), "--duration", "300", "--warmup", "150",
                 "--seed", "3", "--out", str(out), "--no-progress", *extra])
    assert code == 0
    return json.loads((out / "report.json").read_text())


def test_same_seed_same_report_bytes(config, tmp_path):
    a = simulate(config, tmp_path / "a", "--workload", "cc", "--agents", "6")
    simulate(config, tmp_path / "b", "--workload", "cc", "--agents", "6")
    assert (tmp_path / "a" / "report.json").read_bytes() == (tmp_path / "b" / "report.json").read_bytes()
    s = a["summary"]
    assert s["requests"] > 20 and s["errors"] == 0
    assert 0 <= s["kv_hit_rate"] <= s["ideal_hit_rate"] <= 1
    assert s["lost_kv_reuse"] == pytest.approx(1 - s["kv_hit_rate"] / s["ideal_hit_rate"], abs=1e-5)
    assert s["ttft"]["p50"] <= s["e2e"]["p50"]
    by_wait = s["reuse_by_wait"]
    assert {"first", "<10s"} <= set(by_wait)  # sub-agents start branches; tools answer fast
    assert sum(x["requests"] for x in by_wait.values()) == s["requests"]
    assert sum(x["cached"] for x in by_wait.values()) == s["cached_tokens"]
    md = (tmp_path / "a" / "report.md").read_text()
    table = md[md.index("| sent after |"):].split("\n\n")[0].splitlines()
    assert len(table) == 2 + len(by_wait)  # every wait has its row
    for f in ("report.md", "split.png", "ttft_cdf.png", "queueing.png"):
        assert (tmp_path / "a" / f).stat().st_size > 0


def test_a_different_seed_changes_the_run(config, tmp_path):
    a = simulate(config, tmp_path / "a", "--workload", "osworld", "--agents", "6")
    code = main(["simulate", "--config", str(config), "--duration", "300", "--warmup", "150",
                 "--seed", "4", "--out", str(tmp_path / "b"), "--no-progress", "--workload",
                 "osworld", "--agents", "6"])
    assert code == 0
    b = json.loads((tmp_path / "b" / "report.json").read_text())
    assert a["summary"] != b["summary"]


def test_open_loop_and_a_trace(config, tmp_path):
    r = simulate(config, tmp_path / "open", "--workload", "putnam", "--arrival-rate", "0.05",
                 "--max-active", "4")
    assert r["run"]["load"].startswith("open")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": 7000 * i, "input_length": 900 + 10 * i,
                    "output_length": 20, "hash_ids": [1, 2, 3 + i % 2]}) + "\n" for i in range(60)))
    t = simulate(config, tmp_path / "trace", "--trace", str(trace), "--format", "mooncake")
    assert t["summary"]["requests"] > 10
    assert t["summary"]["kv_hit_rate"] > 0.2  # the trace's shared blocks are reused


def test_the_planner_decides_in_simulated_windows(config, tmp_path):
    r = simulate(config, tmp_path / "shift", "--workload", "cc", "--agents", "10")
    assert r["control"]["decisions"] >= 1
    assert r["control"]["decision_log"]
    assert r["control"]["final_split"].endswith("D")


def test_bad_arguments_are_one_line_errors(config, tmp_path, capsys, monkeypatch):
    assert main(["simulate", "--config", str(config), "--workload", "nope", "--agents", "3",
                 "--out", str(tmp_path)]) == 2
    assert main(["simulate", "--config", str(config), "--workload", "cc", "--out", str(tmp_path)]) == 2
    assert main(["simulate", "--config", str(tmp_path / "missing.toml"), "--workload", "cc",
                 "--agents", "3", "--out", str(tmp_path)]) == 2
    # Files: a missing trace, and an output path that cannot be a directory (checked
    # before the run, not after it).
    assert main(["simulate", "--config", str(config), "--trace", str(tmp_path / "none.jsonl"),
                 "--format", "mooncake", "--duration", "10", "--out", str(tmp_path)]) == 2
    (tmp_path / "a-file").write_text("")

    def no_run(*args, **kwargs):
        raise AssertionError("simulated before checking where the report goes")

    monkeypatch.setattr("evinfra.sim.command.simulate", no_run)
    assert main(["simulate", "--config", str(config), "--workload", "cc", "--agents", "3",
                 "--duration", "60", "--out", str(tmp_path / "a-file"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("evinfra: error:") for line in err)
    assert "none.jsonl" in err[3] and "a-file" in err[4]


def test_serve_refuses_a_port_out_of_range(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", "etc/cluster.toml", "--port", "99999"])
    assert exit_.value.code == 2
    assert "--port: 99999 is not a port" in capsys.readouterr().err


def test_agents_without_hints_get_their_branches_inferred(config, tmp_path):
    r = simulate(config, tmp_path / "bare", "--workload", "cc", "--agents", "6", "--no-hints")
    assert r["run"]["hints"] is False
    c, s = r["control"], r["summary"]
    # Each agent's first request is a branch of one; its later ones join one branch.
    assert c["branches_inferred"] >= 6 and c["requests_chained"] >= s["requests"] // 2
    # Sub-agents end when their parents take their reports in (4 in this run).
    assert c["branches_joined"] >= 2
    md = (tmp_path / "bare" / "report.md").read_text()
    assert "sent no branch hints" in md and f"{c['branches_joined']} ended by a prompt" in md
    hinted = simulate(config, tmp_path / "hinted", "--workload", "cc", "--agents", "6")
    assert hinted["run"]["hints"] is True and hinted["control"]["requests_chained"] == 0
