"""Issue 43's evidence: the latency estimate against measured runs at fixed splits
(``evinfra experiment latency``), and the latency rule beside the paper's in tableD2, fig6 and
fig7 (``--latency-rule``) within the issue's budget."""

from __future__ import annotations

import micro
import msgspec
import pytest
from test_experiments import swept

from evinfra.cli import main
from evinfra.config import load_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.latency import budget, observe, run_plans, score
from evinfra.experiments.runs import run_plans as play
from evinfra.experiments.scale import QUICK
from evinfra.planner.planner import predict

MICRO = msgspec.structs.replace(micro.MICRO, sweep=(2, 4))
CONFIG = load_config("etc/cluster.toml")


@pytest.fixture(scope="module")
def probed():
    """One micro run: osworld, closed loop, fixed at 4P5D."""
    plan = next(p for p in EXPERIMENTS["latency"].plans(CONFIG, MICRO, 1)
                if p.key == "osworld-closed-4P")
    return observe(plan)


def _double(windows):
    """The same windows with every node's iteration-time coefficients doubled."""
    fields = ("c0", "c1", "c2", "c3", "d0", "d1", "d2")
    return [msgspec.structs.replace(w, models=[
        msgspec.structs.replace(m, **{k: 2 * getattr(m, k) for k in fields})
        for m in w.models]) for w in windows]


def test_the_estimate_is_set_against_the_same_requests_and_a_wrong_model_scores_worse(probed):
    outcome, windows = probed
    # The planner's windows tile the scored period; the split is fixed.
    assert [(w.start, w.end) for w in windows] == [(120.0, 180.0), (180.0, 240.0)]
    assert {w.split.label for w in windows} == {"4P5D"} and outcome.control.switches == 0
    # The measured side is the run's own requests (closed loop: no admission wait).
    x = score(windows)
    assert x["requests"] == outcome.summary.requests > 50
    assert x["meas_e2e"] == pytest.approx(outcome.summary.e2e.mean, rel=0.01)
    assert x["meas_ttft"] == pytest.approx(outcome.summary.ttft.mean, rel=0.05)
    assert 0 <= x["meas_wait"] < x["meas_ttft"] < x["meas_e2e"]
    error = abs(x["pred_e2e"] / x["meas_e2e"] - 1)
    assert error < 0.2 and abs(x["pred_ttft"] / x["meas_ttft"] - 1) < 0.3
    assert x["unstable"] == 0 and 0 < x["rho"] < 1
    # The split's own column of the candidates' (control: its neighbours differ).
    assert x["pred_e2e"] == x["pred_e2e_4P"] != x["pred_e2e_3P"] != x["pred_e2e_5P"]
    # Control: the same windows with doubled coefficients predict far off.
    wrong = score(_double(windows))
    assert abs(wrong["pred_e2e"] / wrong["meas_e2e"] - 1) > error + 0.5
    assert wrong["pred_ttft"] > 1.5 * x["pred_ttft"]


def test_a_saturated_closed_loop_is_a_finite_source():
    """osworld, 36 agents, closed loop at 2P7D: the prefill side is saturated (ρ ≈ 1). The
    agents wait instead of sending, so the queue holds at most the window's active branches:
    the estimate with them is within 60 % of the measured E2E and prefill wait; an infinite
    source (M/M/c, the estimate before) is several times off. The prefill takes its batch's
    time, not one request's (S)."""
    scale = msgspec.structs.replace(MICRO, agents=0.25)
    plan = next(p for p in EXPERIMENTS["latency"].plans(CONFIG, scale, 1)
                if p.key == "osworld-closed-2P")
    _, windows = observe(plan)
    assert all(w.sources and 5 < min(w.sources) <= max(w.sources) < 60 for w in windows)
    x = score(windows)
    assert x["rho"] > 0.95 and x["unstable"] > 0.2 and x["meas_wait"] > x["meas_service"]
    assert abs(x["pred_e2e"] / x["meas_e2e"] - 1) < 0.6
    assert abs(x["pred_wait"] / x["meas_wait"] - 1) < 1.5
    infinite = score([msgspec.structs.replace(w, sources=None) for w in windows])
    assert infinite["pred_e2e"] / infinite["meas_e2e"] > 3
    assert infinite["pred_wait"] / infinite["meas_wait"] > 3
    _, lat = predict(windows[0].models, windows[0].split, windows[0].slices, windows[0].sources)
    # A request's 4.5-9K uncached tokens fill most of an 8K chunk, so a batch is little
    # more than one request; one request's time alone (the mutant) is less.
    assert (lat.prefill[:, 1] > lat.service[:, 1]).all()
    assert abs(x["pred_service"] / x["meas_service"] - 1) < 0.5


