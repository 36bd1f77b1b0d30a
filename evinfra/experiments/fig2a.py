"""Figure 2(a) (paper 2, D.1): SGLang PD at every static split of the nine nodes, at the
paper's lowest concurrencies, the calibration of the fake engines (issue 6).

The paper finds that the best split follows the workload: few prefill nodes for the
decode-heavy Putnam agent, many for the prefill-heavy OSWorld agent, in between for CC. With
the fake engines' calibrated speeds the sweep must place the best split at <= 3 prefill
nodes for Putnam, >= 6 for OSWorld and between them for CC.
"""

from __future__ import annotations

from pathlib import Path

from evinfra.config import Config
from evinfra.experiments.common import best_static, closed, sweep
from evinfra.experiments.report import METRICS, ExperimentReport, Table, metrics_row
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["EXPECTED", "SETTINGS", "TITLE", "plans", "report"]

TITLE = "Figure 2(a): throughput of SGLang PD at every static split (the calibration)"
SETTINGS = (("putnam", 224), ("cc", 90), ("osworld", 128))
"""The paper's lowest concurrency per workload (6.1), in the order the sweep plays them."""
EXPECTED = {"putnam": "<= 3 prefill nodes", "cc": "between Putnam's and OSWorld's",
            "osworld": ">= 6 prefill nodes"}


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    out = []
    for w, n in SETTINGS:
        out += sweep(f"{w}-{n}", config, scale, lambda key, name, cfg, w=w, n=n: closed(
            key, name, cfg, scale, seed, {w: scale.count(n)}))
    return out


def _prefill(o: RunOutcome) -> int:
    return int(o.key.rsplit("-", 1)[1].rstrip("P"))


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    rows, best_rows, bests = [], [], {}
    for w, n in SETTINGS:
        mine = sorted((o for k, o in runs.items() if k.startswith(f"{w}-{n}-static-")),
                      key=_prefill)
        rows += [[w, scale.count(n)] + [o.system] + metrics_row(o.summary, o) for o in mine]
        if mine:
            best = best_static(runs, f"{w}-{n}")
            bests[w] = _prefill(best)
            played = ", ".join(f"{_prefill(o)}P" for o in mine)
            best_rows.append([w, scale.count(n), best.system, best.summary.throughput,
                              played, EXPECTED[w]])
    verdict = []
    if len(bests) == len(SETTINGS):
        ok = bests["putnam"] <= 3 and bests["osworld"] >= 6 and (
            bests["putnam"] <= bests["cc"] <= bests["osworld"])
        verdict.append(f"Best splits {bests['putnam']}P / {bests['cc']}P / "
                       f"{bests['osworld']}P for Putnam / CC / OSWorld: "
                       f"{'as' if ok else 'NOT as'} in the paper (Putnam <= 3, CC between, "
                       f"OSWorld >= 6).")
    tables = [
        Table(title="Every static split", columns=["workload", "agents", "system"] + METRICS,
              rows=rows),
        Table(title="Best split per workload", columns=[
            "workload", "agents", "best", "throughput (req/s)", "splits played", "paper"],
              rows=best_rows),
    ]
    notes = verdict + ["SGLang PD (static-sglang) at each fixed split from the start, as the "
                       "paper profiles static splits offline (6.1, D.1)."]
    return ExperimentReport(name="fig2a", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, notes=notes,
                            runs=runs), [("fig2a.png", lambda p: _plot(p, runs, scale))]


def _plot(path: Path, runs: dict[str, RunOutcome], scale: Scale) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETTINGS), figsize=(11, 3.2))
    for ax, (w, n) in zip(axes, SETTINGS):
        mine = sorted((o for k, o in runs.items() if k.startswith(f"{w}-{n}-static-")),
                      key=_prefill)
        ax.bar([_prefill(o) for o in mine], [o.summary.throughput for o in mine])
        ax.set_title(f"{w}, {scale.count(n)} agents")
        ax.set_xlabel("prefill nodes")
        ax.set_xticks(range(1, 9))
    axes[0].set_ylabel("throughput (req/s)")
    fig.suptitle(f"{TITLE} ({scale.name} scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
