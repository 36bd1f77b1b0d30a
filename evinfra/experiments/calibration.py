"""``evinfra experiment calibration`` (issue 39): every figure the paper measured of the
*baselines and workloads*, beside what this simulator gives for it, with the relative error
and the input it constrains.

Calibrate inputs, never outcomes: the fake GB300 engine (Eq. 1-2 coefficients, memory sizes,
fetch and relaunch costs) and the workload generators may be fitted to these rows; evinfra's
own results are never a row here. Each row is played the way the paper measured it: the same
system, split, agents and scored window.

Rows (paper figure -> the input it constrains):

* Fig. 2a / Table D.1, best static split of SGLang PD for Putnam, CC, OSWorld (2P7D, 4P5D,
  6P3D) -> the engine's prefill/decode speed ratio and each workload's uncached input and
  output per request.
* Fig. 3b, the best static split's throughput on CC with 90 agents (4.9 req/s) -> the
  engine's absolute speed and CC's pacing (tool and user pauses).
* Table D.1, the best static split's throughput on Putnam 224 and OSWorld 128 -> each
  workload's work per request. The paper gives it only through evinfra's: "8.81, 5.40, and
  4.30 requests/s ... 0.98-1.38x the throughput of the best static split under SGLang". CC's
  5.40 against Fig. 3b's 4.9 is 1.10x, so 0.98 and 1.38 are Putnam's and OSWorld's; the paper
  says the symmetric engines move OSWorld's best split most and Putnam's not at all, so
  Putnam's is 0.98 (SGLang 8.99 req/s) and OSWorld's 1.38 (3.12 req/s). Swapped, they would
  be 6.38 and 4.39: either way these rows test the workloads, not evinfra.
* Table C.1, Dynamo per setting: switches per scored hour, mean switch time, KV hit rate,
  lost KV reuse -> the relaunch time, the memory sizes against each workload's contexts.
* Fig. 3a, Arrow on CC 90 from 6P3D: 34 switches, 55.5 % lost reuse -> the in-place switch
  that strands KV, the workload's reuse structure.
* Fig. 3c, routers at 4P5D on CC 90: P95 TTFT 27 s (cache-aware), 34 s (sticky sessions),
  65 s (Dynamo's KV router), 95 s (+ memory pool) -> the load the engine sees, host fetch
  cost.
* Table D.4, cache-aware routing at 4P5D on CC 126 (minutes 30-85): 2.4 % lost reuse; and
  ThunderAgent 0.95x its throughput, 1.14x its mean TTFT -> memory sizes, CC's contexts.

* Fig. 2c, the share of a CC prompt matching earlier KV after a sub-agent call (98 %, after
  359 s) and after a compaction (14 %, after 12 s), from the best static CC run's requests
  by tag -> CC's sub-agent and compaction structure.

* D.6 / Table D.5, upstream SGLang at 4P5D on CC 126 (minutes 30-85), fetched KV loaded
  when the prefill starts (tableD5's upstream run): prefill idle GPU time 23.6 % -> the
  load-back cost against the prefill iteration time, and how often a prefill reads host KV
  (memory pressure).
"""

from __future__ import annotations

import math

from evinfra.config import Config
from evinfra.experiments.fig2a import SETTINGS as SWEEPS
from evinfra.experiments.fig2a import plans as sweep_plans
from evinfra.experiments.common import best_static, closed, system
from evinfra.experiments.report import ExperimentReport, Table, all_runs
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale
from evinfra.workloads.summary import Summary

__all__ = ["PAPER_C1", "TITLE", "TOLERANCE", "plans", "relative_error", "report"]

TITLE = "Calibration: the paper's measurements of the baselines and workloads, and ours"
TOLERANCE = 0.25
"""A calibrated figure should be within 25 % of the paper's (issue 39)."""

PAPER_BEST = {"putnam": 2, "cc": 4, "osworld": 6}
"""Best static split of SGLang PD, prefill nodes of nine (Fig. 2a, Table D.1)."""
PAPER_C1 = {  # (workload, agents): switches, mean switch time (s), KV hit (%), lost reuse (%)
    ("putnam", 224): (2, 798, 96.59, 2.47), ("putnam", 256): (2, 798, 96.56, 2.48),
    ("putnam", 288): (3, 800, 96.42, 2.63), ("cc", 90): (4, 681, 92.25, 5.13),
    ("cc", 108): (4, 831, 92.62, 4.89), ("cc", 126): (4, 813, 89.52, 7.78),
    ("osworld", 128): (5, 666, 89.79, 4.00), ("osworld", 144): (4, 730, 92.01, 1.85),
    ("osworld", 160): (4, 748, 90.67, 3.24)}
"""Table C.1, Dynamo's columns."""
ROUTERS = (("cache-aware", "static-sglang", 27.0), ("sticky sessions", "sticky-sglang", 34.0),
           ("Dynamo KV router", "dynamo-kv", 65.0), ("+ memory pool", "dynamo-pool", 95.0))
