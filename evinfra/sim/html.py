"""A simulation's ``report.html``: ``report.md`` rendered, its plots inline, and the planner's
decisions on a timeline of the split. One self-contained file, readable offline.

The figures are ``report.md``'s (rendered with markdown-it, so the numbers have one writer)
and the PNGs :mod:`evinfra.sim.report` drew, embedded as data URIs; the timeline is plain
HTML and CSS: one segment per split served, one mark per planner decision. The experiments'
comparison page (:mod:`evinfra.experiments.html`) is built with the same :func:`page`.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Sequence

from dataclasses import dataclass, field

import jinja2
from markdown_it import MarkdownIt
from markupsafe import Markup

from evinfra.sim.report import Report

__all__ = ["LEGEND", "Mark", "Segment", "page", "served", "timeline", "write_html"]

_MD = MarkdownIt("commonmark", {"html": False}).enable("table")

_PAGE = jinja2.Environment(autoescape=True).from_string("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }}</title>
<style>
body { font-family: "Liberation Sans", Arial, sans-serif; max-width: 1100px; margin: 16px auto;
       padding: 0 16px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 16px; font-size: 14px; }
th, td { border: 1px solid #d0d7de; padding: 3px 8px; text-align: left; }
th { background: #f3f4f6; }
figure { display: inline-block; margin: 8px 16px 8px 0; }
figure img { max-width: 100%; border: 1px solid #e5e7eb; }
.timeline { position: relative; height: 46px; margin: 12px 0 4px; background: #f3f4f6; }
.timeline .seg { position: absolute; top: 0; height: 26px; line-height: 26px; overflow: hidden;
                 font-size: 11px; text-align: center; border-right: 1px solid #fff;
                 color: #fff; }
.timeline .mark { position: absolute; top: 28px; width: 2px; height: 16px; background: #6b7280; }
.timeline .mark.switch { background: #d97706; width: 3px; }
.timeline .warmup { position: absolute; top: 0; height: 46px; background: rgba(0,0,0,0.08); }
.axis { display: flex; justify-content: space-between; font-size: 11px; color: #666; }
ol.decisions li.switch { color: #b45309; }
</style></head>
<body>
{{ body }}
{% if figures %}<h2>Plots</h2>
{% for name, uri in figures %}<figure><img alt="{{ name }}" src="{{ uri }}">
<figcaption>{{ name }}</figcaption></figure>
{% endfor %}{% endif %}
{{ extra }}
</body></html>
""")

LEGEND = ("<p>Each segment is a split the engines served (the nodes' reported phases); each "
          "mark a planner decision (orange: a switch). Hover for the reason.</p>")

_TIMELINE = jinja2.Environment(autoescape=True).from_string("""<h{{ level }}>{{ title }}</h{{ level }}>
{% if level == 2 %}{{ legend }}{% endif %}
<div class="timeline">
{% if warmup %}<div class="warmup" style="left:0;width:{{ pct(warmup) }}%" title="warm-up (not scored)"></div>{% endif %}
{% for s in segments %}<div class="seg" title="{{ s.label }} from {{ '%g' % s.start }} s"
 style="left:{{ pct(s.start) }}%;width:{{ pct(s.end - s.start) }}%;background:{{ s.color }}">{{ s.label }}</div>
{% endfor %}{% for m in marks %}<div class="mark{{ ' switch' if m.switch }}" title="{{ '%g' % m.time }} s: {{ m.reason }}"
 style="left:{{ pct(m.time) }}%"></div>
{% endfor %}</div>
<div class="axis"><span>0 s</span><span>{{ '%g' % end }} s</span></div>
{% if marks %}<ol class="decisions">
{% for m in marks %}<li class="{{ 'switch' if m.switch else 'keep' }}">{{ '%g' % m.time }} s: {{ m.reason }}</li>
{% endfor %}</ol>{% else %}<p>No planner decision in the scored window.</p>{% endif %}
""")

_COLORS = ["#1d4ed8", "#0f766e", "#7c3aed", "#b91c1c", "#a16207", "#0369a1", "#4d7c0f",
           "#be185d", "#374151"]


@dataclass
class Segment:
    """A split served from ``start`` to ``end``."""

    label: str
    start: float
    end: float
    color: str


@dataclass
class Mark:
    """A planner decision; ``switch`` when it chose a new split (the planner's reasons start
    with "switch" or "keep")."""

    time: float
    reason: str
    switch: bool = field(init=False)

    def __post_init__(self) -> None:
        self.switch = self.reason.startswith("switch")


def served(split_timeline: Sequence[tuple[float, str]], nodes: int) -> list[tuple[float, str]]:
    """The split timeline from 0: until an engine reports a phase, the recorder
    (:class:`~evinfra.sim.control.ControlRecorder`) counts every node collocated."""
    return [(0.0, f"0P0D+{nodes}C"), *split_timeline]


def timeline(split_timeline: Sequence[tuple[float, str]], decisions: Sequence[tuple[float, str]],
             end: float, warmup: float = 0.0,
             title: str = "Planner decisions on the split's timeline", level: int = 2) -> str:
    """The split served over ``[0, end]`` as segments, the decisions as marks (HTML)."""
    segments: list[Segment] = []
    colors: dict[str, str] = {}
    for i, (t, label) in enumerate(split_timeline):
        stop = split_timeline[i + 1][0] if i + 1 < len(split_timeline) else end
        if stop <= t or t >= end:
            continue
        color = colors.setdefault(label, _COLORS[len(colors) % len(_COLORS)])
        if segments and segments[-1].label == label:
            segments[-1].end = min(stop, end)
        else:
            segments.append(Segment(label, t, min(stop, end), color))
    marks = [Mark(t, reason) for t, reason in decisions if t <= end]

    def pct(x: float) -> str:
        return f"{100 * max(0.0, min(x, end)) / end:.3f}" if end > 0 else "0"

    return _TIMELINE.render(segments=segments, marks=marks, end=end, warmup=warmup, pct=pct,
                            title=title, level=level, legend=Markup(LEGEND))


def _mention(markdown: str, name: str) -> tuple[bool, int, str]:
    """Sorts plots in the order the markdown names them, the others after."""
    at = markdown.find(f"`{name}`")
    return at < 0, at, name


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def page(title: str, markdown: str, images: Sequence[Path], extra: str = "") -> str:
    """``markdown`` as HTML, with ``images`` (PNG files) inline and ``extra`` HTML after."""
    return _PAGE.render(title=title, body=Markup(_MD.render(markdown)),
                        figures=[(p.name, _data_uri(p)) for p in images if p.exists()],
                        extra=Markup(extra))


def write_html(out: Path, report: Report) -> Path:
    """``out/report.html`` beside the ``report.md`` and plots that ``write_report`` wrote."""
    run, c = report.run, report.control
    end = run.warmup + run.duration
    markdown = (out / "report.md").read_text()
    plots = sorted(out.glob("*.png"), key=lambda p: _mention(markdown, p.name))
    html = page(f"Simulation: {run.label}", markdown, plots,
                timeline(served(c.split_timeline, run.nodes), c.decision_log, end, run.warmup))
    path = out / "report.html"
    path.write_text(html)
    return path
