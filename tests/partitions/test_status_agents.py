"""Through the HTTP API: a partition's ``/v1/evinfra/status`` lists the agents it served, by
the identity nginx hashes (``X-Evinfra-Agent``, the branch hints, the API key)."""

from __future__ import annotations

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from evinfra.api import build_app
from evinfra.api.tokenizer import ByteTokenizer
from evinfra.config import parse_config
from evinfra.control import Service
from evinfra.core.clock import WallClock

CONFIG = {
    "cluster": {"nodes": [{"name": "n0"}, {"name": "n1"}], "initial_prefill": 1},
    "fake": {"c0": 0.001, "c1": 1e-6, "d0": 0.001, "d1": 0.001, "d2": 1e-5},
    "planner": {"t_learn": 3600.0},
}


@pytest.fixture
async def client():
    svc = Service.from_config(parse_config(CONFIG), WallClock())
    await svc.start()
    async with TestClient(TestServer(build_app(svc, ByteTokenizer()))) as c:
        yield c
    await svc.stop()


async def ask(client, headers: dict) -> None:
    r = await client.post("/v1/completions", headers=headers, data=msgspec.json.encode(
        {"model": "evinfra-fake", "prompt": "hello there", "max_tokens": 2}))
    assert r.status == 200, await r.text()


async def test_status_lists_the_agents_served(client):
    await ask(client, {"X-Evinfra-Agent": "alice"})
    await ask(client, {"X-Evinfra-Agent": "alice", "X-Evinfra-Branch-Id": "alice-sub"})
    await ask(client, {"X-Dynamo-Session-ID": "run-7:tester",
                       "X-Dynamo-Parent-Session-ID": "run-7"})
    await ask(client, {"Authorization": "Bearer whatever"})
    await ask(client, {})  # no identity: not listed
    status = await (await client.get("/v1/evinfra/status")).json()
    agents = status["agents"]["agents"]
    assert agents["alice"]["requests"] == 2 and agents["run-7"]["requests"] == 1
    keyed = [a for a in agents if a.startswith("key:")]
    assert len(keyed) == 1 and status["agents"]["count"] == 3
    assert "counters" in status  # the service's own status is still all there


async def test_a_refused_request_still_names_its_agent_but_a_bad_route_does_not(client):
    r = await client.post("/v1/completions", headers={"X-Evinfra-Agent": "bob"},
                          data=b"{not json")
    assert r.status == 400
    r = await client.get("/v1/models", headers={"X-Evinfra-Agent": "carol"})
    assert r.status == 200
    agents = (await (await client.get("/v1/evinfra/status")).json())["agents"]["agents"]
    assert "bob" in agents and "carol" not in agents