"""Fig. 3c: P95 TTFT (s) at 4P5D on CC with 90 agents."""
PAPER_SPLIT = 4
"""4P5D: the split at which the paper measured Fig. 3c and Table D.4."""
PAPER_D1_THROUGHPUT = {"putnam": 8.81 / 0.98, "osworld": 4.30 / 1.38}
"""SGLang PD's best static throughput (req/s) at the lowest count, Table D.1 (module
docstring: how the paper gives it)."""


def relative_error(ours: float | None, paper: float) -> float | None:
    """``|ours − paper| / |paper|``; None without our figure."""
    if ours is None or (isinstance(ours, float) and math.isnan(ours)) or paper == 0:
        return None
    return abs(ours - paper) / abs(paper)


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    out = sweep_plans(config, scale, seed)
    for (w, n) in PAPER_C1:
        out.append(closed(f"dynamo-{w}-{n}", "dynamo", system(config, "dynamo"), scale, seed,
                          {w: scale.count(n)}))
    cc90 = {"cc": scale.count(90)}
    out.append(closed("arrow-cc-90", "arrow", system(config, "arrow"), scale, seed, cc90))
    for _, policy, _ in ROUTERS:
        if policy != "static-sglang":  # fig2a's CC sweep has it at 4P5D when it sweeps 4P
            out.append(closed(f"router-{policy}", policy,
                              system(config, policy, prefill=PAPER_SPLIT, fixed=True),
                              scale, seed, cc90))
    if not any(p.key == f"cc-90-static-{PAPER_SPLIT}P" for p in out):
        out.append(closed("router-static-sglang", "static-sglang",
                          system(config, "static-sglang", prefill=PAPER_SPLIT, fixed=True),
                          scale, seed, cc90))
    duration = scale.duration * 55 / 60  # minutes 30 to 85
    for policy in ("static-sglang", "thunderagent"):
        out.append(closed(f"d4-{policy}", policy,
                          system(config, policy, prefill=PAPER_SPLIT, fixed=True), scale, seed,
                          {"cc": scale.count(126)}, duration))
    out.append(closed("d6-upstream-sglang", "upstream SGLang",
                      system(config, "static-sglang", prefill=PAPER_SPLIT, fixed=True,
                             peer_fetch="prefill-start"),
                      scale, seed, {"cc": scale.count(126)}, duration))
    return out


