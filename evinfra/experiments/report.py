"""An experiment's output: markdown and JSON tables, PNG plots, the runs behind them.

``results.json`` holds simulated quantities only, encoded with sorted keys, so a seed gives
the same bytes; ``results.md`` adds the wall time. Ratios are always "evinfra against the
baseline", written so that above 1 means evinfra is better: throughput evinfra / baseline,
latencies and lost reuse baseline / evinfra ("× lower").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import msgspec

from evinfra.experiments.runs import RunOutcome
from evinfra.workloads.summary import Summary

__all__ = ["Cell", "ExperimentReport", "Table", "lower", "higher", "metrics_row", "ratio",
           "write"]

Cell = str | float | int | None


class Table(msgspec.Struct, kw_only=True):
    title: str
    columns: list[str]
    rows: list[list[Cell]]
    note: str = ""


class ExperimentReport(msgspec.Struct, kw_only=True):
    name: str
    title: str
    scale: str
    config: str
    seed: int
    tables: list[Table]
    notes: list[str] = []
    runs: dict[str, RunOutcome] = {}
    engine: dict[str, float] = {}
    """The fake engines' timing and memory the runs used (their calibration)."""


def ratio(value: float, base: float) -> float | None:
    """``value / base``, None when undefined."""
    if base == 0 or math.isnan(base) or math.isnan(value):
        return None
    return float(f"{value / base:.4g}")


def higher(evinfra: float, baseline: float) -> float | None:
    """A bigger-is-better metric: evinfra's over the baseline's."""
    return ratio(evinfra, baseline)


def lower(evinfra: float, baseline: float) -> float | None:
    """A smaller-is-better metric: how many times lower evinfra's is."""
    return ratio(baseline, evinfra)


METRICS = ["throughput (req/s)", "mean E2E (s)", "P95 TTFT (s)", "lost KV reuse (%)",
           "KV hit rate (%)", "switches", "mean switch (s)", "final split", "errors"]


def metrics_row(s: Summary, o: RunOutcome | None = None) -> list[Cell]:
    c = o.control if o is not None else None
    return [s.throughput, s.e2e.mean, s.ttft.p95, _pct(s.lost_kv_reuse), _pct(s.kv_hit_rate),
            c.switches if c else None, c.mean_switch_time if c else None,
            c.final_split if c else None, s.errors]


def all_runs(runs: dict[str, RunOutcome]) -> Table:
    """Every run's :data:`METRICS`, by key: the last table of most experiments."""
    return Table(title="All runs", columns=["run"] + METRICS,
                 rows=[[o.key] + metrics_row(o.summary, o) for _, o in sorted(runs.items())])


def ratio_row(ev: Summary, base: Summary) -> list[Cell]:
    return [higher(ev.throughput, base.throughput), lower(ev.e2e.mean, base.e2e.mean),
            lower(ev.ttft.p95, base.ttft.p95), lower(ev.lost_kv_reuse, base.lost_kv_reuse)]


RATIOS = ["throughput ×", "mean E2E × lower", "P95 TTFT × lower", "lost reuse × lower"]


def _pct(x: float) -> float:
    return float(f"{100 * x:.4g}")


def _fmt(v: Cell) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def markdown(report: ExperimentReport, wall: float | None, plots: Sequence[str]) -> str:
    lines = [f"# {report.title}", "", f"- {report.scale}",
             f"- config `{report.config}`, seed {report.seed}, {len(report.runs)} runs"]
    if report.engine:
        lines.append("- fake engines (GLM-5.2's; runs with OSWorld serve Kimi K2.6, "
                     "drivers/fake/models.py): " + ", ".join(f"{k} {v:g}"
                                                    for k, v in report.engine.items()))
    if wall is not None:
        lines.append(f"- wall time {wall:.0f} s")
    lines.append("")
    for t in report.tables:
        lines += [f"## {t.title}", ""]
        if t.note:
            lines += [t.note, ""]
        lines.append("| " + " | ".join(t.columns) + " |")
        lines.append("|" + "---|" * len(t.columns))
        lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in t.rows]
        lines.append("")
    if report.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    if plots:
        lines += ["Plots: " + ", ".join(f"`{p}`" for p in plots) + ".", ""]
    return "\n".join(lines)


def write(out: Path, report: ExperimentReport,
          plots: Sequence[tuple[str, Callable[[Path], None]]] = (),
          wall: float | None = None) -> list[Path]:
    """Write ``results.json``, ``results.md`` and each plot ``(file name, draw)``."""
    out.mkdir(parents=True, exist_ok=True)
    runs = {k: msgspec.structs.replace(v, wall_s=0.0) for k, v in sorted(report.runs.items())}
    stable = msgspec.structs.replace(report, runs=runs)
    (out / "results.json").write_bytes(msgspec.json.format(
        msgspec.json.encode(stable, order="sorted"), indent=2) + b"\n")
    if plots:
        import matplotlib

        matplotlib.use("Agg")
    for name, draw in plots:
        draw(out / name)
    (out / "results.md").write_text(markdown(report, wall, [n for n, _ in plots]))
    return [out / "results.json", out / "results.md"] + [out / n for n, _ in plots]


def bars(path: Path, title: str, groups: Sequence[str], series: dict[str, Sequence[float]],
         ylabel: str, log: bool = False) -> None:
    """Grouped bars: one group per ``groups`` entry, one bar per series."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(groups) + 2), 3.2))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [0 if v is None or math.isnan(v) else v for v in values], width, label=label)
    ax.set_xticks(range(len(groups)), groups, rotation=20 if len(groups) > 4 else 0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def steps(path: Path, title: str, lines: dict[str, list[tuple[float, float]]], end: float,
          ylabel: str, shade: tuple[float, float] | None = None) -> None:
    """Step lines over time (the split of each system)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for label, points in lines.items():
        if points:
            xs = [t for t, _ in points] + [end]
            ys = [y for _, y in points]
            ax.step(xs, ys + ys[-1:], where="post", label=label)
    if shade is not None:
        ax.axvspan(*shade, color="0.9", label="warm-up")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
