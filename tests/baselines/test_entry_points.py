"""Every policy through its public entry points: ``evinfra simulate --policy`` and the
``[policy]`` section of the config ``evinfra serve`` runs (in process, its HTTP app)."""

from __future__ import annotations

import json

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from evinfra.api import build_app
from evinfra.api.tokenizer import ByteTokenizer
from evinfra.baselines import POLICIES
from evinfra.cli import main
from evinfra.config import load_config
from evinfra.core.clock import WallClock
from evinfra.control import Service

SMALL = """
[cluster]
nodes = [{ name = "n0" }, { name = "n1" }, { name = "n2" }, { name = "n3" }]
initial_prefill = 2
[planner]
t_learn = 60.0
t_win = 60.0
m = 4
hold_off = 20.0
[fake]
l1_tokens = 400000
l2_tokens = 1600000
"""

SERVE = """
[server]
first_token_timeout_s = 5.0
token_timeout_s = 2.0
[cluster]
nodes = [{ name = "n0" }, { name = "n1" }, { name = "n2" }, { name = "n3" }]
initial_prefill = 2
[fake]
c0 = 0.001
c1 = 1e-6
c2 = 1e-12
d0 = 0.001
d1 = 0.001
d2 = 1e-5
switch_latency = 0.01
heartbeat_s = 0.2
[planner]
t_learn = 3600.0
[policy]
name = "%s"
"""


@pytest.mark.parametrize("policy", POLICIES)
def test_simulate_runs_every_policy(policy, tmp_path) -> None:
    cfg = tmp_path / "small.toml"
    cfg.write_text(SMALL)
    out = tmp_path / "out"
    assert main(["simulate", "--config", str(cfg), "--workload", "cc", "--agents", "4",
                 "--duration", "120", "--warmup", "60", "--seed", "2", "--out", str(out),
                 "--no-progress", "--policy", policy]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["run"]["policy"] == policy
    assert report["summary"]["requests"] > 0 and report["summary"]["errors"] == 0


@pytest.mark.parametrize("policy", ["static-sglang", "dynamo", "arrow", "thunderagent",
                                    "evinfra-cache-aware"])
async def test_serve_runs_the_policy_of_its_config(policy, tmp_path) -> None:
    cfg = tmp_path / "serve.toml"
    cfg.write_text(SERVE % policy)
    service = Service.from_config(load_config(cfg), WallClock())
    await service.start()
    try:
        async with TestClient(TestServer(build_app(service, ByteTokenizer()))) as client:
            for i in range(3):
                r = await client.post("/v1/completions", data=msgspec.json.encode(
                    {"model": "evinfra-fake", "prompt": "hello " * 200 + str(i),
                     "max_tokens": 8, "ignore_eos": True}),
                    headers={"X-Evinfra-Branch-Id": "agent-1"})
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 8
            status = await (await client.get("/v1/evinfra/status")).json()
            assert status["policy"]["name"] == policy
    finally:
        await service.stop()
