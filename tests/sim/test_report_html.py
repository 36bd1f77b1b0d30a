"""``report.html`` beside ``report.md``: the same figures, the plots inline, the planner's
decisions on the split's timeline (``evinfra simulate``'s entry point, then the parts)."""

from __future__ import annotations

import base64
import html
import json
import re
from pathlib import Path

import pytest

from evinfra.cli import main
from evinfra.sim.html import page, timeline
from tests.sim.small_cluster import SMALL


_IMG = re.compile(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">')
_SEG = re.compile(r'<div class="seg" title="([^"]+) from [^"]+"\s+style="left:([\d.]+)%;width:([\d.]+)%')
_MARK = re.compile(r'<div class="mark( switch)?" title="([^"]*)"\s+style="left:([\d.]+)%"')


def md_table(md: str, header: str) -> list[tuple[str, str]]:
    lines = md[md.index(header):].split("\n\n")[0].splitlines()[2:]
    return [tuple(c.strip() for c in line.strip("|").split("|"))[:2] for line in lines]


@pytest.fixture(scope="module")
def cc_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("html")
    (d / "small.toml").write_text(SMALL)
    out = d / "cc"
    assert main(["simulate", "--config", str(d / "small.toml"), "--workload", "cc",
                 "--agents", "6", "--duration", "300", "--warmup", "150", "--seed", "3",
                 "--out", str(out), "--no-progress"]) == 0
    return out


def test_report_html_has_report_md_figures_and_its_plots_inline(cc_run):
    page_ = (cc_run / "report.html").read_text()
    md = (cc_run / "report.md").read_text()
    rows = md_table(md, "| metric | value |")
    assert len(rows) >= 12
    for name, value in rows:
        assert f"<td>{html.escape(name, quote=False)}</td>\n<td>{html.escape(value, quote=False)}</td>" in page_, name
    # The plots are report.md's PNGs, byte for byte, in the order it names them.
    images = _IMG.findall(page_)
    assert [n for n, _ in images] == ["split.png", "ttft_cdf.png", "queueing.png"]
    for name, data in images:
        assert base64.b64decode(data) == (cc_run / name).read_bytes(), name
    assert base64.b64decode(images[0][1]) != (cc_run / "queueing.png").read_bytes()  # control


def test_report_html_puts_each_decision_on_the_split_timeline(cc_run):
    page_ = (cc_run / "report.html").read_text()
    report = json.loads((cc_run / "report.json").read_text())
    control = report["control"]
    assert control["switches"] >= 1 and control["decision_log"]  # the run adapted
    labels = [label for label, _, _ in _SEG.findall(page_)]
    end = report["run"]["warmup"] + report["run"]["duration"]
    served = [(0.0, "0P0D+4C")] + [tuple(x) for x in control["split_timeline"]] + [(end, "")]
    # A split held for no time (several nodes reporting at one instant) has no segment.
    held = [label for (t, label), (nxt, _) in zip(served, served[1:]) if nxt > t]
    assert len(labels) >= 3
    assert labels == [x for i, x in enumerate(held) if i == 0 or held[i - 1] != x]
    marks = _MARK.findall(page_)
    assert [(html.unescape(title), float(left)) for _, title, left in marks] == [
        (f"{t:g} s: {reason}", pytest.approx(100 * t / end, abs=1e-3))
        for t, reason in control["decision_log"]]
    assert [bool(s) for s, _, _ in marks] == [r.startswith("switch")
                                              for _, r in control["decision_log"]]


def test_timeline_places_segments_and_marks_in_proportion():
    splits = [(0.0, "0P0D+4C"), (100.0, "2P2D"), (200.0, "1P3D")]
    decisions = [(200.0, "switch 2P2D -> 1P3D: gain"), (300.0, "keep 1P3D: none")]
    out = timeline(splits, decisions, end=400.0, warmup=100.0)
    assert _SEG.findall(out) == [("0P0D+4C", "0.000", "25.000"), ("2P2D", "25.000", "25.000"),
                                 ("1P3D", "50.000", "50.000")]
    assert [(s, left) for s, _, left in _MARK.findall(out)] == [(" switch", "50.000"),
                                                                ("", "75.000")]
    # Control: a later switch moves the boundary and the mark.
    later = timeline([(0.0, "0P0D+4C"), (100.0, "2P2D"), (300.0, "1P3D")],
                     [(300.0, "switch 2P2D -> 1P3D: gain")], end=400.0)
    assert _SEG.findall(later)[1:] == [("2P2D", "25.000", "50.000"), ("1P3D", "75.000", "25.000")]
    # Repeated labels merge; nothing past the end is drawn.
    merged = timeline([(0.0, "2P2D"), (50.0, "2P2D"), (500.0, "1P3D")], [(450.0, "keep")], 400.0)
    assert _SEG.findall(merged) == [("2P2D", "0.000", "100.000")] and not _MARK.findall(merged)


def test_text_from_the_run_is_escaped_not_markup(tmp_path):
    out = timeline([(0.0, "2P2D")], [(1.0, "keep <script>alert(1)</script>")], 10.0)
    assert "<script>" not in out and "&lt;script&gt;" in out
    doc = page("t", "# Title\n\n<b>raw</b> and `code`\n", [])
    assert "<h1>Title</h1>" in doc and "<b>raw</b>" not in doc and "&lt;b&gt;raw&lt;/b&gt;" in doc
