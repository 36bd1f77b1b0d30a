"""Table D.3 (paper D.4): phase switches when prefill and decode run with different
parallelism, six nodes, evinfra and Dynamo from 4P2D, against the best static split.

In the paper, TP8 prefill and ADP8 decode on 8xB200 nodes make a phase switch a relaunch
for Dynamo (SGLang chooses parallelism at launch) and an in-place change of the attention
path for evinfra, whose nodes hold both weight layouts. What this simulator plays:

* the first six nodes of the config, starting from 4P2D;
* per-phase iteration times: the fake engine's prefill (Eq. 1, ``c0``-``c3``) and decode
  (Eq. 2, ``d0``-``d2``) coefficients are separate already, and the planner fits both per
  node online; the paper gives no B200 TP8/ADP8 coefficients, so the config's GB300 ones
  are kept (no input was invented for them);
* the switch cost per system: evinfra in place (``switch_latency``, 0.7 s: the GB300
  measurement of Fig. 3a; D.4's per-switch cost is not stated), Dynamo a relaunch
  (``relaunch_s``, 666-831 s: Table C.1);
* the load: CC, because the workload package has no BrowseComp (sub-agent-only) generator,
  at 84 agents, the 14 per node of fig. 8's CC 126 on nine;
* two hours: the scale's warm-up, then the rest of two hours scored (quick: ten minutes in
  all, too short for a Dynamo relaunch to end);
* the best static split: evinfra's symmetric engines without adaptation (``evinfra-fixed``)
  swept over the splits (the scale's sweep), the highest throughput winning (paper 6.1).

Paper: evinfra moves to 2P4D, the best static split, with a mean E2E of 15.9 s against its
15.7 s; Dynamo ends at 3P3D with 21.9 s; engine-switch time summed over the two hours 27 s
(evinfra) against 913 s (Dynamo).
"""

from __future__ import annotations

import msgspec

from evinfra.config import Config
from evinfra.experiments.common import best_static, closed, label, system
from evinfra.experiments.report import ExperimentReport, Table, all_runs, bars
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["TITLE", "plans", "report"]

TITLE = "Table D.3: phase switches on six nodes from 4P2D, evinfra vs Dynamo vs best static"
NODES = 6
START = 4
AGENTS = 84
PLANNERS = ("evinfra", "dynamo")
SWEEP = "d3"
PAPER = {"evinfra": ("2P4D", 15.9, 27.0), "dynamo": ("3P3D", 21.9, 913.0),
         "best static": ("2P4D", 15.7, 0.0)}
"""(final split, mean E2E in s, engine-switch time summed in s)."""


def six(config: Config) -> Config:
    """``config`` on its first :data:`NODES` nodes, from 4P2D."""
    cluster = msgspec.structs.replace(config.cluster, nodes=config.cluster.nodes[:NODES],
                                      initial_prefill=START)
    return msgspec.structs.replace(config, cluster=cluster)


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    cfg = six(config)
    duration = 2 * scale.duration - scale.warmup  # two hours in all at full scale
    agents = {"cc": scale.count(AGENTS)}
    out = [closed(p, p, system(cfg, p), scale, seed, agents, duration) for p in PLANNERS]
    counts = [p for p in (scale.sweep or range(1, NODES)) if 0 < p < NODES]
    return out + [closed(f"{SWEEP}-static-{p}P", f"static {label(cfg, p)}",
                         system(cfg, "evinfra-fixed", prefill=p, fixed=True), scale, seed,
                         agents, duration) for p in counts]


def _switch_time(o: RunOutcome) -> float:
    return o.control.switches * o.control.mean_switch_time


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    swept = any(k.startswith(f"{SWEEP}-static-") for k in runs)
    best = best_static(runs, SWEEP) if swept else None
    rows = []
    for name, o in [(p, runs.get(p)) for p in PLANNERS] + [("best static", best)]:
        if o is None:
            continue
        split, e2e, switch = PAPER[name]
        rows.append([name if name != "best static" else f"best static ({o.system})",
                     o.control.final_split, o.summary.e2e.mean,
                     o.summary.e2e.mean / best.summary.e2e.mean if best else None,
                     o.control.switches, _switch_time(o), o.summary.throughput,
                     split, e2e, switch])
    tables = [
        Table(title="From 4P2D on six nodes (TP8 prefill / ADP8 decode in the paper)",
              columns=["system", "final split", "mean E2E (s)", "E2E × best static",
                       "switches", "engine-switch time summed (s)", "throughput (req/s)",
                       "paper split", "paper E2E (s)", "paper switch time (s)"], rows=rows,
              note="Switch time: each switch from the decision to the node serving its new "
                   "phase, summed over the scored window (a relaunch still under way at the "
                   "end is not counted). The fake engines keep the config's GB300 "
                   "coefficients per phase and evinfra's 0.7-s in-place switch: the paper's "
                   "B200 TP8/ADP8 times are not given. Load: CC (no BrowseComp generator)."),
        all_runs(runs),
    ]
    plots = [("tableD3.png", lambda p: bars(
        p, "six nodes from 4P2D", [r[0] for r in rows],
        {"mean E2E (s)": [r[2] for r in rows],
         "switch time / 100 (s)": [r[5] / 100 for r in rows]}, "s"))]
    return ExperimentReport(name="tableD3", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, runs=runs), plots