def test_the_table_reports_every_run_and_the_split_each_estimate_ranks_first():
    plans = [p for p in EXPERIMENTS["latency"].plans(CONFIG, MICRO, 1)
             if p.key.startswith("osworld-")]
    assert {p.key for p in plans} == {f"osworld-{loop}-{p}P" for loop in ("closed", "open")
                                      for p in (2, 4)}
    assert {p.config.planner.adapt for p in plans} == {False}
    runs = run_plans(plans, jobs=1)
    report, _ = EXPERIMENTS["latency"].report(runs, MICRO, "etc/cluster.toml", 1)
    table, summary, across = report.tables
    assert [r[:3] for r in table.rows] == [["osworld", loop, s] for loop in ("closed", "open")
                                           for s in ("2P7D", "4P5D")]
    e2e = table.columns.index("E2E rel. error")
    assert all(r[e2e] is not None and abs(r[e2e]) < 0.3 for r in table.rows)
    assert [r[:3] for r in summary.rows] == [["osworld", "closed", 2], ["osworld", "open", 2]]
    assert [r[:2] for r in across.rows] == [["osworld", "closed"], ["osworld", "open"]]
    # The open loop plays the same arrivals at every split.
    assert runs["osworld-open-2P"].runner.arrived == runs["osworld-open-4P"].runner.arrived > 0


def test_the_latency_rule_plays_beside_the_papers_only_when_asked():
    for name in ("fig6", "fig7"):
        default = EXPERIMENTS[name].plans(CONFIG, QUICK, 1)
        both = EXPERIMENTS[name].plans(CONFIG, QUICK, 1, latency_rule=True)
        assert {p.config.planner.objective for p in default} == {"throughput"}
        added = [p for p in both if p.config.planner.objective == "latency"]
        assert added and all(p.key.endswith("-evinfra-latency") for p in added)
        assert all(p.config.policy.name == "evinfra" for p in added)
        # The default runs are the same plans, so saved outcomes carry over.
        assert [p.digest for p in both if p not in added] == [p.digest for p in default]
    d2 = EXPERIMENTS["tableD2"]
    plans = d2.plans(CONFIG, QUICK, 1)
    later = d2.followups(CONFIG, QUICK, 1, swept(plans, _template(), 4))
    latency = [p for p in later if p.config.planner.objective == "latency"]
    assert {p.key for p in latency} == {f"{r:g}-evinfra-latency" for r in d2.RATES}
    assert {p.config.cluster.initial_prefill for p in latency} == {4}


def _template():
    """A micro outcome standing for the sweep's (as in test_experiments.py)."""
    plan = EXPERIMENTS["fig2a"].plans(CONFIG, msgspec.structs.replace(MICRO, sweep=(2,)), 1)[0]
    return play([plan], jobs=1)[plan.key]


def test_the_budget(probed):
    outcome, _ = probed

    def run(throughput: float, switches: int):
        return msgspec.structs.replace(
            outcome, summary=msgspec.structs.replace(outcome.summary, throughput=throughput),
            control=msgspec.structs.replace(outcome.control, switches=switches))

    row = budget(run(10.0, 2), run(9.8, 3), 1.0)
    assert row[2] == 2.0 and row[3:5] == [2.0, 3.0] and row[-1] == "yes"
    assert budget(run(10.0, 2), run(9.6, 2), 1.0)[-1] == "no"  # 4 % lost
    assert budget(run(10.0, 2), run(10.0, 5), 2.0)[-1] == "no"  # 1.5 more per hour
    assert budget(run(10.0, 2), run(10.0, 4), 2.0)[-1] == "yes"  # 1 more per hour


def test_the_command_refuses_what_it_cannot_play(capsys):
    assert main(["experiment", "fig3", "--quick", "--latency-rule"]) == 2
    assert "--latency-rule: fig3 does not play the latency rule" in capsys.readouterr().err
    assert main(["experiment", "latency", "--quick", "--ray"]) == 2
    assert "--ray: latency plays its runs in processes only" in capsys.readouterr().err
