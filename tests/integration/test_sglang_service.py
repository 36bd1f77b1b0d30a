"""The service of ``evinfra serve`` with the SGLang driver, run in-process (``ServiceThread``) so
the tests can read its directory while the ``openai`` client talks HTTP to it:

* the directory holds the engines' real block hashes, equal to ``core/hashing.py``'s;
* the next request of a branch is routed with its cached prefix, and the engine reuses it;
* a forced split switches both engines' roles through ``/pd_role_switch``; the directory
  drops what the engines dropped, and traffic continues;
* killing an engine mid-request gives the client a clear error, marks the node down, and the
  service keeps answering (the last test: it leaves the pair broken).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import numpy as np
import pytest

from conftest import ServiceThread, sglang_config
from engines import PAGE_SIZE, SERVED_NAME
from evinfra.config import parse_config
from evinfra.core.hashing import block_hashes

pytestmark = pytest.mark.sglang


def _wait(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def svc(engines, model_dir):
    s = ServiceThread(parse_config(sglang_config(engines, model_dir))).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(svc):
    from openai import OpenAI

    return OpenAI(base_url=svc.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def orders(svc):
    """Every prefill order the service hands a driver: (node, predicted cached tokens)."""
    seen: list[tuple[str, int, str]] = []

    def spy(service):
        for d in service.drivers.values():
            def submit(order, _orig=d.submit_prefill, _node=d.node):
                seen.append((_node, order.cached_tokens, order.request))
                _orig(order)
            d.submit_prefill = submit

    svc.call(spy)
    return seen


def _held(svc, node: str, hashes: list[int]) -> list[int]:
    def look(s):
        idx = s.directory.index(node)
        return [h for h in hashes if s.directory.tree.holds(h, idx)]
    return svc.call(look)


def _roles(svc) -> dict:
    return svc.call(lambda s: {n: s.router.phase(n).value for n in s.nodes})


BRANCH = {"X-Evinfra-Branch-Id": "agent-1"}
PROMPT = [int(x) for x in np.random.default_rng(7).integers(3, 500, size=41)]  # 10 full pages


def test_directory_holds_the_engines_block_hashes(svc, client, orders):
    r = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=6,
                                  temperature=0, extra_headers=BRANCH,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    expected = block_hashes(PROMPT, PAGE_SIZE)
    assert len(expected) == 10
    # The prefill engine stored every full page of the prompt and published it over ZMQ; the
    # directory has exactly the hashes core/hashing.py computes for the same token ids.
    _wait(lambda: _held(svc, "a", expected) == expected, what="prompt pages on a")
    # The decode engine (radix cache on) keeps the prompt's pages too, for the next request.
    _wait(lambda: _held(svc, "b", expected) == expected, what="prompt pages on b")
    stats = svc.call(lambda s: s.directory.tree.stats)
    assert stats.blocks_stored >= 20 and stats.unknown_parent == 0
    assert orders[-1][0] == "a" and orders[-1][1] == 0


def test_next_request_of_the_branch_reuses_its_prefix(svc, client, orders):
    longer = PROMPT + [int(x) for x in np.random.default_rng(8).integers(3, 500, size=12)]
    r = client.completions.create(model=SERVED_NAME, prompt=longer, max_tokens=4,
                                  temperature=0, extra_headers=BRANCH,
                                  extra_body={"ignore_eos": True})
    node, predicted, _ = orders[-1]
    assert node == "a"
    assert predicted == 40, "the router saw the branch's 10 cached pages on a"
    # SGLang itself reused them: its meta_info.cached_tokens comes back as usage.
    assert r.usage.prompt_tokens_details.cached_tokens >= 40
    new = block_hashes(longer, PAGE_SIZE)
    _wait(lambda: _held(svc, "a", new) == new, what="the extended path on a")


def test_forced_split_switches_both_engines_and_traffic_continues(svc, client, engines):
    before = block_hashes(PROMPT, PAGE_SIZE)
    assert _held(svc, "a", before) == before
    status, body = _http("POST", svc.url + "/v1/evinfra/split", {"prefill": ["b"]})
    assert status == 200, body
    assert body["prefill"] == ["b"] and body["decode"] == ["a"]
    _wait(lambda: _roles(svc) == {"a": "decode", "b": "prefill"}, timeout=60,
          what="both nodes switched")
    for name, role in (("a", "decode"), ("b", "prefill")):
        with urllib.request.urlopen(engines[name].url + "/model_info", timeout=5) as r:
            assert json.loads(r.read())["disaggregation_mode"] == role
    # Stock SGLang drops its prefix cache on a switch (AllBlocksCleared): so does the directory.
    assert _held(svc, "a", before) == [] and _held(svc, "b", before) == []
    # (With every sampling option SGLang takes from us: the engines accept their names.)
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "After the switch."}],
        max_tokens=5, temperature=0.5, top_p=0.9, seed=4, frequency_penalty=0.5,
        presence_penalty=0.25, extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    assert r.choices[0].finish_reason in ("stop", "length")
    record = svc.call(lambda s: (s.counters.ok, s.counters.switches))
    assert record[0] >= 3 and record[1] >= 1


def test_killing_an_engine_mid_request_is_a_clear_error(svc, client, engines):
    """Runs last in this module: it kills the decode engine (``a`` after the switch)."""
    from openai import APIError

    assert _roles(svc)["a"] == "decode"
    errors: list[str] = []
    tokens: list[int] = []

    def long_stream():
        try:
            for chunk in client.completions.create(
                    model=SERVED_NAME, prompt=PROMPT, max_tokens=1500, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text:
                    tokens.append(1)
        except APIError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=long_stream)
    t.start()
    _wait(lambda: len(tokens) >= 5, timeout=30, what="the stream to start")
    engines["a"].kill()
    t.join(60)
    assert not t.is_alive()
    assert errors, "the client saw the stream fail"
    assert "engine a" in errors[0] or "a:" in errors[0], errors[0]
    # The node is down for the router, its KV gone from the directory; b is untouched.
    view = _wait(lambda: (lambda v: v if not v["a"]["healthy"] else None)(
        svc.call(lambda s: {n: s.router.node_view(n) for n in s.nodes})), what="a down")
    assert view["b"]["healthy"]
    assert svc.call(lambda s: s.drivers["a"].healthy()) is False
    assert svc.call(lambda s: s.drivers["b"].healthy()) is True
    # The service keeps answering: a new request gets a clear 503 (no decode node left in a
    # two-engine cluster), not a hang or a 500.
    status, body = _http("POST", svc.url + "/v1/completions",
                         {"model": SERVED_NAME, "prompt": "still there?", "max_tokens": 4})
    assert status == 503, body
    assert "decode" in body["error"]["message"]
    assert _http("GET", svc.url + "/health")[0] == 200
    assert _http("GET", svc.url + "/v1/models")[0] == 200
