"""Table D.4 (paper D.5): ThunderAgent against cache-aware routing and evinfra, CC with 126
agents at the best static split, fixed (the paper's 4P5D; here the one this simulator's
sweep of SGLang PD on the same workload chooses, the three runs following the sweep),
minutes 30 to 85 scored.

ThunderAgent and cache-aware routing run the SGLang engines of the baselines (LRU host
eviction, private host memory) and differ only in the prefill choice; evinfra is the run
without online adaptation. Paper: ThunderAgent pauses no request (its estimate of the active
agents' KV peaks at 86 % of a node's capacity, 76 % on average), 0.95x the throughput and
1.14x the mean TTFT of cache-aware routing, 2.6 % against 2.4 % lost reuse; evinfra 1.35x the
throughput, 0.29x the mean TTFT, 0.7 % lost reuse.
"""

from __future__ import annotations

from evinfra.config import Config
from evinfra.experiments.common import best_prefill, best_static, closed, sweep, system
from evinfra.experiments.report import ExperimentReport, Table, all_runs, bars
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["TITLE", "followups", "plans", "report"]

TITLE = ("Table D.4: ThunderAgent vs cache-aware routing vs evinfra at the best static split, "
         "CC with 126 agents")
AGENTS = 126
SYSTEMS = (("ThunderAgent", "thunderagent"), ("cache-aware", "static-sglang"),
           ("evinfra", "evinfra-fixed"))


SWEEP = "cc"


def _sweep(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    duration = scale.duration * 55 / 60  # minutes 30 to 85
    return sweep(SWEEP, config, scale, lambda key, name, cfg: closed(
        key, name, cfg, scale, seed, {"cc": scale.count(AGENTS)}, duration))


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    return _sweep(config, scale, seed)


def followups(config: Config, scale: Scale, seed: int,
              runs: dict[str, RunOutcome]) -> list[RunPlan]:
    """The systems at the sweep's best split; cache-aware routing there is the sweep's best
    run itself (none until the sweep is in)."""
    best = best_prefill(runs, _sweep(config, scale, seed))
    if best is None:
        return []
    duration = scale.duration * 55 / 60
    return [closed(policy, name, system(config, policy, prefill=best, fixed=True), scale, seed,
                   {"cc": scale.count(AGENTS)}, duration)
            for name, policy in SYSTEMS if policy != "static-sglang"]


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    swept = any(k.startswith(f"{SWEEP}-static-") for k in runs)
    ca = best_static(runs, SWEEP) if swept else None
    at = ca.initial_split if ca else "the best static split"
    rows = []
    for name, policy in SYSTEMS:
        o = ca if policy == "static-sglang" else runs.get(policy)
        if o is None:
            continue
        s = o.summary
        rows.append([name, s.throughput,
                     s.throughput / ca.summary.throughput if ca else None, s.ttft.mean,
                     s.ttft.mean / ca.summary.ttft.mean if ca and ca.summary.ttft.mean else None,
                     100 * s.ideal_hit_rate, 100 * s.lost_kv_reuse,
                     o.extras.get("pauses"), _pct(o.extras.get("peak_use")),
                     _pct(o.extras.get("mean_use"))])
    tables = [
        Table(title=f"At a fixed {at} (the best static split of the sweep; the paper's: 4P5D)",
              columns=[
            "system", "throughput (req/s)", "× cache-aware", "mean TTFT (s)",
            "TTFT × cache-aware", "ideal hit rate (%)", "lost KV reuse (%)", "pauses",
            "peak use (%)", "mean use (%)"], rows=rows,
              note="Use: ThunderAgent's own estimate of its programs' KV over a node's GPU "
                   "plus host capacity (it pauses above 95 %)."),
        all_runs(runs),
    ]
    plots = [("tableD4.png", lambda p: bars(p, f"at {at}", [r[0] for r in rows],
                                            {"throughput": [r[1] for r in rows],
                                             "mean TTFT": [r[3] for r in rows]}, "req/s | s"))]
    return ExperimentReport(name="tableD4", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, runs=runs), plots


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x
