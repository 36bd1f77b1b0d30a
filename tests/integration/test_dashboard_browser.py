"""The dashboard and a simulation's ``report.html`` in a real browser: Debian's headless
Chromium (``scripts/install-chromium.sh``, run by ``make test``) driven by Playwright with the
system browser (``playwright install`` downloads a build of its own, which the machines cannot
reach).

``evinfra serve`` runs as a process on fake engines (``fake_serve``); the test sends agent
requests, forces a split through the admin API and watches the page follow. Screenshots are
kept in the test's tmp dir and, when ``EVINFRA_ARTIFACTS`` names a directory, there too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright
from tests.sim.small_cluster import SMALL

WAIT_MS = 20_000


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("no chromium: run scripts/install-chromium.sh (make test does)")
    return path


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        # --no-sandbox: the tests run as root, where Chromium's sandbox refuses to start.
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser) -> Page:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], errors  # no script on the page failed


def keep(path: Path) -> None:
    """A screenshot as a test artifact."""
    out = os.environ.get("EVINFRA_ARTIFACTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(out) / path.name)


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def text(page: Page, selector: str) -> str:
    return page.locator(selector).inner_text()


def test_the_dashboard_follows_agents_and_a_forced_split(fake_serve, page, tmp_path):
    base = fake_serve.base
    page.goto(base + "/")
    assert page.url == base + "/dashboard"
    page.wait_for_function("Number(document.body.dataset.polls || 0) >= 1", timeout=WAIT_MS)
    assert text(page, "#split") == "3C"  # the collocated warm-up
    assert text(page, "#submitted") == "0" and text(page, "#split-changes") == "0"

    # Two agents: one with a sub-agent (its parent names the agent), one alone.
    hints = [{"X-Evinfra-Branch-Id": "agent-a"},
             {"X-Evinfra-Branch-Id": "agent-a/sub-1", "X-Evinfra-Parent-Branch-Id": "agent-a"},
             {"X-Evinfra-Branch-Id": "agent-b"}]
    for h in hints:
        out = post(base + "/v1/chat/completions", {
            "model": "evinfra-fake", "max_tokens": 6,
            "messages": [{"role": "user", "content": "Plan the next step. " * 20}]}, h)
        assert out["usage"]["completion_tokens"] >= 1
    assert post(base + "/v1/evinfra/split", {"prefill": ["n0", "n1"]})["split"] == "2P1D"

    page.wait_for_function(
        "document.getElementById('split').textContent === '2P1D'"
        " && document.getElementById('ok').textContent === '3'"
        " && document.getElementById('planner').textContent.indexOf('switching') < 0",
        timeout=WAIT_MS)
    assert text(page, "#prefill-nodes") == "n0 n1" and text(page, "#decode-nodes") == "n2"
    assert text(page, "#submitted") == "3" and text(page, "#failed") == "0"
    assert text(page, "#split-changes") == "1"
    assert text(page, "#branches-seen") == "3" and text(page, "#agents") == "2"
    switch = page.locator("#switches tbody tr").first.inner_text()
    assert "2P1D" in switch and "forced by an operator" in switch
    assert page.locator("#switches tbody tr").count() == 1
    phases = {r.locator("td").nth(0).inner_text(): r.locator("td").nth(1).inner_text()
              for r in page.locator("#nodes tbody tr").all()}
    assert phases == {"n0": "prefill", "n1": "prefill", "n2": "decode"}
    assert text(page, "#ttft") != "– / –"  # three TTFTs in the window
    # Every chart drew (plotly, served by evinfra), the split chart with the switch's mark.
    for chart in ("split", "queue", "decode", "cache", "latency", "rates"):
        assert page.locator(f"#chart-{chart} .main-svg").count() >= 1, chart
    page.wait_for_function(  # one sample a second: the split's line reaches 2 prefill nodes
        "document.getElementById('chart-split').data[0].y.slice(-1)[0] === 2",
        timeout=WAIT_MS)
    marks = page.evaluate("document.getElementById('chart-split').data[3].text")
    assert len(marks) == 1 and marks[0].startswith("2P1D: forced by an operator")
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    keep(shot)


def test_a_cc_simulations_report_html_renders_with_its_plots(page, tmp_path):
    (tmp_path / "small.toml").write_text(SMALL)
    out = tmp_path / "cc"
    # A process of its own: Playwright's sync API runs an event loop on this thread.
    subprocess.run([sys.executable, "-m", "evinfra.cli", "simulate", "--config",
                    str(tmp_path / "small.toml"), "--workload", "cc", "--agents", "6",
                    "--duration", "300", "--warmup", "150", "--seed", "3", "--out", str(out),
                    "--no-progress"], check=True, timeout=300)
    page.goto((out / "report.html").as_uri())
    assert page.locator("h1").inner_text() == "Simulation: cc x6"
    assert page.locator("table").count() >= 2  # report.md's tables
    # The plots decoded: each image has its size (a broken one has none).
    sizes = page.evaluate("[...document.images].map(i => [i.alt, i.naturalWidth, i.naturalHeight])")
    assert [s[0] for s in sizes] == ["split.png", "ttft_cdf.png", "queueing.png"]
    assert all(w >= 300 and h >= 200 for _, w, h in sizes), sizes
    # The timeline: visible segments, one mark per decision.
    decisions = json.loads((out / "report.json").read_text())["control"]["decision_log"]
    segs = page.locator(".timeline .seg")
    assert segs.count() >= 3 and all(s.is_visible() for s in segs.all())
    assert page.locator(".timeline .mark").count() == len(decisions) >= 1
    assert page.locator("ol.decisions li").count() == len(decisions)
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    keep(shot)
