"""Figure 7 (paper 6.3, C.4 Table C.4): the shifting composition, evinfra against Dynamo and
the best static split under SGLang PD.

After the warm-up: 288 Putnam agents, then 144 Putnam and 72 OSWorld, then 144 OSWorld, an
hour each (the warm-up serves the first composition). Evinfra and Dynamo start from 6P3D;
the best static split is the fixed split with the highest throughput over the whole run.
Paper: 2.14x Dynamo's throughput and 1.28x the best static split's; mean E2E 2.15x and 1.33x
lower, P95 TTFT 3.58x and 1.88x lower; the highest throughput in every period.

With ``latency_rule`` (``--latency-rule``; beyond the paper, issue 43) evinfra also plays with
``planner.objective = "latency"``, against the paper's rule in the issue's budget, over the
whole run and per period (:func:`~evinfra.experiments.latency.budget`).
"""

from __future__ import annotations

from pathlib import Path

from evinfra.config import Config
from evinfra.experiments.common import best_static, latency_rule, served, system, sweep
from evinfra.experiments.latency import BUDGET, BUDGET_COLUMNS, budget
from evinfra.experiments.report import (METRICS, RATIOS, ExperimentReport, Table, metrics_row,
                                        ratio_row, steps)
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale
from evinfra.sim.harness import RunSpec
from evinfra.workloads import Phase

__all__ = ["PAPER", "PERIODS", "TITLE", "WINDOW", "plans", "report", "shift_plan", "windows"]

TITLE = "Figure 7: shifting workload composition, evinfra vs Dynamo and the best static split"
PERIODS = (("putnam", {"putnam": 288}), ("mixed", {"putnam": 144, "osworld": 72}),
           ("osworld", {"osworld": 144}))
PAPER = {"dynamo": {"throughput": 2.14, "e2e": 2.15, "ttft": 3.58},
         "best static": {"throughput": 1.28, "e2e": 1.33, "ttft": 1.88}}


WINDOW = 600.0
"""Fig. 2(b)'s window (s) over the same shift."""


def windows(scale: Scale) -> list[tuple[str, float, float]]:
    """Fig. 2(b)'s 10-minute windows over the three scored periods (at least one per period),
    named ``PERIOD-k``."""
    per = max(1, round(scale.duration / WINDOW))
    width = scale.duration / per
    return [(f"{name}-{k}", scale.warmup + (i * per + k) * width,
             scale.warmup + (i * per + k + 1) * width)
            for i, (name, _) in enumerate(PERIODS) for k in range(per)]


def shift_plan(key: str, name: str, config: Config, scale: Scale, seed: int) -> RunPlan:
    """One run of the shift: the warm-up and three scored periods of ``PERIODS``, each also
    summarised per :func:`windows` so that one static sweep serves fig. 7 and fig. 2(b)."""
    d, w = scale.duration, scale.warmup
    counts = [{k: scale.count(v) for k, v in agents.items()} for _, agents in PERIODS]
    schedule = [Phase(w + d, counts[0]), Phase(d, counts[1]), Phase(d, counts[2])]
    periods = [(name_, w + i * d, w + (i + 1) * d) for i, (name_, _) in enumerate(PERIODS)]
    spec = RunSpec(duration=3 * d, warmup=w, schedule=schedule, label=key)
    workloads = ["osworld", "putnam"]
    return RunPlan(key=key, system=name, config=served(scale.configure(config), workloads),
                   workloads=workloads, seed=seed, spec=spec,
                   periods=periods + windows(scale))


