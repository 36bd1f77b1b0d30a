"""``evinfra serve`` as a process: it refuses to start open on the network, says at start that
the admin routes are off with only an API key, writes every log line as JSON (aiohttp's own
errors too), and a second SIGTERM cuts the shutdown grace short."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
[server]
port = 0
shutdown_grace_s = 30.0
{extra}
[cluster]
nodes = [{{ name = "n0" }}, {{ name = "n1" }}]
initial_prefill = 1
[fake]
c0 = 0.002
c1 = 1e-6
d0 = 0.02
d1 = 0.002
d2 = 1e-5
"""


def serve(tmp_path: Path, extra: str = "", *args: str) -> tuple[subprocess.Popen, Path]:
    cfg, log = tmp_path / "cluster.toml", tmp_path / "serve.log"
    cfg.write_text(CONFIG.format(extra=extra))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "evinfra.cli", "serve", "--config",
                                 str(cfg), "--log-format", "json", *args], cwd=ROOT,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def port_of(proc: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = re.search(r"serving 'evinfra-fake' on http://[^:]+:(\d+)", log.read_text())
        if found:
            return int(found.group(1))
        assert proc.poll() is None, log.read_text()
        time.sleep(0.05)
    raise AssertionError("the server did not start: " + log.read_text()[-2000:])


def raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        got = b""
        while part := sock.recv(65536):
            got += part
    return got


def streaming(sock: socket.socket) -> None:
    """Wait for the first event of a stream (the headers may come alone, before it)."""
    got = part = b"."
    while b"data: " not in got and part:
        part = sock.recv(65536)
        got += part
    assert b"data: " in got, got


def in_flight(port: int, key: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/evinfra/status",
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=5) as r:
        return json.loads(r.read())["in_flight"]


def test_a_server_open_on_the_network_refuses_to_start(tmp_path):
    proc, log = serve(tmp_path, "", "--host", "0.0.0.0")
    assert proc.wait(timeout=30) == 2
    out = log.read_text()
    assert "server.open_network" in out and len(out.strip().splitlines()) == 1, out
    # Control: the operator says so, and it serves (and says what that means).
    proc, log = serve(tmp_path, "open_network = true", "--host", "0.0.0.0")
    try:
        port_of(proc, log)
        assert "open to whoever reaches the port" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_a_second_sigterm_cuts_the_grace_short_and_every_line_is_json(tmp_path):
    proc, log = serve(tmp_path, 'api_key = "sk-user"')
    try:
        port = port_of(proc, log)
        assert "the admin routes are disabled" in log.read_text()
        key = b"Authorization: Bearer sk-user\r\n"
        # aiohttp's own errors: a header past the bound, a body that does not gunzip.
        big = raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        assert big.split()[1] in (b"400", b"431")
        gz = raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + key +
                 b"Content-Encoding: gzip\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot gzip!")
        assert gz.split()[1] == b"400" and b'"error"' in gz
        # A request that decodes for minutes keeps the server in its grace.
        body = json.dumps({"model": "evinfra-fake", "prompt": "go", "max_tokens": 100_000,
                           "ignore_eos": True, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + key +
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        streaming(sock)
        deadline = time.monotonic() + 10
        while in_flight(port, "sk-user") == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(1.5)
        assert proc.poll() is None  # control: one SIGTERM waits out the 30 s grace
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - t0 < 5
        sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text()
    lines = [line for line in out.splitlines() if line.strip()]
    plain = [line for line in lines if not line.startswith("{")]
    # The two lines `evinfra serve` prints for a person (where it serves, the warning).
    assert len(plain) == 2 and plain[0].startswith("evinfra serving"), plain
    events = [json.loads(line) for line in lines if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "shutdown_hurried" in names and "stopped" in names
    assert "bad_http_request" in names
    stopped = [e for e in events if e["event"] == "stopped"][0]
    assert stopped["failed_at_shutdown"] == 1
    assert "Traceback" not in out


@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_sigint_twice_also_hurries(tmp_path, signum):
    proc, log = serve(tmp_path)
    try:
        port = port_of(proc, log)
        body = json.dumps({"model": "evinfra-fake", "prompt": "go", "max_tokens": 100_000,
                           "ignore_eos": True, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " +
                     str(len(body)).encode() + b"\r\n\r\n" + body)
        streaming(sock)
        os.kill(proc.pid, signum)
        time.sleep(0.5)
        assert proc.poll() is None
        os.kill(proc.pid, signum)
        assert proc.wait(timeout=15) == 0
        sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
