"""An experiment's ``results.html``: ``results.md`` rendered with its plots inline, every run's
outcome side by side (one column per run), and the split each run served on a timeline with
its planner's decisions. Built with :func:`evinfra.sim.html.page`; one self-contained file,
readable offline."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Sequence

import jinja2

from evinfra.experiments.report import METRICS, Cell, ExperimentReport, metrics_row
from evinfra.sim.html import LEGEND, page, served, timeline

__all__ = ["side_by_side", "write_html"]

_SIDE = jinja2.Environment(autoescape=True).from_string("""<h2>Runs side by side</h2>
<table id="side-by-side">
<thead><tr><th></th>{% for key in keys %}<th>{{ key }}</th>{% endfor %}</tr></thead>
<tbody>
{% for name, cells in rows %}<tr><th>{{ name }}</th>{% for c in cells %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</tbody></table>
""")
_SPLIT = re.compile(r"(\d+)P(\d+)D")


def _cell(v: Cell) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def side_by_side(report: ExperimentReport) -> str:
    """One column per run: its system, policy, start, and the metrics of the experiments'
    tables (:data:`~evinfra.experiments.report.METRICS`)."""
    keys = sorted(report.runs)
    runs = [report.runs[k] for k in keys]
    rows = [("system", [o.system for o in runs]), ("policy", [o.policy for o in runs]),
            ("initial split", [o.initial_split for o in runs])]
    values = [metrics_row(o.summary, o) for o in runs]
    rows += [(name, [_cell(v[i]) for v in values]) for i, name in enumerate(METRICS)]
    return _SIDE.render(keys=keys, rows=rows)


def _timelines(report: ExperimentReport) -> str:
    parts = ["<h2>Splits and planner decisions, run by run</h2>", LEGEND]
    for key, o in sorted(report.runs.items()):
        m = _SPLIT.fullmatch(o.initial_split)
        nodes = int(m[1]) + int(m[2]) if m else 0
        parts.append(timeline(served(o.control.split_timeline, nodes), o.control.decision_log,
                              o.summary.end, o.summary.start, title=key, level=3))
    return "".join(parts)


def write_html(out: Path, report: ExperimentReport, plots: Sequence[str]) -> Path:
    """``out/results.html`` beside the ``results.md`` and ``plots`` that
    :func:`~evinfra.experiments.report.write` wrote."""
    html = page(report.title, (out / "results.md").read_text(), [out / p for p in plots],
                side_by_side(report) + _timelines(report))
    path = out / "results.html"
    path.write_text(html)
    return path