def plans(config: Config, scale: Scale, seed: int, latency_rule: bool = False
          ) -> list[RunPlan]:
    out = [shift_plan("shift-evinfra", "evinfra", system(config, "evinfra"), scale, seed),
           shift_plan("shift-dynamo", "dynamo", system(config, "dynamo"), scale, seed)]
    if latency_rule:
        out.append(shift_plan("shift-evinfra-latency", "evinfra latency rule",
                              _with_latency_rule(config), scale, seed))
    return out + sweep("shift", config, scale,
                       lambda key, name, cfg: shift_plan(key, name, cfg, scale, seed))


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    ev, dy = runs.get("shift-evinfra"), runs.get("shift-dynamo")
    statics = sorted((o for k, o in runs.items() if k.startswith("shift-static-")),
                     key=lambda o: o.key)
    best = best_static(runs, "shift") if statics else None
    rows = [[o.system] + metrics_row(o.summary, o) for o in (ev, dy, *statics) if o is not None]
    ratios, paper = [], []
    for name, base in (("dynamo", dy),
                       (f"best static ({best.system if best else '–'})", best)):
        if ev is None or base is None:
            continue
        r = ratio_row(ev.summary, base.summary)
        ratios.append([name] + r)
        ref = PAPER["dynamo" if name == "dynamo" else "best static"]
        paper.append([name, r[0], ref["throughput"], r[1], ref["e2e"], r[2], ref["ttft"]])
    period_rows = []
    for pname, _ in PERIODS:
        vals = [o.periods[pname].throughput if o is not None else None for o in (ev, dy, best)]
        period_rows.append([pname] + vals + [
            vals[0] / v if vals[0] is not None and v else None for v in vals[1:]])
    tables = [
        Table(title="Whole run (the three scored periods)", columns=["system"] + METRICS,
              rows=rows),
        Table(title="evinfra against each baseline (above 1: evinfra better)",
              columns=["baseline"] + RATIOS, rows=ratios),
        Table(title="Beside the paper (6.3)",
              columns=["baseline", "throughput ×", "paper", "mean E2E × lower", "paper",
                       "P95 TTFT × lower", "paper"], rows=paper),
        Table(title="Throughput per period (req/s, paper Table C.4)",
              columns=["period", "evinfra", "dynamo", best.system if best else "best static",
                       "× dynamo", "× best static"], rows=period_rows),
    ]
    lat = runs.get("shift-evinfra-latency")
    if ev is not None and lat is not None:
        rows.insert(1, [lat.system] + metrics_row(lat.summary, lat))
        tables.append(Table(
            title="The latency rule against the paper's rule (issue 43)",
            columns=["period"] + BUDGET_COLUMNS,
            rows=[["whole run"] + budget(ev, lat, 3 * scale.duration / 3600)] + [
                [p] + _period(ev, lat, p) for p, _ in PERIODS],
            note="Budget: at most 3 % throughput lost and at most one extra switch per hour. "
                 "Per period only the throughput and latencies are split (switches are "
                 "counted over the whole run)."))
    notes = ["Evinfra and Dynamo start from 6P3D."]
    if best is not None:
        notes.insert(0, f"Best static split: {best.system}, chosen by whole-run throughput "
                        f"among {', '.join(o.system for o in statics)}.")
    timeline = {o.system: [(t, int(s.split("P")[0])) for t, s in o.control.split_timeline]
                for o in (ev, dy, best) if o is not None}
    end = scale.warmup + 3 * scale.duration
    plots = [("fig7_split.png", lambda p: steps(
        p, f"PD split over time ({scale.name} scale)", timeline, end, "prefill nodes",
        (0.0, scale.warmup))),
             ("fig7_latency.png",
              lambda p: _latency(p, *[o for o in (ev, dy, best) if o is not None]))]
    return ExperimentReport(name="fig7", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, notes=notes,
                            runs=runs), plots


def _latency(path: Path, *runs: RunOutcome) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    names = [o.system for o in runs]
    for ax, (title, get) in zip(axes, [("mean E2E (s)", lambda s: s.e2e.mean),
                                       ("P95 TTFT (s)", lambda s: s.ttft.p95)]):
        vals = [get(o.summary) for o in runs]
        ax.bar(names, vals)
        for i, v in enumerate(vals[1:], 1):
            if vals[0]:
                ax.text(i, v, f"{v / vals[0]:.2f}x", ha="center", va="bottom", color="red")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)



def _with_latency_rule(config: Config) -> Config:
    return latency_rule(system(config, "evinfra"))


def _period(paper: RunOutcome, latency: RunOutcome, name: str) -> list:
    a, b = paper.periods[name], latency.periods[name]
    lost = 1 - b.throughput / a.throughput if a.throughput else 0.0
    return [a.throughput, b.throughput, float(f"{100 * lost:.3g}"), None, None, a.e2e.mean,
            b.e2e.mean, a.ttft.p95, b.ttft.p95,
            "yes" if lost <= BUDGET["throughput_lost"] else "no"]
