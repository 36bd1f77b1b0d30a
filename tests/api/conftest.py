"""An in-process service with its HTTP app on a test server (wall clock, fake engines)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI

from evinfra.api import build_app
from evinfra.api.tokenizer import ByteTokenizer
from evinfra.config import parse_config
from evinfra.core.clock import WallClock
from evinfra.drivers.fake.outputs import OutputPlanner
from evinfra.control import Service

BASE = {
    "server": {"first_token_timeout_s": 5.0, "token_timeout_s": 2.0},
    "limits": {"body_bytes": 200_000},
    "cluster": {"nodes": [{"name": f"n{i}"} for i in range(4)], "initial_prefill": 2},
    # Fast fake engines: a test waits milliseconds, not the paper's seconds.
    "fake": {"c0": 0.001, "c1": 1e-6, "c2": 1e-12, "d0": 0.001, "d1": 0.001, "d2": 1e-5,
             "switch_latency": 0.01, "heartbeat_s": 0.2},
    "planner": {"t_learn": 3600.0},
}


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


@pytest.fixture
def config_overrides() -> dict:
    return {}


@pytest.fixture
async def service(config_overrides):
    config = parse_config(merged(BASE, config_overrides))
    svc = Service.from_config(config, WallClock())
    await svc.start()
    yield svc
    await svc.stop()


@pytest.fixture
async def client(service):
    app = build_app(service, ByteTokenizer())
    async with TestClient(TestServer(app)) as c:
        yield c


def body(**kw) -> bytes:
    return msgspec.json.encode(kw)


def openai_client(client: TestClient) -> AsyncOpenAI:
    """The official client on the test server."""
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)


def model_says(monkeypatch, text: str) -> None:
    """The fake engines' output for every request: the bytes of ``text`` (the byte
    tokenizer's ids), then "stop"."""
    ids = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint32)
    monkeypatch.setattr(OutputPlanner, "plan", lambda self, request, sampling: (ids, "stop"))


async def eventually(check, seconds: float = 5.0) -> bool:
    """Whether ``check()`` holds within ``seconds`` (polled every 10 ms)."""
    for _ in range(int(seconds / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


def spy_submissions(service) -> list:
    """The submissions the service gets, from now on."""
    subs = []
    submit = service.submit

    def spy(sub, sink):
        subs.append(sub)
        return submit(sub, sink)
    service.submit = spy
    return subs


def spy_prefill_orders(service) -> list:
    """The prefill orders the service sends its engines, from now on."""
    orders = []
    for d in service.drivers.values():
        def spy(order, _f=d.submit_prefill):
            orders.append(order)
            return _f(order)
        d.submit_prefill = spy
    return orders
