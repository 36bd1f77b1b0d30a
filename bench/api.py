"""The HTTP front's cost: the same fake engines called in-process and through ``evinfra serve``.

    python -m bench.api [--quick]

Streaming completions go first to a service in this process (``Service.submit`` with an
in-memory sink), then over HTTP to ``evinfra serve`` (a subprocess on loopback, an aiohttp
client reading SSE). Both use the same fast fake engines on the same event loop (uvloop, as
``serve`` runs), so the difference is what the front adds (tokenizing, JSON, SSE, the
socket). The engines' iterations are whole milliseconds: uvloop's clock has millisecond
resolution and asyncio's epoll waits at least one, so sub-millisecond iterations ran at a
speed set by the loop (the two sides once differed by 8 ms the wrong way). Latencies are
``time.perf_counter``'s. Two loads: one client sending back to back gives the added latency
(p50/p99) without queueing; 64 concurrent clients give requests/s. Goal (issue 41): <= 1 ms
p50 added, >= 0.8x the in-process rate at 64 clients. Server and client share this machine's
cores, so the HTTP figures include the client's own parsing, as a user's would; run it on a
quiet machine. The CPU seconds the serving process spends per request (its own, from
``/proc``, under the 64 clients) do not depend on what else the machine runs: their
difference is the front's cost however loaded the machine is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
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

    async def client(c: int) -> None:
        for i in range(per_client):
            fut = loop.create_future()
            t = time.perf_counter()
            service.submit(Submission(tokens, Sampling(MAX_TOKENS, ignore_eos=True)), _Done(fut))
            assert await fut is None
            lat.append(time.perf_counter() - t)

    t0, cpu0 = time.perf_counter(), cpu_seconds()
    await asyncio.gather(*(client(c) for c in range(clients)))
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
    await service.stop()
    return np.array(lat), len(lat) / wall, cpu / len(lat)


async def over_http(clients: int, per_client: int) -> tuple[np.ndarray, float, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(TOML.format(port=port))
    proc = subprocess.Popen([sys.executable, "-m", "evinfra.cli", "serve", "--config", f.name,
                             "--log-level", "warning"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    lat: list[float] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CLIENTS)) as http:
            for _ in range(300):
                try:
                    async with http.get(base + "/ready") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
            body = {"model": "evinfra-fake", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "ignore_eos": True, "stream": True}
            async def client(c: int) -> None:
                for i in range(per_client):
                    t = time.perf_counter()
                    async with http.post(base + "/v1/completions", json=body) as r:
                        assert r.status == 200
                        async for line in r.content:
                            if line.startswith(b"data: [DONE]"):
                                break
                    lat.append(time.perf_counter() - t)

            t0, cpu0 = time.perf_counter(), cpu_seconds(proc.pid)
            await asyncio.gather(*(client(c) for c in range(clients)))
            wall, cpu = time.perf_counter() - t0, cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.unlink(f.name)
    return np.array(lat), len(lat) / wall, cpu / len(lat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    quick = ap.parse_args().quick
    configure_logging("console", "warning")  # the in-process service logs as serve would
    serial, per_client = (40, 3) if quick else (300, 20)
    d_lat, _, _ = uvloop.run(in_process(1, serial))
    h_lat, _, _ = asyncio.run(over_http(1, serial))
    _, d_rps, d_cpu = uvloop.run(in_process(CLIENTS, per_client))
    _, h_rps, h_cpu = asyncio.run(over_http(CLIENTS, per_client))
    d50, d99 = np.percentile(d_lat, [50, 99]) * 1e3
    h50, h99 = np.percentile(h_lat, [50, 99]) * 1e3
    print(f"streaming completions, {MAX_TOKENS} output tokens, same fake engines")
    print(f"{'':<26}{'in-process':>12}{'HTTP':>12}{'added / ratio':>16}")
    print(f"{'1 client, p50 latency ms':<26}{d50:>12.2f}{h50:>12.2f}{h50 - d50:>+16.2f}"
          "   goal <= 1 ms added")
    print(f"{'1 client, p99 latency ms':<26}{d99:>12.2f}{h99:>12.2f}{h99 - d99:>+16.2f}")
    print(f"{f'{CLIENTS} clients, requests/s':<26}{d_rps:>12.0f}{h_rps:>12.0f}"
          f"{h_rps / d_rps:>15.2f}x   goal >= 0.8x")
    print(f"{'server CPU ms / request':<26}{d_cpu * 1e3:>12.2f}{h_cpu * 1e3:>12.2f}"
          f"{(h_cpu - d_cpu) * 1e3:>+16.2f}   (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