def _row(figure: str, quantity: str, paper: float, ours: float | None, constrains: str
         ) -> list:
    err = relative_error(ours, paper)
    return [figure, quantity, paper, ours, None if err is None else 100 * err,
            "–" if err is None else ("yes" if err <= TOLERANCE else "no"), constrains]


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    rows = []
    bests = {f"{w}-{n}": best_static(runs, f"{w}-{n}") for w, n in SWEEPS
             if any(k.startswith(f"{w}-{n}-static-") for k in runs)}
    for w, n in SWEEPS:
        best = bests.get(f"{w}-{n}")
        rows.append(_row("Fig. 2a / D.1", f"best static split of SGLang PD, {w} {n} "
                         "(prefill nodes)", PAPER_BEST[w],
                         float(best.key.rsplit("-", 1)[1].rstrip("P")) if best else None,
                         "engine prefill/decode speed ratio; uncached input and output per "
                         f"request of {w}"))
    cc = bests.get("cc-90")
    rows.append(_row("Fig. 3b", "best static split's throughput, CC 90 (req/s)", 4.9,
                     cc.summary.throughput if cc else None,
                     "engine absolute speed (c0-c3, d0-d2); CC's tool and user pauses"))
    for w, n in SWEEPS:
        if w in PAPER_D1_THROUGHPUT:
            o = bests.get(f"{w}-{n}")
            rows.append(_row("Table D.1", f"best static split's throughput, {w} {n} (req/s)",
                             PAPER_D1_THROUGHPUT[w], o.summary.throughput if o else None,
                             f"{w}'s prefill and decode work per request and its pauses"))
    for (w, n), (switches, switch_s, hit, lost) in PAPER_C1.items():
        o = runs.get(f"dynamo-{w}-{n}")
        s = o.summary if o else None
        per_hour = 3600.0 / (s.end - s.start) if s and s.end > s.start else 1.0
        rows += [
            _row("Table C.1", f"Dynamo switches per scored hour, {w} {n}", switches,
                 o.control.switches * per_hour if o else None, "the load planner's signals "
                 "against the engine's queues (its thresholds are Dynamo's defaults)"),
            _row("Table C.1", f"Dynamo mean switch time (s), {w} {n}", switch_s,
                 o.control.mean_switch_time if o and o.control.switches else None,
                 "relaunch_s"),
            _row("Table C.1", f"Dynamo KV hit rate (%), {w} {n}", hit,
                 100 * s.kv_hit_rate if s else None,
                 f"L1/L2 sizes against {w}'s contexts and reuse"),
            _row("Table C.1", f"Dynamo lost KV reuse (%), {w} {n}", lost,
                 100 * s.lost_kv_reuse if s else None,
                 f"{w}'s output per request against its reusable prefix (a step's output "
                 "KV stays on its decode node, so the next prefill recomputes it); L1/L2 "
                 f"sizes against {w}'s contexts and pauses (LRU drops waiting branches)"),
        ]
    arrow = runs.get("arrow-cc-90")
    rows += [_row("Fig. 3a", "Arrow switches, CC 90 from 6P3D", 34,
                  arrow.control.switches if arrow else None,
                  "Arrow's SLO planner against CC's bursts (its parameters are Arrow's)"),
             _row("Fig. 3a", "Arrow lost KV reuse (%), CC 90", 55.5,
                  100 * arrow.summary.lost_kv_reuse if arrow else None,
                  "in-place switches that strand KV; CC's reuse structure")]
    at = f"cc-90-static-{PAPER_SPLIT}P"
    for name, policy, paper in ROUTERS:
        o = runs.get(f"router-{policy}") or (runs.get(at) if policy == "static-sglang" else None)
        rows.append(_row("Fig. 3c", f"P95 TTFT (s), {name} at 4P5D, CC 90", paper,
                         o.summary.ttft.p95 if o else None,
                         "the load on the prefill nodes; host fetch cost (+ pool)"))
    ca, ta = runs.get("d4-static-sglang"), runs.get("d4-thunderagent")
    rows += [_row("Table D.4", "cache-aware lost KV reuse (%) at 4P5D, CC 126", 2.4,
                  100 * ca.summary.lost_kv_reuse if ca else None,
                  "L1/L2 sizes against CC's contexts"),
             _row("Table D.4", "ThunderAgent throughput × cache-aware", 0.95,
                  _ratio(ta.summary, ca.summary, "throughput") if ta and ca else None,
                  "ThunderAgent's capacity estimate against the memory sizes"),
             _row("Table D.4", "ThunderAgent mean TTFT × cache-aware", 1.14,
                  _ttft_ratio(ta.summary, ca.summary) if ta and ca else None,
                  "as above")]
    tags = cc.summary.reuse_by_tag if cc else {}
    after = {t: tags.get(t) for t in ("subagent", "resume", "compact")}
    rows += [_row("Fig. 2c", "share of the prompt matching earlier KV after a sub-agent call "
                  "(%), CC", 98.0, 100 * after["subagent"].ideal_share if after["subagent"]
                  else None, "CC's sub-agent structure (the parent's context kept)"),
             _row("Fig. 2c", "mean sub-agent call before it (s), CC", 359.0,
                  after["subagent"].mean_wait if after["subagent"] else None,
                  "CC's sub-agent steps and tool pauses"),
             _row("Fig. 2c", "share of the prompt matching earlier KV after a compaction (%), "
                  "CC", 14.0, 100 * after["resume"].ideal_share if after["resume"] else None,
                  "CC's compaction (summary and restored files against the system prompt)"),
             _row("Fig. 2c", "mean compaction call before it (s), CC", 12.0,
                  after["compact"].mean_e2e if after["compact"] else None,
                  "CC's summary length against the engine's decode speed"),
             _row("D.6 / Table D.5", "prefill idle GPU time under upstream SGLang (%), "
                  "4P5D, CC 126", 23.6, 100 * idle if (idle := _idle(runs)) is not None
                  else None, "the load-back cost (load_back_s) against the prefill iteration "
                  "time; how often a prefill reads host KV (memory pressure)")]
    measured = [r for r in rows if isinstance(r[4], float)]
    within = sum(1 for r in measured if r[5] == "yes")
    tables = [
        Table(title="Calibrated figures, paper vs this simulator",
              columns=["figure", "quantity", "paper", "ours", "relative error (%)",
                       f"within {100 * TOLERANCE:g} %", "input it constrains"], rows=rows,
              note=f"{within} of {len(measured)} measured figures within "
                   f"{100 * TOLERANCE:g} % of the paper's; the runs are the baselines', "
                   "played as the paper played them."
                   + ("" if scale.name == "full" else
                      f" At {scale.name} scale the agent counts and windows are not the "
                      "paper's, so throughput, latency and switch rows cannot match: only "
                      "the full scale calibrates.")),
        all_runs(runs),
    ]
    return ExperimentReport(name="calibration", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, runs=runs), []


def _idle(runs: dict[str, RunOutcome]) -> float | None:
    o = runs.get("d6-upstream-sglang")
    return None if o is None else o.extras.get("prefill_idle_share")


def _ratio(a: Summary, b: Summary, field: str) -> float | None:
    x, y = getattr(a, field), getattr(b, field)
    return x / y if y else None


def _ttft_ratio(a: Summary, b: Summary) -> float | None:
    return a.ttft.mean / b.ttft.mean if b.ttft.mean else None
