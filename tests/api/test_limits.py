"""``[limits]``, each through the server it bounds: ``/tokenize``'s size and the model's
context, the stored responses' bytes, and on a real listening socket (``FrontRunner``, as
``evinfra serve`` runs it) the header size, the idle and the body-read timeouts, and
aiohttp's own protocol errors answered as JSON."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from evinfra.api import build_app
from evinfra.api.front import FrontRunner
from evinfra.api.response_store import ResponseStore
from evinfra.api.tokenizer import ByteTokenizer
from evinfra.config import LimitsConfig
from tests.api.conftest import body, eventually


@pytest.mark.parametrize("config_overrides", [{"limits": {"tokenize_bytes": 1000},
                                               "model": {"max_context_tokens": 500}}])
async def test_tokenize_is_bounded_by_size_and_by_the_context(client):
    r = await client.post("/tokenize", data=body(prompt="a" * 400))
    assert r.status == 200 and (await r.json())["count"] == 400
    r = await client.post("/tokenize", data=body(prompt="a" * 2000))
    error = (await r.json())["error"]
    assert r.status == 413 and "limits.tokenize_bytes" in error["message"], error
    r = await client.post("/tokenize", data=body(prompt="a" * 600))
    error = (await r.json())["error"]
    assert r.status == 400 and error["code"] == "context_length_exceeded", error
    assert "600 tokens" in error["message"]
    messages = [{"role": "user", "content": "b" * 900}]
    r = await client.post("/tokenize", data=body(messages=messages))
    assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"


async def test_a_long_tokenize_runs_off_the_event_loop(client, monkeypatch):
    """A text past 64 KiB is tokenized in a thread: /health answers while it is blocked.

    The tokenizer waits for /health to have answered; run on the event loop, it would block
    /health until its wait ran out and report that it was never released."""
    tok = ByteTokenizer()
    started, released = threading.Event(), threading.Event()
    seen: list[tuple[str, bool]] = []
    encode = tok.encode

    def blocking(text, **kw):
        started.set()
        seen.append((threading.current_thread().name, released.wait(30)))
        return encode(text, **kw)

    app = client.server.app
    routes = [r for r in app.router.routes() if r.resource.canonical == "/tokenize"]
    owner = routes[0].handler.__self__
    monkeypatch.setattr(owner.tok, "encode", blocking)
    long = asyncio.ensure_future(client.post("/tokenize", data=body(prompt="a" * 100_000)))
    while not started.is_set():
        await asyncio.sleep(0.01)
    assert (await client.get("/health")).status == 200
    released.set()
    r = await long
    assert r.status == 200 and (await r.json())["count"] == 100_000
    (thread, was_released), = seen
    assert was_released and thread != "MainThread"


def test_stored_responses_are_bounded_in_bytes():
    store = ResponseStore(1000, max_bytes=10_000)
    convo = [{"role": "user", "content": "x" * 2000}]
    for i in range(10):
        store.put({"id": f"r{i}"}, convo, None)
    assert store.bytes <= 10_000 and len(store) == 4  # ~2.04 kB each
    assert [store.get(f"r{i}") is not None for i in (5, 6, 9)] == [False, True, True]
    store.put({"id": "huge"}, [{"content": "y" * 20_000}], None)  # past the bound alone
    assert store.get("huge") is None and len(store) == 4
    # Control: by count alone, all ten would stay.
    count_only = ResponseStore(1000, max_bytes=10**9)
    for i in range(10):
        count_only.put({"id": f"r{i}"}, convo, None)
    assert len(count_only) == 10
    count_only.delete("r3")
    assert count_only.bytes == 9 * store.get("r9").size


@pytest.fixture
async def front(service):
    """The app behind ``FrontRunner`` on a loopback port, as ``evinfra serve`` runs it."""
    runner = FrontRunner(build_app(service, ByteTokenizer()), service.config.limits)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield site._server.sockets[0].getsockname()[1]
    await runner.cleanup()


async def exchange(port: int, data: bytes, wait: float = 5.0) -> bytes:
    """What the server sends back until it closes the connection (or ``wait`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    got = b""
    try:
        async with asyncio.timeout(wait):
            while part := await reader.read(65536):
                got += part
    except TimeoutError:
        got += b"<still open>"
    writer.close()
    return got


def answer(raw: bytes) -> tuple[int, dict]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)


LIMITS = {"limits": {"idle_timeout_s": 0.3, "read_timeout_s": 0.3, "header_bytes": 1024}}


@pytest.mark.parametrize("config_overrides", [LIMITS])
async def test_idle_and_stalled_connections_are_let_go(front):
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await exchange(front, b"") == b""  # connected, sent nothing: closed
    assert await exchange(front, b"GET /health HTTP/1.1\r\nHost: x\r\n") == b""  # half a head
    assert loop.time() - t0 < 3.0
    stalled = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
               b"\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    status, error = answer(await exchange(front, stalled))
    assert status == 408 and error["error"]["code"] == "read_timeout"
    # Control: a keep-alive client that asks in time is served.
    ok = await exchange(front, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer(ok)[0] == 200


async def test_with_default_limits_an_idle_connection_is_kept(front):
    """Control for the test above: the default idle timeout is 75 s."""
    assert LimitsConfig().idle_timeout_s == 75.0
    assert await exchange(front, b"", wait=1.0) == b"<still open>"


@pytest.mark.parametrize("config_overrides", [LIMITS])
async def test_protocol_errors_are_json_and_headers_are_bounded(front):
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2000 + b"\r\n\r\n"
    raw = await exchange(front, big)
    status, error = answer(raw)
    assert status in (400, 431) and "malformed HTTP request" in error["error"]["message"]
    assert b"aiohttp" not in raw.lower()
    status, error = answer(await exchange(front, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and error["error"]["type"] == "invalid_request_error"
    # Control: a header under the bound is fine.
    fine = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 900 + b"\r\nConnection: close\r\n\r\n"
    assert answer(await exchange(front, fine))[0] == 200


@pytest.mark.parametrize("config_overrides", [{"limits": {"bodies_bytes": 250_000}}])
async def test_the_bodies_held_at_once_are_bounded(client, service):
    """Issue 41, finding 5: 20 concurrent 15.5 MB bodies took RSS from 299 to 709 MB. A body
    counts from its headers until its answer is over; past ``bodies_bytes`` a request is a
    503 with Retry-After, and once the first is over the same request is served."""
    def completion(size: int, **kw) -> bytes:
        return body(model="evinfra-fake", prompt="x" * size, **kw)

    long = await client.post("/v1/completions", data=completion(
        150_000, max_tokens=2000, ignore_eos=True, stream=True))
    assert long.status == 200
    await long.content.readline()  # streaming: its 150 kB body is held
    busy = await client.post("/v1/completions", data=completion(150_000, max_tokens=2))
    error = (await busy.json())["error"]
    assert busy.status == 503 and busy.headers["Retry-After"] == "1", error
    assert error["code"] == "bodies_full" and "limits.bodies_bytes" in error["message"]
    small = await client.post("/v1/completions", data=completion(50_000, max_tokens=2))
    assert small.status == 200  # control: under the bound beside the held one
    long.close()  # the client goes away: its request ends, its body is let go
    assert await eventually(lambda: service.in_flight() == 0)
    again = await client.post("/v1/completions", data=completion(150_000, max_tokens=2))
    assert again.status == 200
