"""``etc/grafana-evinfra.json`` queries only metrics that ``/metrics`` serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "etc" / "grafana-evinfra.json"
# The metric names of a query: evinfra's own, and the process figures /metrics serves too.
_NAME = re.compile(r"\b((?:evinfra|process)_[a-z0-9_]+)\b")


def queried(dashboard: dict) -> set[str]:
    """The metric names of every panel's queries."""
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names |= set(_NAME.findall(target["expr"]))
    return names


def served(metrics: str) -> set[str]:
    """The sample names of a Prometheus text exposition (``foo_bucket``, ``foo_total``...)."""
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in metrics.splitlines()
            if line and not line.startswith("#")}


def missing(dashboard: dict, metrics: str) -> set[str]:
    return queried(dashboard) - served(metrics)


async def test_every_metric_the_grafana_dashboard_queries_is_served(client):
    # One request: the labelled series (requests by status, queueing by node) exist after it.
    r = await client.post("/v1/completions", json={"model": "evinfra-fake", "prompt": "hello " * 30,
                                                   "max_tokens": 4, "ignore_eos": True})
    assert r.status == 200, await r.text()
    metrics = await (await client.get("/metrics")).text()
    dashboard = json.loads(DASHBOARD.read_text())
    names = queried(dashboard)
    assert len(names) >= 15, names  # the panels are read, not skipped
    assert missing(dashboard, metrics) == set()
    # The control: a panel over a metric evinfra does not serve is caught.
    wrong = {"panels": dashboard["panels"] + [
        {"targets": [{"expr": "rate(evinfra_ttft_seconds_bucket[5m]) + evinfra_l3_used"}]}]}
    assert missing(wrong, metrics) == {"evinfra_l3_used"}


def test_the_dashboard_is_importable_grafana_json():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] and d["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
