"""The engine patch across hosts: two patched SGLang engines in two network namespaces made
by the test (``sglang_cpu/netns.py``: each namespace has only its veth to a bridge and its
own loopback), both launched with ``--host 0.0.0.0`` as ``etc/sglang.toml`` recommends.

* Each engine advertises its pool at its own namespace's address, not at 127.0.0.1 (which
  the other engine would dial on its own loopback).
* A request goes through the pair (PD transfer over Mooncake TCP between the namespaces),
  then the prefill engine forgets it and pulls the prefix from the decode engine's host
  memory over Mooncake TCP across the namespaces: 48 fetched tokens, and the same greedy
  tokens and log-probabilities as computed locally (with the control: another prefix gives
  another output).

Skipped only when the test does not run as root (namespaces need it).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from conftest import _require_sglang
from context_model import write_context_model_dir
from engines import HICACHE_ARGS, PAGE_SIZE, Engine, running, sglang_python
from evinfra.core.hashing import block_hashes
from netns import missing, two_hosts
from pd_client import generate, http

pytestmark = pytest.mark.sglang

P = PAGE_SIZE
LP = 49  # log-probabilities from position 49 on: after the 12-page prefix (see below)
LOGPROB_TOL = 1e-3


class HostEngine(Engine):
    """An engine in namespace ``ns`` at ``ip``, bound to every address of its host."""

    def __init__(self, *args, ns: str, ip: str, **kw) -> None:
        self.ns, self.ip = ns, ip
        super().__init__(*args, **kw)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def command(self) -> list[str]:
        # nsenter, not `ip netns exec`: that also mounts a fresh /sys, where SGLang then finds
        # no memory cgroup to size its host tier by.
        return ["nsenter", f"--net=/run/netns/{self.ns}", *super().command(),
                "--host", "0.0.0.0"]


@pytest.fixture(scope="module")
def hosts():
    why = missing()
    if why is not None and os.geteuid() != 0:
        pytest.skip(why)
    assert why is None, why  # root without `ip`: the project's setup was not run
    with two_hosts(f"{os.getpid() % 100000}", subnet=40 + os.getpid() % 200) as h:
        yield h


@pytest.fixture(scope="module")
def pair(hosts, tmp_path_factory):
    _require_sglang()
    model = write_context_model_dir(tmp_path_factory.mktemp("context-llama"), sglang_python())
    logs = Path(os.environ.get("EVINFRA_SGLANG_LOGS") or tmp_path_factory.mktemp("netns-logs"))
    es = {n: HostEngine(f"ns-{n}", role, model, logs, patch=True,
                        extra_args=HICACHE_ARGS + ("--load-format", "safetensors"),
                        max_total_tokens=2048, ns=hosts[f"{n}_ns"], ip=hosts[f"{n}_ip"])
          for n, role in (("a", "prefill"), ("b", "decode"))}
    with running(es):
        yield es


def gen(a: HostEngine, b: HostEngine, ids: list[int], **kw) -> dict:
    return generate(a.url, b.url, a.bootstrap_port, ids, 8, bootstrap_host=a.ip,
                    logprob_start=LP, **kw)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def close(x: list, y: list) -> bool:
    pairs = [(u, v) for u, v in zip(x, y) if u is not None or v is not None]
    return len(x) == len(y) and len(pairs) >= len(x) - 1 and all(
        None not in (u, v) and abs(u - v) <= LOGPROB_TOL for u, v in pairs)


def test_each_engine_advertises_its_pool_at_an_address_its_peer_reaches(pair):
    for e in pair.values():
        pool = http("GET", e.url + "/server_info")[1]["evinfra_engine_patch"]["pool"]
        assert pool.rpartition(":")[0] == e.ip, (e.name, pool)


def test_a_prefill_pulls_a_prefix_from_a_peer_on_another_host(pair):
    from evinfra.engine_patch.wire import FetchPlan, FetchRunWire, fetch_kv_hints

    a, b = pair["a"], pair["b"]
    prompt = tokens(1, 48) + tokens(2, 9)
    base = gen(a, b, prompt)  # PD across the namespaces: a's KV reaches b over Mooncake TCP
    assert base["prefill"]["cached_tokens"] == 0
    other = gen(a, b, tokens(3, 48) + prompt[48:])  # the control: the prefix matters
    assert other["output_ids"] != base["output_ids"]
    assert not close(other["input_logprobs"], base["input_logprobs"])
    code, body = http("POST", a.url + "/flush_cache")
    assert code == 200, body
    peer = http("GET", b.url + "/server_info")[1]["evinfra_engine_patch"]["pool"]
    plan = FetchPlan(P, [FetchRunWire(peer, 0, block_hashes(prompt, P)[:12])])
    r = gen(a, b, prompt, kv_hints=fetch_kv_hints(plan, "t-netns"), decode_delay_s=0.5)
    assert r["prefill"]["cached_tokens_details"]["evinfra_fetched"] == 48
    assert r["output_ids"] == base["output_ids"]
    assert close(r["input_logprobs"], base["input_logprobs"])
    assert close(r["logprobs"], base["logprobs"])
    st = http("GET", a.url + "/evinfra/status")[1]
    rec = next(x for x in st["fetch"]["recent"] if x["rid"] == r["rid"])
    assert rec["outcome"] == "fetched" and rec["peers"] == [peer]
    print(f"\nfetch across namespaces from {peer}: "
          f"{rec['times']['fetch_end'] - rec['times']['fetch_start']:.4f} s for 12 pages")
