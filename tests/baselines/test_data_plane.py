"""The fake engine's data-plane options the baselines use: a peer fetch when the prefill
starts adds its time to that iteration (D.6, Fig. 3c "+ memory pool"); private host memory
ignores fetch plans (A.2)."""

import numpy as np

from evinfra.core.bus import Bus
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import FetchRun, PrefillOrder, Sampling
from evinfra.core.events import IterationReport, PrefillDone
from evinfra.core.hashing import block_hashes
from evinfra.core.types import Phase
from evinfra.drivers.fake import FakeCluster, FakeEngineConfig

PAGE = 64


def run(mode: str) -> tuple[list[IterationReport], PrefillDone]:
    clock, bus, seen = VirtualClock(), Bus(), []
    bus.subscribe(IterationReport, seen.append)
    bus.subscribe(PrefillDone, seen.append)
    cluster = FakeCluster([("p0", Phase.PREFILL), ("p1", Phase.PREFILL)],
                          FakeEngineConfig(peer_fetch=mode), clock, bus)
    cluster.start()
    toks = np.random.default_rng(0).integers(0, 50_000, 33_000).astype(np.uint32)
    path = block_hashes(toks, PAGE)
    s = Sampling(max_tokens=1)
    cluster.engines["p1"].submit_prefill(PrefillOrder("warm", toks[:32_000], path[:500], [], s))
    clock.run(until=10.0)
    seen.clear()
    fetch = [FetchRun("p1", 0, path[:500])]
    cluster.engines["p0"].submit_prefill(PrefillOrder("q", toks, path, fetch, s))
    clock.run(until=20.0)
    reports = [e for e in seen if isinstance(e, IterationReport) and e.node == "p0"]
    done = next(e for e in seen if isinstance(e, PrefillDone))
    return reports, done


def test_the_fetch_is_hidden_while_queued_and_added_at_prefill_start() -> None:
    cfg = FakeEngineConfig()
    fetch_s = cfg.fetch_latency + 500 * PAGE * cfg.fetch_s_per_token
    queued, dq = run("queued")
    start, ds = run("prefill_start")
    assert dq.cached == ds.cached == 32_000 and dq.fetched == ds.fetched == 32_000
    # The same iteration, longer by the whole fetch when it waits for the first chunk.
    assert abs(start[0].duration - queued[0].duration - fetch_s) < 1e-9
    assert queued[0].start >= 10.0 + fetch_s - 1e-9  # while queued, it ran before the prefill
    assert abs(start[0].start - 10.0) < 1e-9  # no wait: the load is paid inside the iteration


def test_private_host_memory_ignores_the_fetch_plan() -> None:
    _, done = run("none")
    assert done.cached == 0 and done.fetched == 0 and done.computed == 33_000
