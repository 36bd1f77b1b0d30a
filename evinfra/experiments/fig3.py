"""Figure 3 (paper 3): costly phase switches, misestimated compute demand, misjudged KV reuse,
on CC with 90 agents.

(a) switch time and lost KV reuse of the planners (evinfra, Dynamo, Arrow; all from 6P3D);
(b) their final split and throughput, beside SGLang PD at the best static split; (c) routers
at that split, fixed: the SGLang Model Gateway's cache-aware routing and its sticky sessions
(its ``manual`` policy keyed by agent, ``baselines/sticky.py``), Dynamo's KV router, Dynamo's
KV router with a host pool loaded at prefill start (the transfer plus upstream SGLang's
0.3-s load-back, D.6), and evinfra (Eq. 7 with the pool fetched while queued). The best
static split is this simulator's: SGLang PD swept over the splits
(the scale's sweep) on the same workload, the highest throughput winning (the paper's is
4P5D, Fig. 3b); the routers run once the sweep has chosen it (``followups``).

Paper: (a) Dynamo 681 s per switch and 5.1 % lost reuse, Arrow 55.5 % over 34 switches,
evinfra 0.7 s and 0.3 %; (b) Dynamo and Arrow 49 % and 65 % below the best static split's
4.9 req/s, Arrow ending at 8P1D, Dynamo at 2P7D; (c) P95 TTFT 27 s (cache-aware), 34 s
(sticky), 65 s (Dynamo KV router), 95 s (+ memory pool).
"""

from __future__ import annotations

from evinfra.config import Config
from evinfra.experiments.common import best_prefill, best_static, closed, sweep, system
from evinfra.experiments.report import (METRICS, ExperimentReport, Table, bars, higher,
                                        metrics_row, ratio_row)
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["TITLE", "followups", "plans", "report"]

TITLE = "Figure 3: phase switches, compute demand and KV reuse on CC with 90 agents"
AGENTS = 90
PLANNERS = ("evinfra", "dynamo", "arrow")
ROUTERS = (("cache-aware", "static-sglang"), ("sticky", "sticky-sglang"),
           ("dynamo KV router", "dynamo-kv"),
           ("+ memory pool", "dynamo-pool"), ("evinfra", "evinfra-fixed"))
"""At the best static split; the cache-aware run there is the sweep's best run itself."""
SWEEP = "cc"


def _sweep(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    agents = {"cc": scale.count(AGENTS)}
    return sweep(SWEEP, config, scale,
                 lambda key, name, cfg: closed(key, name, cfg, scale, seed, agents))


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    agents = {"cc": scale.count(AGENTS)}
    out = [closed(f"planner-{p}", p, system(config, p), scale, seed, agents) for p in PLANNERS]
    return out + _sweep(config, scale, seed)


def followups(config: Config, scale: Scale, seed: int,
              runs: dict[str, RunOutcome]) -> list[RunPlan]:
    """The routers at the sweep's best split (none until the sweep is in)."""
    best = best_prefill(runs, _sweep(config, scale, seed))
    if best is None:
        return []
    agents = {"cc": scale.count(AGENTS)}
    return [closed(f"router-{policy}", name, system(config, policy, prefill=best, fixed=True),
                   scale, seed, agents) for name, policy in ROUTERS if policy != "static-sglang"]


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    planners = [runs[f"planner-{p}"] for p in PLANNERS if f"planner-{p}" in runs]
    swept = any(k.startswith(f"{SWEEP}-static-") for k in runs)
    static = best_static(runs, SWEEP) if swept else None
    at = static.initial_split if static else "the best static split"
    routers = [static if policy == "static-sglang" else runs.get(f"router-{policy}")
               for _, policy in ROUTERS]
    routers = [o for o in routers if o is not None]
    a = [[o.system, o.control.switches, o.control.mean_switch_time,
          100 * o.summary.lost_kv_reuse] for o in planners]
    ev_p, ev_r = runs.get("planner-evinfra"), runs.get("router-evinfra-fixed")
    b = [[o.system, o.control.final_split, o.summary.throughput,
          o.summary.throughput / static.summary.throughput if static else None,
          higher(ev_p.summary.throughput, o.summary.throughput) if ev_p else None]
         for o in planners]
    if static is not None:
        b.append([f"SGLang PD {at} (best static)", static.control.final_split,
                  static.summary.throughput, 1.0,
                  higher(ev_p.summary.throughput, static.summary.throughput) if ev_p else None])
    c = [[o.system, o.summary.ttft.p95, o.summary.e2e.mean, 100 * o.summary.lost_kv_reuse,
          o.summary.uncached_tokens_per_request]
         + (ratio_row(ev_r.summary, o.summary)[1:3] if ev_r else [None, None])
         for o in routers]
    tables = [
        Table(title="(a) Phase switches and lost KV reuse (from 6P3D)",
              columns=["system", "switches", "mean switch time (s)", "lost KV reuse (%)"],
              rows=a,
              note="Paper: Dynamo 681 s per switch, 5.1 %; Arrow 34 switches, 55.5 %; "
                   "evinfra 0.7 s, 0.3 %."),
        Table(title="(b) Final split and throughput",
              columns=["system", "final split", "throughput (req/s)", "× best static",
                       "evinfra ×"], rows=b,
              note="Paper: Dynamo ends at 2P7D, Arrow at 8P1D, 49 % and 65 % below the best "
                   "static split (4.9 req/s); evinfra over twice either planner."),
        Table(title=f"(c) Routers at a fixed {at} (the best static split of the sweep; "
                    "the paper's: 4P5D)",
              columns=["router", "P95 TTFT (s)", "mean E2E (s)", "lost KV reuse (%)",
                       "uncached tokens per request", "evinfra E2E × lower",
                       "evinfra P95 TTFT × lower"], rows=c,
              note="Paper P95 TTFT: cache-aware 27 s, sticky 34 s, Dynamo KV router 65 s, "
                   "+ memory pool 95 s."),
        Table(title="All runs", columns=["run"] + METRICS,
              rows=[[o.key] + metrics_row(o.summary, o) for o in planners + routers]),
        Table(title="Static sweep (SGLang PD at each split)", columns=["run"] + METRICS,
              rows=[[o.key] + metrics_row(o.summary, o) for k, o in sorted(runs.items())
                    if k.startswith(f"{SWEEP}-static-")]),
    ]
    plots = [
        ("fig3a.png", lambda p: bars(p, "(a) lost KV reuse (%)", [o.system for o in planners],
                                     {"lost reuse": [100 * o.summary.lost_kv_reuse
                                                     for o in planners]}, "%")),
        ("fig3b.png", lambda p: bars(p, "(b) throughput", [r[0] for r in b],
                                     {"req/s": [r[2] for r in b]}, "req/s")),
        ("fig3c.png", lambda p: bars(p, f"(c) routers at {at}", [o.system for o in routers],
                                     {"P95 TTFT": [o.summary.ttft.p95 for o in routers],
                                      "mean E2E": [o.summary.e2e.mean for o in routers]},
                                     "seconds")),
    ]
    return ExperimentReport(name="fig3", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, runs=runs), plots
