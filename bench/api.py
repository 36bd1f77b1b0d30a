"""The HTTP front's cost: the same fake engines called in-process and through ``evinfra serve``.

    python -m bench.api [--quick]

Streaming completions go first to a service in this process (``Service.submit`` with an
in-memory sink), then over HTTP to ``evinfra serve`` (a subprocess on loopback), side by
side in one run. Both use the same fast fake engines on uvloop (as ``serve`` runs), so the
difference is what the front adds (HTTP, tokenizing, JSON, SSE, the socket). The engines'
iterations are whole milliseconds: uvloop's clock has millisecond resolution and asyncio's
epoll waits at least one, so sub-millisecond iterations ran at a speed set by the loop.
Two loads: one client sending back to back gives the added latency (p50/p99, from sending
the request to the end of the answer; ``time.perf_counter``) without queueing; 64
concurrent clients give requests/s. Goal (issue 41): <= 1 ms p50 added, >= 0.8x the
in-process rate at 64 clients.

The HTTP clients run in a process of their own, so that they do not share the server's
event loop, and are as cheap as a client can be: a raw socket per client that sends one
prepared request and reads until the end of the chunked answer, parsing nothing. What they
cost is printed apart (their own CPU per request): on a machine of two cores it is CPU the
server does not get. The CPU the serving process spends per request (its own, from
``/proc``) does not depend on what else the machine runs as the latencies and rates do.

The floor: a bare aiohttp server (same loop, no middleware, no engines) answering each
request with the bytes ``evinfra serve`` sent, one write per engine step as the front
writes them (paced by one timer at the decode step, as the engines' steps pace the front),
the last events with the end of the body. Its CPU per request is what HTTP and the writes
alone cost; the front's own cost is what ``evinfra serve`` adds on top of the engines
(in-process) and that floor.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import uvloop

from evinfra.api.tokenizer import ByteTokenizer
from evinfra.config import parse_config
from evinfra.core.clock import WallClock
from evinfra.core.contracts import Sampling
from evinfra.logs import configure_logging
from evinfra.control import Service, Submission

CLIENTS = 64
FAST = {
    "cluster": {"nodes": [{"name": f"n{i}"} for i in range(9)], "initial_prefill": 6},
    "fake": {"c0": 0.002, "c1": 1e-8, "c2": 0.0, "c3": 0.0, "d0": 0.002, "d1": 0.0, "d2": 0.0,
             "d_ctx": 0.0},
}
TOML = """
[server]
port = {port}
[cluster]
initial_prefill = 6
[fake]
c0 = 0.002
c1 = 1e-8
c2 = 0.0
c3 = 0.0
d0 = 0.002
d1 = 0.0
d2 = 0.0
d_ctx = 0.0
"""
PROMPT = "Summarise the design of a KV directory in one line."
MAX_TOKENS = 16
WARM = 10
"""Requests per client before the timed ones, on each side."""
_END = b"\r\n0\r\n\r\n"
"""How a chunked answer ends (an SSE event's data ends with a blank line, not this)."""


class _Done:
    def __init__(self, fut: asyncio.Future) -> None:
        self.fut = fut

    def tokens(self, tokens, logprobs) -> None:
        pass

    def done(self, record, error) -> None:
        if not self.fut.done():
            self.fut.set_result(error)


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of a process (this one by default)."""
    if pid is None:
        return time.process_time()
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def in_process(clients: int, per_client: int) -> tuple[np.ndarray, float, float]:
    service = Service.from_config(parse_config(FAST), WallClock())
    await service.start()
    tokens = ByteTokenizer().encode(PROMPT)
    loop = asyncio.get_running_loop()
    lat: list[float] = []

    async def client(n: int) -> None:
        for i in range(n):
            fut = loop.create_future()
            t = time.perf_counter()
            service.submit(Submission(tokens, Sampling(MAX_TOKENS, ignore_eos=True)), _Done(fut))
            assert await fut is None
            lat.append(time.perf_counter() - t)

    await asyncio.gather(*(client(WARM) for _ in range(clients)))
    lat.clear()
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    await asyncio.gather(*(client(per_client) for _ in range(clients)))
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    await service.stop()
    return np.array(lat), len(lat) / wall, cpu / len(lat)


class _Answers(asyncio.Protocol):
    """One keep-alive connection's streamed answers, each whole once its chunked body
    ends."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.answer: asyncio.Future[bytes] | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.buf.endswith(_END):
            self.answer.set_result(bytes(self.buf))
            self.buf.clear()

    def connection_lost(self, exc) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(ConnectionError(f"connection lost: {exc}"))


async def _load(port: int, clients: int, per_client: int, server_pid: int) -> tuple:
    body = msgspec.json.encode({"model": "evinfra-fake", "prompt": PROMPT,
                                "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    last = b""

    async def client(conn: _Answers, n: int) -> None:
        nonlocal last
        for i in range(n):
            conn.answer = loop.create_future()
            t = time.perf_counter()
            conn.transport.write(request)
            last = await conn.answer
            lat.append(time.perf_counter() - t)
            assert last.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in last, last[:300]

    conns = [(await loop.create_connection(_Answers, "127.0.0.1", port))[1]
             for _ in range(clients)]
    await asyncio.gather(*(client(c, WARM) for c in conns))
    lat.clear()
    t0, cpu0, server0 = time.perf_counter(), cpu_seconds(), cpu_seconds(server_pid)
    await asyncio.gather(*(client(c, per_client) for c in conns))
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    server = cpu_seconds(server_pid) - server0
    for c in conns:
        c.transport.close()
    n = len(lat)
    return lat, n / wall, server / n, cpu / n, last


def _client(port: int, clients: int, per_client: int, server_pid: int, out: Connection
            ) -> None:
    out.send(uvloop.run(_load(port, clients, per_client, server_pid)))


def over_socket(port: int, server_pid: int, clients: int, per_client: int) -> tuple:
    """``clients`` clients in a process of their own: latencies (s), requests/s, the
    server's and the clients' CPU seconds per request, and the last answer."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_client, args=(port, clients, per_client, server_pid, send))
    proc.start()
    send.close()  # (a client that fails closes the pipe: EOFError here, not a hang)
    lat, rps, server, client, last = recv.recv()
    proc.join()
    return np.array(lat), rps, server, client, last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str) -> None:
    for _ in range(600):
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never answered")


def events_of(answer: bytes) -> list[bytes]:
    """The server-sent events of a raw chunked HTTP answer."""
    rest = answer.partition(b"\r\n\r\n")[2]
    body = bytearray()
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        body += rest[:n]
        rest = rest[n + 2:]
    return [e + b"\n\n" for e in bytes(body).split(b"\n\n") if e]


def _floor_server(port: int, events: list[bytes], step: float) -> None:
    from aiohttp import web

    from evinfra.api.sse import EventStream

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tick = loop.create_future()

        async def ticker() -> None:
            nonlocal tick
            while True:
                await asyncio.sleep(step)
                tick, fired = loop.create_future(), tick
                fired.set_result(None)

        async def answer(request: web.Request) -> web.StreamResponse:
            await request.read()
            # A token per engine step; the last, the finish and [DONE] in the last step,
            # written with the end of the body (as the front writes them).
            last = len(events) - 3
            resp = EventStream(lambda: i >= last)
            await resp.prepare(request)
            for i, data in enumerate(events):
                if i <= last:
                    await tick
                await resp.send(data)
            await resp.end()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        app.router.add_get("/ready", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ticking = asyncio.ensure_future(ticker())
        await asyncio.Event().wait()
        ticking.cancel()

    uvloop.run(main())


def over_http(loads: list[tuple[int, int]]) -> list[tuple]:
    """Each (clients, per client) load against one ``evinfra serve``."""
    port = _free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(TOML.format(port=port))
    proc = subprocess.Popen([sys.executable, "-m", "evinfra.cli", "serve", "--config", f.name,
                             "--log-level", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready")
        return [over_socket(port, proc.pid, clients, n) for clients, n in loads]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.unlink(f.name)


def floor(events: list[bytes], clients: int, per_client: int) -> tuple:
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_floor_server, args=(port, events, FAST["fake"]["d0"]),
                       daemon=True)
    proc.start()
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready")
        return over_socket(port, proc.pid, clients, per_client)
    finally:
        proc.terminate()
        proc.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    quick = ap.parse_args().quick
    configure_logging("console", "warning")  # the in-process service logs as serve would
    serial, per_client = (40, 3) if quick else (300, 20)
    d_lat, _, _ = uvloop.run(in_process(1, serial))
    (h_lat, _, _, c1_cpu, answer), (_, h_rps, h_cpu, c_cpu, _) = over_http(
        [(1, serial), (CLIENTS, per_client)])
    _, d_rps, d_cpu = uvloop.run(in_process(CLIENTS, per_client))
    events = events_of(answer)
    _, f_rps, f_cpu, _, _ = floor(events, CLIENTS, per_client)
    d50, d99 = np.percentile(d_lat, [50, 99]) * 1e3
    h50, h99 = np.percentile(h_lat, [50, 99]) * 1e3
    print(f"streaming completions, {MAX_TOKENS} output tokens ({len(events)} events), "
          "same fake engines")
    print(f"{'':<26}{'in-process':>12}{'HTTP':>12}{'added / ratio':>16}")
    print(f"{'1 client, p50 latency ms':<26}{d50:>12.2f}{h50:>12.2f}{h50 - d50:>+16.2f}"
          "   goal <= 1 ms added")
    print(f"{'1 client, p99 latency ms':<26}{d99:>12.2f}{h99:>12.2f}{h99 - d99:>+16.2f}")
    print(f"{f'{CLIENTS} clients, requests/s':<26}{d_rps:>12.0f}{h_rps:>12.0f}"
          f"{h_rps / d_rps:>15.2f}x   goal >= 0.8x")
    print(f"{'server CPU ms / request':<26}{d_cpu * 1e3:>12.2f}{h_cpu * 1e3:>12.2f}"
          f"{(h_cpu - d_cpu) * 1e3:>+16.2f}")
    print(f"floor, bare aiohttp writing the same events: {f_cpu * 1e3:.2f} CPU ms / request "
          f"({f_rps:.0f} requests/s); the front's own: {(h_cpu - d_cpu - f_cpu) * 1e3:+.2f}")
    print(f"HTTP clients' own CPU ms / request (another process): {c1_cpu * 1e3:.2f} at 1, "
          f"{c_cpu * 1e3:.2f} at {CLIENTS}   (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
