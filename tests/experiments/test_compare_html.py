"""``evinfra experiment``'s ``results.html``: the systems side by side, the plots inline, each
run's split and decisions on a timeline."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
from pathlib import Path

import msgspec
import pytest
from micro import MICRO

import evinfra.experiments.command as command
from evinfra.cli import main
from evinfra.experiments.html import side_by_side
from evinfra.experiments.report import ExperimentReport
from evinfra.experiments.runs import RunOutcome

_IMG = re.compile(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">')


def table(html: str) -> dict[str, list[str]]:
    """``#side-by-side`` as {row name: cells}, the header row under ""."""
    body = html[html.index('<table id="side-by-side">'):].split("</table>")[0]
    rows = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S):
        cells = re.findall(r"<t[hd]>(.*?)</t[hd]>", tr, re.S)
        rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def fig3(tmp_path_factory) -> tuple[Path, str]:
    """``evinfra experiment fig3 --quick`` at the micro scale: its output dir and stdout."""
    out = tmp_path_factory.mktemp("fig3")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(command, "QUICK", MICRO)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["experiment", "fig3", "--quick", "--out", str(out), "--jobs", "1"]) == 0
    return out, printed.getvalue()


def test_fig3_results_html_sets_the_systems_side_by_side(fig3):
    out, printed = fig3
    assert str(out / "results.html") in printed
    html = (out / "results.html").read_text()
    runs = {k: msgspec.convert(v, RunOutcome)
            for k, v in json.loads((out / "results.json").read_text())["runs"].items()}
    t = table(html)
    assert t[""] == sorted(runs) == sorted(p.stem for p in (out / "runs").iterdir())
    assert len(runs) >= 4
    assert t["system"] == [runs[k].system for k in sorted(runs)]
    assert t["throughput (req/s)"] == [f"{runs[k].summary.throughput:.4g}" for k in sorted(runs)]
    assert t["final split"] == [runs[k].control.final_split for k in sorted(runs)]
    images = _IMG.findall(html)
    assert [n for n, _ in images] == ["fig3a.png", "fig3b.png", "fig3c.png"]
    for name, data in images:
        assert base64.b64decode(data) == (out / name).read_bytes()
    assert all(f"<h3>{k}</h3>" in html for k in runs)  # a timeline per run
    # results.md's tables are on the page too.
    assert "<h2>(a) Phase switches and lost KV reuse (from 6P3D)</h2>" in html


def test_side_by_side_shows_each_runs_own_numbers(fig3):
    out, _ = fig3
    runs = {p.stem: msgspec.json.decode(p.read_bytes(), type=RunOutcome)
            for p in (out / "runs").iterdir()}
    report = ExperimentReport(name="x", title="x", scale="x", config="x", seed=1, tables=[],
                              runs=runs)
    key = sorted(runs)[-1]
    before = table(side_by_side(report))["throughput (req/s)"]
    # Control: another throughput for the run shows in its column.
    faster = msgspec.structs.replace(runs[key], summary=msgspec.structs.replace(
        runs[key].summary, throughput=runs[key].summary.throughput + 1.0))
    after = table(side_by_side(msgspec.structs.replace(report, runs={**runs, key: faster})))
    assert after["throughput (req/s)"] != before
    col = sorted(runs).index(key)
    assert after["throughput (req/s)"][col] == f"{runs[key].summary.throughput + 1.0:.4g}"
    assert after["throughput (req/s)"][:col] + after["throughput (req/s)"][col + 1:] == \
        before[:col] + before[col + 1:]
