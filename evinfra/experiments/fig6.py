"""Figure 6 (paper 6.2, C.1, C.3, C.4): Putnam, CC and OSWorld at three concurrencies each,
evinfra against Dynamo, both from 6P3D: throughput, lost KV reuse, mean E2E, P95 TTFT.

Paper: evinfra reaches 1.10-2.73x Dynamo's throughput, lowers the mean E2E latency
1.15-4.12x and the P95 TTFT up to 13.92x, and loses 0.17-1.01 % of the KV reuse against
Dynamo's 1.85-7.78 % (Table C.1); on CC its busiest prefill node queues 1.75-1.85x the
average against Dynamo's 2.29-2.61x (Table C.2).

With ``latency_rule`` (``--latency-rule``; beyond the paper, issue 43) evinfra also plays with
``planner.objective = "latency"`` in every setting, against the paper's rule in the issue's
budget (:func:`~evinfra.experiments.latency.budget`).
"""

from __future__ import annotations

from pathlib import Path

from evinfra.config import Config
from evinfra.experiments.common import closed, latency_rule, system
from evinfra.experiments.latency import BUDGET_COLUMNS, budget
from evinfra.experiments.report import (METRICS, RATIOS, ExperimentReport, Table, lower,
                                        metrics_row, ratio_row)
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["PAPER", "SETTINGS", "TITLE", "plans", "report"]

TITLE = "Figure 6: stationary workloads, evinfra vs Dynamo"
SETTINGS = {"putnam": (224, 256, 288), "cc": (90, 108, 126), "osworld": (128, 144, 160)}
"""Concurrent agents per workload (paper 6.1)."""
SYSTEMS = ("evinfra", "dynamo")
PAPER = {"throughput": (1.10, 2.73), "e2e": (1.15, 4.12), "ttft_max": 13.92,
         "lost_evinfra": (0.17, 1.01), "lost_dynamo": (1.85, 7.78)}


def plans(config: Config, scale: Scale, seed: int, latency_rule: bool = False
          ) -> list[RunPlan]:
    out = []
    for w, counts in SETTINGS.items():
        for n in counts:
            for s in SYSTEMS:
                out.append(closed(f"{w}-{n}-{s}", s, system(config, s), scale, seed,
                                  {w: scale.count(n)}))
            if latency_rule:
                out.append(closed(f"{w}-{n}-evinfra-latency", "evinfra latency rule",
                                  _with_latency_rule(config), scale, seed, {w: scale.count(n)}))
    return out


def _with_latency_rule(config: Config) -> Config:
    return latency_rule(system(config, "evinfra"))


def analyse(runs: dict[str, RunOutcome], scale: Scale) -> tuple[list[Table], list[str], list]:
    rows, ratios = [], []
    rt, re2e, rttft, lost_ev, lost_dy = [], [], [], [], []
    for w, counts in SETTINGS.items():
        for n in counts:
            ev, dy = runs.get(f"{w}-{n}-evinfra"), runs.get(f"{w}-{n}-dynamo")
            if ev is None or dy is None:
                continue
            agents = scale.count(n)
            for o in (ev, dy):
                rows.append([w, agents, o.system] + metrics_row(o.summary, o))
            r = ratio_row(ev.summary, dy.summary)
            ratios.append([w, agents] + r)
            rt.append(r[0])
            re2e.append(r[1])
            rttft.append(r[2])
            lost_ev.append(100 * ev.summary.lost_kv_reuse)
            lost_dy.append(100 * dy.summary.lost_kv_reuse)
    tables = [
        Table(title="Runs", columns=["workload", "agents", "system"] + METRICS, rows=rows),
        Table(title="evinfra against Dynamo (above 1: evinfra better)",
              columns=["workload", "agents"] + RATIOS, rows=ratios),
        Table(title="Ranges over the nine settings, beside the paper's",
              columns=["quantity", "ours", "paper"], rows=[
                  ["throughput vs Dynamo", _range(rt, "×"), "1.10–2.73×"],
                  ["mean E2E, × lower", _range(re2e, "×"), "1.15–4.12×"],
                  ["P95 TTFT, × lower", _range(rttft, "×"), "up to 13.92×"],
                  ["lost KV reuse, evinfra", _range(lost_ev, " %"), "0.17–1.01 %"],
                  ["lost KV reuse, Dynamo", _range(lost_dy, " %"), "1.85–7.78 %"]]),
    ]
    queueing = [[scale.count(n), ev.control.mean_prefill_queueing,
                 dy.control.mean_prefill_queueing, ev.control.queueing_imbalance,
                 dy.control.queueing_imbalance,
                 lower(ev.control.mean_prefill_queueing, dy.control.mean_prefill_queueing)]
                for n in SETTINGS["cc"]
                if (ev := runs.get(f"cc-{n}-evinfra")) and (dy := runs.get(f"cc-{n}-dynamo"))]
    tables.append(Table(
        title="Prefill queueing and load balance on CC (paper Table C.2)",
        columns=["agents", "evinfra queueing (s)", "Dynamo queueing (s)",
                 "evinfra max/avg", "Dynamo max/avg", "queueing × lower"], rows=queueing,
        note="Mean seconds from arrival to prefill start; per scored minute the most loaded "
             "prefill node's mean over the nodes' average, averaged over the minutes. Paper: "
             "max/avg 1.75-1.85x for evinfra against 2.29-2.61x, queueing 2.6-7.6x lower."))
    rules = [[w, scale.count(n)] + budget(ev, lat, scale.duration / 3600)
             for w, counts in SETTINGS.items() for n in counts
             if (ev := runs.get(f"{w}-{n}-evinfra"))
             and (lat := runs.get(f"{w}-{n}-evinfra-latency"))]
    if rules:
        tables.append(Table(
            title="The latency rule against the paper's rule (issue 43)",
            columns=["workload", "agents"] + BUDGET_COLUMNS, rows=rules,
            note="Budget: at most 3 % throughput lost and at most one extra switch per hour."))
    notes = ["Both systems start from 6P3D; Dynamo is its load planner (throughput target) "
             "with relaunching switches behind the SGLang Model Gateway, as paper 6.1 runs it."]
    return tables, notes, [("fig6.png", lambda p: _plot(p, runs, scale))]


def _range(values: list, unit: str) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    return f"{min(vals):.3g}–{max(vals):.3g}{unit}"


def _plot(path: Path, runs: dict[str, RunOutcome], scale: Scale) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(11, 8))
    metrics = [("lost KV reuse (%)", lambda s: 100 * s.lost_kv_reuse),
               ("mean E2E (s)", lambda s: s.e2e.mean), ("P95 TTFT (s)", lambda s: s.ttft.p95)]
    for col, (w, counts) in enumerate(SETTINGS.items()):
        for row, (name, get) in enumerate(metrics):
            ax = axes[row][col]
            for i, s in enumerate(SYSTEMS):
                ax.bar([j + (i - 0.5) * 0.4 for j in range(len(counts))],
                       [get(runs[k].summary) if (k := f"{w}-{n}-{s}") in runs else 0.0
                        for n in counts], 0.4, label=s)
            ax.set_xticks(range(len(counts)), [str(scale.count(n)) for n in counts])
            if row == 0:
                ax.set_title(w)
            if col == 0:
                ax.set_ylabel(name)
            if row == 2:
                ax.set_xlabel("concurrent agents")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{TITLE} ({scale.name} scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    tables, notes, plots = analyse(runs, scale)
    return ExperimentReport(name="fig6", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, notes=notes,
                            runs=runs), plots
