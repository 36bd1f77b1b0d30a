"""The global tier with the real parts: Debian's nginx, with the config ``evinfra partitions
nginx`` writes, in front of three ``evinfra serve`` partitions on loopback, driven by the
``openai`` client (paper D.2: each user bound to one partition).

nginx is installed by the project's setup (``scripts/install-nginx.sh``, from ``make test``);
without it these tests skip, unless ``EVINFRA_NGINX_REQUIRED=1`` (``make test``), which makes
them fail. nginx runs as a child process of the test (``daemon off``, a temporary prefix), never
the system service. The tests run in order: the last one kills a partition.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, NamedTuple

import openai
import pytest

from engines import free_port  # tests/integration/sglang_cpu, on the path via conftest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "evinfra-fake"
# Three fake nodes per partition; a decode iteration of 10 ms, so a 60-token answer streams
# for over half a second (long enough to tell a stream from a buffered answer).
PARTITION = """
[server]
port = {port}
shutdown_grace_s = 1.0
[cluster]
nodes = [{{ name = "n0" }}, {{ name = "n1" }}, {{ name = "n2" }}]
initial_prefill = 1
[fake]
c0 = 0.002
c1 = 1e-6
d0 = 0.01
d1 = 0.0001
d2 = 1e-6
"""


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


class Tier(NamedTuple):
    base: str
    """nginx's URL."""
    partitions: dict[str, str]
    """name -> its own URL."""
    procs: dict[str, subprocess.Popen]
    upstream: dict[str, str]
    """``host:port`` (nginx's ``X-Evinfra-Upstream``) -> partition name."""
    conf: Path
    """The ``nginx.conf`` that ``evinfra partitions nginx`` wrote."""
    front: int
    """nginx's port."""


def _wait(url: str, proc: subprocess.Popen, log: Path, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} did not become ready: {log.read_text()[-3000:]}")


