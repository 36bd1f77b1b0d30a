"""The dashboard: ``GET /`` and the page's assets (all local), and ``GET /v1/evinfra/dashboard``,
the JSON the page polls (its board fed by the bus, read through the service's status)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import plotly
import pytest

from evinfra.api.dashboard import Board
from evinfra.core.events import RequestDone, SplitChanged


async def view(client) -> dict:
    r = await client.get("/v1/evinfra/dashboard")
    assert r.status == 200, await r.text()
    return await r.json()


async def test_root_leads_to_a_page_whose_every_asset_the_server_serves(client):
    r = await client.get("/", allow_redirects=False)
    assert r.status == 302 and r.headers["Location"] == "/dashboard"
    r = await client.get("/dashboard")
    assert r.status == 200 and r.content_type == "text/html"
    page = await r.text()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sorted(assets) == ["/dashboard/dashboard.css", "/dashboard/dashboard.js",
                              "/dashboard/plotly.min.js"]  # nothing from a CDN
    kinds = {}
    for a in assets:
        r = await client.get(a)
        assert r.status == 200, a
        kinds[a] = r.content_type
        if a.endswith("plotly.min.js"):
            js = await r.read()
            shipped = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
            assert js == shipped.read_bytes() and len(js) > 1_000_000
    assert kinds["/dashboard/dashboard.css"] == "text/css"
    assert kinds["/dashboard/dashboard.js"] == "application/javascript"
    assert (await client.get("/dashboard/secrets.js")).status == 404


async def test_the_json_follows_requests_and_a_forced_split(client):
    await asyncio.sleep(1.1)  # no page open: the series fills on its own, a sample a second
    v = await view(client)
    # Two samples by the timer (at the start, a second later), none by this read.
    assert len(v["series"]) == 2 and v["series"][-1][0] < v["time"]
    assert v["split"] == "4C" and v["collocated"] == ["n0", "n1", "n2", "n3"]
    assert v["counters"]["submitted"] == 0 and v["ttft"]["count"] == 0 and v["switches"] == []
    assert [n["name"] for n in v["nodes"]] == ["n0", "n1", "n2", "n3"]
    for i in range(3):
        r = await client.post("/v1/completions", json={
            "model": "evinfra-fake", "prompt": "the agent's context " * 8, "max_tokens": 4,
            "ignore_eos": True}, headers={"X-Evinfra-Branch-Id": f"agent-{i % 2}"})
        assert r.status == 200, await r.text()
    r = await client.post("/v1/evinfra/split", json={"prefill": ["n0"]})
    assert r.status == 200, await r.text()
    for _ in range(300):
        v = await view(client)
        if not v["switching"] and v["split"] == "1P3D":
            break
        await asyncio.sleep(0.01)
    assert v["split"] == "1P3D" and v["prefill"] == ["n0"] and v["decode"] == ["n1", "n2", "n3"]
    switch = v["switches"][-1]
    assert switch["label"] == "1P3D" and switch["reason"] == "forced by an operator"
    assert switch["time"] <= v["time"] and len(v["switches"]) == 1
    assert v["counters"]["ok"] == 3 and v["split_changes"] == 1
    assert v["ttft"]["count"] == 3 and v["e2e"]["count"] == 3
    assert 0 < v["ttft"]["p50"] <= v["e2e"]["p50"]
    assert v["requests_per_s"] > 0 and v["errors_per_s"] == 0
    assert v["branches_seen"] == 2 and v["agents"] == 2
    assert {n["name"]: n["phase"] for n in v["nodes"]} == {
        "n0": "prefill", "n1": "decode", "n2": "decode", "n3": "decode"}
    assert sum(n["blocks"] for n in v["nodes"]) > 0  # the prompts' KV is in the directory
    assert v["series"][0][1:4] == [0, 0, 4]  # sampled during the warm-up
    await asyncio.sleep(1.05)  # one sample a second at most
    last = (await view(client))["series"][-1]
    assert last[1:4] == [1, 3, 0] and set(last[4]) == {"n0", "n1", "n2", "n3"}


def done(t: float, ttft: float | None, e2e: float, status: str = "ok",
         branch: str = "b") -> RequestDone:
    arrival = t - e2e
    return RequestDone("r", branch, arrival, t, status, 10, 5,
                       first_token=arrival + ttft if ttft is not None else None)


def test_board_percentiles_rates_and_windows(service):
    status = service.status()
    board = Board(start=0.0, latency_window_s=300.0, rate_window_s=60.0)
    board.request_done(done(10.0, 9.0, 20.0, branch="old"))  # leaves the window at 310
    for i, ttft in enumerate([0.1, 0.2, 0.4, 0.8]):
        board.request_done(done(290.0 + i, ttft, 2 * ttft + 1, branch=f"b{i % 2}"))
    board.request_done(done(300.0, None, 0.5, "aborted"))  # the client left: no error
    board.request_done(done(301.0, None, 0.5, "EngineError"))
    v = board.view(305.0, status, agents=7)
    assert v.ttft.count == 5 and v.e2e.count == 5  # requests that ended ok only
    assert v.ttft.p50 == pytest.approx(np.percentile([9.0, 0.1, 0.2, 0.4, 0.8], 50))
    assert v.rate_window_s == 60.0 and v.requests_per_s == pytest.approx(6 / 60)
    assert v.errors_per_s == pytest.approx(1 / 60) and v.agents == 7
    assert v.branches_seen == 4  # "old", b0, b1, and "b" of the last two
    later = board.view(311.0, status, agents=7)  # control: the first request has aged out
    assert later.ttft.count == 4 and later.ttft.p99 < 1.0 and later.branches_seen == 3
    assert later.requests_per_s == pytest.approx(6 / 60)
    # The rate's window is the last minute: at 352.5 s three requests ended in it.
    assert board.view(352.5, status, agents=7).requests_per_s == pytest.approx(3 / 60)


def test_board_rates_over_its_own_age_and_bounded_rings(service):
    status = service.status()
    board = Board(start=100.0, sample_every=1.0, samples=3, events=2)
    board.request_done(done(105.0, 0.1, 0.2))
    assert board.view(110.0, status, 0).requests_per_s == pytest.approx(1 / 10)
    for t in (110.5, 111.0, 111.2, 112.0, 113.0, 114.5):
        board.view(t, status, 0)
    times = [s.time for s in board.view(114.6, status, 0).series]
    assert times == [112.0, 113.0, 114.5]  # one a second at most, the last three kept
    for t, p in ((1.0, ["n0"]), (2.0, ["n0", "n1"]), (3.0, ["n1"])):
        board.split_changed(SplitChanged(t, p, [n for n in ("n0", "n1", "n2") if n not in p],
                                         "why"))
    assert [(s.time, s.label) for s in board.view(115.0, status, 0).switches] == [
        (2.0, "2P1D"), (3.0, "1P2D")]


@pytest.mark.parametrize("config_overrides", [{"server": {"api_key": "k", "admin_key": "a"}}])
async def test_viewing_needs_no_key(client):
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css",
                 "/dashboard/plotly.min.js", "/v1/evinfra/dashboard"):
        assert (await client.get(path)).status == 200, path
    assert (await client.get("/", allow_redirects=False)).status == 302
    # Control: the keys still guard the rest.
    assert (await client.get("/v1/evinfra/status")).status == 401
    assert (await client.post("/v1/evinfra/split", json={"prefill": ["n0"]})).status == 401
