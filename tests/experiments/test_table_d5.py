"""Table D.5 (paper D.6): upstream SGLang's load-back against the queued fetch, through the
experiment's plans, runs and report."""

from __future__ import annotations

import json

import msgspec

from evinfra.config import load_config
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.report import write
from evinfra.experiments.runs import run_plans
from evinfra.experiments.scale import QUICK

TINY = msgspec.structs.replace(QUICK, name="tiny", warmup=60.0, duration=240.0)


def test_the_two_runs_differ_only_in_when_the_engine_loads_fetched_kv() -> None:
    config = load_config("etc/cluster.toml")
    up, ev = EXPERIMENTS["tableD5"].plans(config, QUICK, 1)
    assert (up.config.policy.peer_fetch, ev.config.policy.peer_fetch) == ("prefill-start",
                                                                          "queued")
    assert up.config.cluster.initial_prefill == ev.config.cluster.initial_prefill == 4
    assert up.config.policy.name == ev.config.policy.name == "static-sglang"
    same = msgspec.structs.replace(up.config, policy=ev.config.policy)
    assert same == ev.config and up.config != ev.config
    assert up.spec == msgspec.structs.replace(ev.spec, label=up.spec.label)


def test_the_load_back_idles_the_prefill_nodes_and_the_queued_fetch_does_not(tmp_path):
    """Routing that ignores where prefixes are (cache threshold 1: every request goes to
    the smallest tree) makes most prompts fetch; upstream SGLang then waits for each
    load-back (0.3 s and the transfer) and its prefill nodes idle; the queued fetch lands
    while the request waits and never stalls an iteration."""
    config = load_config("etc/cluster.toml")
    config = msgspec.structs.replace(config, policy=msgspec.structs.replace(
        config.policy, cache_aware=msgspec.structs.replace(config.policy.cache_aware,
                                                           cache_threshold=1.0)))
    experiment = EXPERIMENTS["tableD5"]
    runs = run_plans(experiment.plans(config, TINY, 1), jobs=1)
    up, ev = runs["upstream-sglang"].extras, runs["evinfra-async"].extras
    assert up["prefill_loading_iterations"] >= 5
    assert up["prefill_mean_load"] > 0.3 and up["prefill_load_share"] > 0
    assert ev["prefill_loading_iterations"] == 0 and ev["prefill_load_share"] == 0
    assert up["prefill_idle_share"] > ev["prefill_idle_share"]
    assert up["prefill_waited_share"] > ev["prefill_waited_share"]
    assert (runs["upstream-sglang"].summary.ttft.mean
            > runs["evinfra-async"].summary.ttft.mean)
    report, plots = experiment.report(runs, TINY, "etc/cluster.toml", 1)
    write(tmp_path, report, plots)
    table = json.loads((tmp_path / "results.json").read_text())["tables"][0]
    rows = {r[0]: r[1:] for r in table["rows"]}
    idle = rows["prefill idle GPU time (%)"]
    assert idle[0] == 100 * up["prefill_idle_share"] and idle[1] == 100 * ev["prefill_idle_share"]
    assert idle[3] == "23.6 → 14.4"
    assert rows["mean load-back wait per iteration consuming host KV (s)"][0] > 0.3
    assert (tmp_path / "tableD5.png").exists()