def _start_nginx(nginx: str, prefix: Path, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([nginx, "-p", str(prefix), "-c", "nginx.conf", "-e", "stderr",
                                 "-g", "daemon off;"], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def tier(tmp_path_factory) -> Iterator[Tier]:
    nginx = nginx_binary()
    if nginx is None:
        msg = "no nginx (run scripts/install-nginx.sh)"
        if os.environ.get("EVINFRA_NGINX_REQUIRED") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    d = tmp_path_factory.mktemp("partitions")
    procs: dict[str, subprocess.Popen] = {}
    partitions, lines = {}, []
    try:
        for name in ("p0", "p1", "p2"):
            port = free_port()
            cfg, log = d / f"{name}.toml", d / f"{name}.log"
            cfg.write_text(PARTITION.format(port=port))
            with open(log, "wb") as out:
                procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "evinfra.cli", "serve", "--config", str(cfg),
                     "--log-format", "json"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True)
            partitions[name] = f"http://127.0.0.1:{port}"
            lines += ["[[partitions]]", f'name = "{name}"', f"port = {port}",
                      f'config = "{cfg}"', ""]
        front = free_port()
        (d / "partitions.toml").write_text(
            f"[nginx]\nport = {front}\nworker_processes = 1\nconnect_timeout_s = 1.0\n\n"
            + "\n".join(lines))
        prefix = d / "nginx"
        prefix.mkdir()
        out = subprocess.run([sys.executable, "-m", "evinfra.cli", "partitions", "nginx",
                              "--config", str(d / "partitions.toml"), "--out",
                              str(prefix / "nginx.conf")], cwd=ROOT, capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stderr
        log = d / "nginx.log"
        procs["nginx"] = _start_nginx(nginx, prefix, log)
        for name, url in partitions.items():
            _wait(url + "/ready", procs[name], d / f"{name}.log", f"partition {name}")
        base = f"http://127.0.0.1:{front}"
        _wait(base + "/health", procs["nginx"], log, "nginx")
        upstream = {u.removeprefix("http://"): n for n, u in partitions.items()}
        yield Tier(base, partitions, procs, upstream, prefix / "nginx.conf", front)
    finally:
        for p in procs.values():
            _stop(p)


@pytest.fixture(scope="module")
def client(tier) -> openai.OpenAI:
    return openai.OpenAI(base_url=tier.base + "/v1", api_key="unused", max_retries=0)


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/evinfra/status", timeout=5) as r:
        return json.loads(r.read())


def ask(client, tier, agent: str, messages: list, **headers):
    """One chat turn of ``agent`` through nginx: (answer, the partition that served it)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=6,
        extra_headers={"X-Evinfra-Agent": agent, **headers} if agent else headers)
    return raw.parse(), tier.upstream[raw.headers["X-Evinfra-Upstream"].split(", ")[-1]]


SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 30}


def test_an_agent_and_its_sub_agent_land_in_one_partition(tier, client):
    history = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    first, where = ask(client, tier, "agent-a", history, **{"X-Evinfra-Branch-Id": "a-main"})
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Now run it again."}]
    second, where2 = ask(client, tier, "agent-a", history, **{"X-Evinfra-Branch-Id": "a-main"})
    # The sub-agent: its own branch, spawned from the main one, the same system prompt.
    sub, where3 = ask(client, tier, "agent-a", [SYSTEM, {"role": "user", "content": "Search."}],
                      **{"X-Evinfra-Branch-Id": "a-sub", "X-Evinfra-Parent-Branch-Id": "a-main"})
    assert where == where2 == where3
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]
    assert cached[0] < cached[1] and cached[1] > 0  # the second turn reused the first's KV
    assert sub.usage.prompt_tokens_details.cached_tokens > 0  # the sub-agent reused it too
    holders = [n for n, url in tier.partitions.items() if "agent-a" in status(url)["agents"]["agents"]]
    assert holders == [where]
    assert status(tier.partitions[where])["agents"]["agents"]["agent-a"]["requests"] == 3


def test_dynamo_session_headers_bind_a_sub_agent_to_its_parent(tier, client):
    """Without ``X-Evinfra-Agent``: Dynamo's session headers, the sub-agent by its parent."""
    spots = set()
    for i in range(6):  # several roots, so that landing together is not luck
        root = f"dyn-run-{i}"
        _, a = ask(client, tier, "", [SYSTEM, {"role": "user", "content": "Plan."}],
                   **{"X-Dynamo-Session-ID": root})
        _, b = ask(client, tier, "", [SYSTEM, {"role": "user", "content": "Research."}],
                   **{"X-Dynamo-Session-ID": f"{root}:researcher",
                      "X-Dynamo-Parent-Session-ID": root})
        assert a == b
        assert root in status(tier.partitions[a])["agents"]["agents"]
        spots.add(a)
    assert len(spots) > 1


def _stream_times(base: str) -> list[float]:
    """Arrival times of a 60-token streamed completion's chunks, through ``base``."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    t0 = time.monotonic()
    times = []
    stream = client.completions.create(model=MODEL, prompt="Tell a long story.", max_tokens=60,
                                       stream=True, extra_body={"ignore_eos": True},
                                       extra_headers={"X-Evinfra-Agent": "streamer"})
    text = ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic() - t0)
            text += chunk.choices[0].text
    assert len(text) == 60
    return times


def _chunk_by_chunk(times: list[float]) -> bool:
    """60 decode iterations of >= 10 ms: buffered to the end, every chunk comes at once."""
    return times[-1] - times[0] > 0.3 and len({round(t, 2) for t in times}) > 10


def test_a_stream_arrives_through_nginx_chunk_by_chunk(tier):
    times = _stream_times(tier.base)
    assert _chunk_by_chunk(times), times


def test_control_an_nginx_that_buffers_the_stream_fails_that_check(tier, tmp_path):
    """The control of the test above: the same config with buffering on and the event stream
    gzipped (the compressor holds the answer until it ends) delivers every chunk at once."""
    conf = tier.conf.read_text()
    buffering = conf.replace(
        "proxy_buffering off;", "proxy_buffering on; gzip on; gzip_types text/event-stream; "
        "gzip_proxied any; gzip_min_length 1;")
    port = free_port()
    buffering = buffering.replace(f":{tier.front};", f":{port};")
    assert buffering.count(f":{port};") == 1 and "gzip on;" in buffering
    (tmp_path / "nginx.conf").write_text(buffering)
    proc = _start_nginx(nginx_binary(), tmp_path, tmp_path / "nginx.log")
    try:
        base = f"http://127.0.0.1:{port}"
        _wait(base + "/health", proc, tmp_path / "nginx.log", "the buffering nginx")
        times = _stream_times(base)
    finally:
        _stop(proc)
    assert not _chunk_by_chunk(times), times


def test_agents_spread_and_each_partition_shows_only_its_own(tier, client):
    where = {}
    for i in range(24):
        _, where[f"spread-{i}"] = ask(client, tier, f"spread-{i}",
                                      [{"role": "user", "content": f"task {i}"}])
    assert set(where.values()) == set(tier.partitions)  # every partition got some
    seen = {n: {a for a in status(url)["agents"]["agents"] if a.startswith("spread-")}
            for n, url in tier.partitions.items()}
    for name, agents in seen.items():
        assert agents == {a for a, n in where.items() if n == name}


def test_a_partition_down_moves_only_its_agents_which_are_then_served(tier, client):
    agents = [f"spread-{i}" for i in range(24)]
    before = {a: ask(client, tier, a, [{"role": "user", "content": "again"}])[1] for a in agents}
    victim = max(set(before.values()), key=lambda n: sum(v == n for v in before.values()))
    _stop(tier.procs[victim])
    after = {}
    for a in agents:
        answer, after[a] = ask(client, tier, a, [{"role": "user", "content": "after the loss"}])
        assert answer.choices[0].message.content is not None
    moved = {a for a in agents if after[a] != before[a]}
    assert moved == {a for a in agents if before[a] == victim}
    assert victim not in after.values()
    for a in moved:
        assert a in status(tier.partitions[after[a]])["agents"]["agents"]
    # Where they went, they stay (the ring's next partition, not a random one per request).
    again = {a: ask(client, tier, a, [{"role": "user", "content": "once more"}])[1] for a in moved}
    assert again == {a: after[a] for a in moved}
