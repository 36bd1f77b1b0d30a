"""``evinfra serve`` as a real process on loopback, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def client(fake_serve):
    base = fake_serve.base
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_chat_and_completions_streaming_and_not(client):
    chat = client.chat.completions.create(
        model="evinfra-fake", messages=[{"role": "user", "content": "Say hello."}], max_tokens=12)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 12 and chat.usage.prompt_tokens > 0
    parts = list(client.chat.completions.create(
        model="evinfra-fake", messages=[{"role": "user", "content": "Count."}], max_tokens=9,
        stream=True, stream_options={"include_usage": True}))
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == len(
        "".join(p.choices[0].delta.content or "" for p in parts if p.choices))
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] in ("stop", "length")
    comp = client.completions.create(model="evinfra-fake", prompt=list(range(40, 140)),
                                     max_tokens=7, extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 7 and comp.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="evinfra-fake", prompt="Once upon a time", max_tokens=6, stream=True,
        extra_body={"ignore_eos": True}))
    assert len(text) == 6


def test_second_request_of_a_branch_reuses_its_prefix(client):
    headers = {"X-Evinfra-Branch-Id": "agent-1"}
    history = [{"role": "system", "content": "You are a careful agent. " * 40},
               {"role": "user", "content": "Step one."}]
    first = client.chat.completions.create(model="evinfra-fake", messages=history, max_tokens=8,
                                           extra_headers=headers)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "Step two."}]
    second = client.chat.completions.create(model="evinfra-fake", messages=history, max_tokens=8,
                                            extra_headers={**headers, "X-Evinfra-Branch-Final": "true"})
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_metrics_and_status_reflect_the_traffic(fake_serve, client):
    base = fake_serve.base
    # A prompt of more than one page (64 byte tokens): its KV is blocks in the directory.
    client.completions.create(model="evinfra-fake", prompt="metrics please " * 10, max_tokens=3)
    metrics = get(base + "/metrics")[1]
    ok = [line for line in metrics.splitlines() if line.startswith('evinfra_requests_total{status="ok"}')]
    assert ok and float(ok[0].split()[-1]) >= 1
    assert "evinfra_directory_blocks" in metrics and "evinfra_node_phase" in metrics
    status = json.loads(get(base + "/v1/evinfra/status")[1])
    assert status["counters"]["ok"] >= 1
    assert status["directory"]["blocks"] > 0
    assert set(status["nodes"]) == {"n0", "n1", "n2"}


def test_forced_split_over_http(fake_serve, client):
    base = fake_serve.base
    code, out = post(base + "/v1/evinfra/split", {"prefill": ["n1"]})
    assert code == 200 and out["split"] == "1P2D"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        split = json.loads(get(base + "/v1/evinfra/status")[1])["split"]
        if split["prefill"] == ["n1"] and not split["switching"] and not split["collocated"]:
            break
        time.sleep(0.05)
    assert split["prefill"] == ["n1"] and split["decode"] == ["n0", "n2"]
    out = client.completions.create(model="evinfra-fake", prompt="after the switch", max_tokens=4)
    assert out.usage.completion_tokens >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_is_aborted_quietly(fake_serve, stream):
    """A client that goes away mid-stream, or before its whole answer, is an everyday event:
    its request is aborted on the engines (not computed for no one), and the server logs no
    traceback for it (checked at shutdown, below)."""
    base = fake_serve.base
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"model": "evinfra-fake", "prompt": "tell me a long story",
                       "max_tokens": 2000, "ignore_eos": True, "stream": stream}).encode()
    before = json.loads(get(base + "/v1/evinfra/status")[1])["counters"]["aborted"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        if stream:  # streaming has begun (the headers may come alone, before the first event)
            got = part = b"."
            while b"data: " not in got and part:
                part = sock.recv(4096)
                got += part
            assert b"data: " in got
        else:  # the request is running
            deadline = time.monotonic() + 10
            while not json.loads(get(base + "/v1/evinfra/status")[1])["in_flight"]:
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.02)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = json.loads(get(base + "/v1/evinfra/status")[1])
        if status["counters"]["aborted"] > before and status["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert status["counters"]["aborted"] == before + 1 and status["in_flight"] == 0


def test_sigterm_shuts_down_cleanly_within_the_grace(fake_serve, client):
    proc = fake_serve.proc
    os.kill(proc.pid, signal.SIGTERM)
    t0 = time.monotonic()
    proc.wait(timeout=15)
    out = fake_serve.log.read_text()
    assert proc.returncode == 0, out[-2000:]
    assert time.monotonic() - t0 < 10
    assert '"stopped"' in out
    assert "Traceback" not in out, out[-3000:]
