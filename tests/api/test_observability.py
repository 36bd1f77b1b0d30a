"""What an operator reads: one access-log line per request with its request id (the client's
or one made up, echoed), ``/metrics`` with answers by route and status class, the process's
figures, each node's KV use and branches, stable label values, and wall-clock times in
``/v1/evinfra/status``."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from evinfra.api.metrics import Metrics
from evinfra.core.events import RequestDone
from tests.api.conftest import body

USER = [{"role": "user", "content": "hello there " * 20}]


def access_lines(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "http_request"]


async def test_each_request_has_an_access_line_and_an_echoed_id(client, logs):
    r = await client.post("/v1/chat/completions", data=body(
        model="evinfra-fake", messages=USER, max_tokens=3, ignore_eos=True),
        headers={"x-request-id": "client-abc-1", "X-Evinfra-Branch-Id": "agent-7"})
    assert r.status == 200 and r.headers["x-request-id"] == "client-abc-1"
    r2 = await client.get("/v1/nothing")
    made_up = r2.headers["x-request-id"]
    r3 = await client.get("/health", headers={"x-request-id": "bad id with spaces"})
    assert r3.headers["x-request-id"] != "bad id with spaces"  # not echoed: made up
    assert len(made_up) == 32 and made_up != r3.headers["x-request-id"]
    chat, missing, health = access_lines(logs)
    usage = (await r.json())["usage"]
    assert chat["request_id"] == "client-abc-1" and chat["route"] == "/v1/chat/completions"
    assert chat["status"] == 200 and chat["branch"] == "agent-7"
    assert chat["prompt_tokens"] == usage["prompt_tokens"]
    assert chat["output_tokens"] == usage["completion_tokens"] == 3
    assert chat["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert chat["prefill_nodes"] and chat["decode_nodes"]
    assert 0 < chat["ttft_s"] <= chat["e2e_s"] and chat["outcome"] == ["ok"]
    assert (missing["request_id"], missing["route"], missing["status"]) == (
        made_up, "unmatched", 404)
    assert "branch" not in missing  # it submitted nothing
    assert health["route"] == "/health" and health["status"] == 200


def scrape(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return None


async def test_metrics_count_answers_by_route_and_status_class(client, service, monkeypatch):
    for _ in range(2):
        await client.post("/v1/completions", data=body(model="evinfra-fake", prompt="hi " * 40,
                                                       max_tokens=2))
    await client.post("/v1/completions", data=body(model="evinfra-fake", prompt=["a", 5]))
    await client.get("/v1/nope/1")
    await client.get("/v1/nope/2")

    def broken():
        raise RuntimeError("a bug")
    monkeypatch.setattr("evinfra.api.app.cluster_status", lambda *a: broken())
    assert (await client.get("/v1/evinfra/status")).status == 500
    text = (await (await client.get("/metrics")).read()).decode()
    answers = "evinfra_http_responses_total"
    assert scrape(text, answers, route="/v1/completions", code="2xx") == 2
    assert scrape(text, answers, route="/v1/completions", code="4xx") == 1
    assert scrape(text, answers, route="unmatched", code="4xx") == 2  # one label, any path
    assert scrape(text, answers, route="/v1/evinfra/status", code="5xx") == 1
    # The process's own figures, and each node's KV use and branches.
    assert scrape(text, "process_resident_memory_bytes") > 10e6
    assert scrape(text, "process_open_fds") > 0
    assert "python_gc_objects_collected_total" in text
    used = [scrape(text, "evinfra_node_kv_used_tokens", node=n, tier="l1") for n in service.nodes]
    assert all(u is not None for u in used) and sum(used) > 0
    cap = scrape(text, "evinfra_node_kv_capacity_tokens", node="n0", tier="l2")
    assert cap == service.router.state("n0").l2_capacity
    assert scrape(text, "evinfra_node_branches", node="n0") is not None


def test_request_statuses_are_stable_label_values(service):
    metrics = Metrics(service)
    for status in ("ok", "NoNodeError", "EngineError", "RequestError", "aborted",
                   "SomethingNew"):
        metrics._on_done(RequestDone("r", "b", 0.0, 1.0, status, 10, 0))
    text = metrics.render().decode()
    got = {line.split('"')[1] for line in text.splitlines()
           if line.startswith("evinfra_requests_total{")}
    assert got == {"ok", "no_node", "engine_error", "bad_request", "aborted", "error"}


@pytest.mark.parametrize("config_overrides", [{"planner": {"t_learn": 3600.0}}])
async def test_status_gives_wall_clock_times(client):
    before = time.time()
    status = await (await client.get("/v1/evinfra/status")).json()
    after = time.time()
    now = datetime.fromisoformat(status["time_utc"]).timestamp()
    assert before - 0.01 <= now <= after + 0.01
    assert status["time"] != pytest.approx(now, abs=3600)  # control: "time" is monotonic
    warm = datetime.fromisoformat(status["warmup_until_utc"]).timestamp()
    assert warm - now == pytest.approx(status["warmup_until"] - status["time"], abs=0.002)
    reported = [v["reported_at_utc"] for v in status["nodes"].values() if "reported_at" in v]
    assert reported and all(abs(datetime.fromisoformat(t).timestamp() - now) < 60
                            for t in reported)


def test_every_log_line_is_json_the_standard_librarys_too(capsys):
    """aiohttp logs through the standard library (a traceback over several plain lines, by
    default); configured for JSON, each record is one JSON object, its traceback a field."""
    import json
    import logging

    from evinfra.logs import configure_logging

    import structlog

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    configure_logging("json", "info")
    try:
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("aiohttp.server").exception("Error handling request from %s",
                                                          "peer")
        logging.getLogger("aiohttp.access").info("plain %d", 7)
        structlog.get_logger("evinfra").info("ours", n=1)
    finally:
        root.handlers[:], root.level = handlers, level
    lines = capsys.readouterr().err.strip().splitlines()
    events = [json.loads(line) for line in lines]  # (raises on a plain-text line)
    assert [e["event"] for e in events] == ["Error handling request from peer", "plain 7", "ours"]
    assert events[0]["logger"] == "aiohttp.server" and events[0]["level"] == "error"
    assert "ValueError: boom" in events[0]["exception"]
