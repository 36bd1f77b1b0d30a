"""The fake engine's data-plane options the baselines use: a peer fetch when the prefill
starts adds its time and the load-back to that iteration (D.6, Fig. 3c "+ memory pool");
private host memory ignores fetch plans (A.2); the prefill nodes' idle time (Table D.5)."""

import numpy as np
import pytest

from evinfra.core.bus import Bus
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import FetchRun, PrefillOrder, Sampling
from evinfra.core.events import IterationReport, PrefillDone
from evinfra.core.hashing import block_hashes
from evinfra.core.types import Phase
from evinfra.drivers.fake import FakeCluster, FakeEngineConfig, prefill_idle

PAGE = 64


def run(mode: str, **config) -> tuple[list[IterationReport], PrefillDone]:
    reports, done, _ = play(mode, **config)
    return reports, done


def play(mode: str, **config) -> tuple[list[IterationReport], PrefillDone, FakeCluster]:
    """p1 computes a 32,000-token prompt from t = 0; at t = 10, after idling, p0 gets a
    33,000-token prompt with a plan to fetch p1's 500 blocks."""
    clock, bus, seen = VirtualClock(), Bus(), []
    bus.subscribe(IterationReport, seen.append)
    bus.subscribe(PrefillDone, seen.append)
    cluster = FakeCluster([("p0", Phase.PREFILL), ("p1", Phase.PREFILL)],
                          FakeEngineConfig(peer_fetch=mode, **config), clock, bus)
    cluster.record_prefill()
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
    return reports, done, cluster


def test_the_fetch_is_hidden_while_queued_and_added_at_prefill_start() -> None:
    cfg = FakeEngineConfig()
    fetch_s = cfg.fetch_latency + 500 * PAGE * cfg.fetch_s_per_token
    queued, dq = run("queued")
    start, ds = run("prefill_start")
    assert dq.cached == ds.cached == 32_000 and dq.fetched == ds.fetched == 32_000
    # The same iteration, longer by the whole fetch and the load-back (D.6: upstream SGLang
    # loads the KV into GPU memory and broadcasts it before the forward) at the first chunk.
    assert cfg.load_back_s == 0.3
    assert abs(start[0].duration - queued[0].duration - fetch_s - 0.3) < 1e-9
    assert queued[0].start >= 10.0 + fetch_s - 1e-9  # while queued, it ran before the prefill
    assert abs(start[0].start - 10.0) < 1e-9  # no wait: the load is paid inside the iteration
    assert len(start) == len(queued) == 1  # 1,000 uncached tokens: one chunk
    no_load, _ = run("prefill_start", load_back_s=0.0)
    assert abs(no_load[0].duration - queued[0].duration - fetch_s) < 1e-9
    assert run("queued", load_back_s=5.0)[0] == queued  # the queued fetch never pays it


def test_idle_time_counts_waits_with_requests_to_serve_and_load_back_waits() -> None:
    """Table D.5's idle GPU time: p0 idled for 10 s with nothing to serve (not idle time),
    then waited for the fetch with its one request queued (queued) or for the load-back
    inside its first iteration (prefill_start)."""
    cfg = FakeEngineConfig()
    fetch_s = cfg.fetch_latency + 500 * PAGE * cfg.fetch_s_per_token
    reports, _, cluster = play("queued")
    log = cluster.engines["p0"].prefill_log
    assert [(i.start, i.duration) for i in log] == [(r.start, r.duration) for r in reports]
    assert len(log) == 1 and log[0].load == 0.0
    assert abs(log[0].waited - fetch_s) < 1e-9  # not the 10 s before, with nothing queued
    idle = prefill_idle([log], 0.0, 20.0)
    assert idle.iterations == 1 and idle.loading_iterations == 0 and idle.mean_load == 0.0
    assert idle.idle_share == pytest.approx(fetch_s / (fetch_s + log[0].duration), rel=1e-5)
    assert idle.waited_share == 1.0  # the fetch took more than 10 ms

    reports, _, cluster = play("prefill_start")
    log = cluster.engines["p0"].prefill_log
    assert log[0].waited == 0.0 and abs(log[0].load - fetch_s - 0.3) < 1e-9
    idle = prefill_idle([log], 0.0, 20.0)
    assert idle.loading_iterations == 1 and idle.mean_load == pytest.approx(fetch_s + 0.3)
    assert idle.idle_share == pytest.approx(log[0].load / log[0].duration, rel=1e-5)
    assert idle.load_share == idle.idle_share and idle.waited_share == 1.0
    # p1's own prompt, computed from t = 0 with nothing to fetch: no idle time.
    own = prefill_idle([cluster.engines["p1"].prefill_log], 0.0, 20.0)
    assert own.iterations == 4 and own.idle_share == 0.0 and own.waited_share == 0.0
    # The window: iterations that started in it.
    assert prefill_idle([log], 10.0 + 1e-6, 20.0).iterations == 0


def test_private_host_memory_ignores_the_fetch_plan() -> None:
    _, done = run("none")
    assert done.cached == 0 and done.fetched == 0 and done.computed == 33_000


def test_an_engine_with_nothing_to_serve_is_not_idle_in_table_d5s_sense() -> None:
    """Two prompts 5 s apart on one prefill node, each ready on arrival: no idle time (a
    control for the queued fetch above, where the same node waits with a request)."""
    clock, bus = VirtualClock(), Bus()
    cluster = FakeCluster([("p0", Phase.PREFILL)], FakeEngineConfig(), clock, bus)
    cluster.record_prefill()
    cluster.start()
    rng, s = np.random.default_rng(1), Sampling(max_tokens=1)
    for i, at in enumerate((0.0, 5.0)):
        toks = rng.integers(0, 50_000, 2_000).astype(np.uint32)
        clock.run(until=at)
        cluster.engines["p0"].submit_prefill(
            PrefillOrder(f"r{i}", toks, block_hashes(toks, PAGE), [], s))
    clock.run(until=10.0)
    log = cluster.engines["p0"].prefill_log
    assert [i.start for i in log] == [0.0, 5.0] and all(i.waited == 0.0 for i in log)
    assert prefill_idle([log], 0.0, 10.0).idle_share == 0.0


@pytest.mark.parametrize("backed", [False, True])
def test_upstream_loads_back_the_nodes_own_host_copies_too(backed) -> None:
    """D.6: a prefill node that reads KV from host memory loads it back into GPU memory;
    upstream SGLang (``prefill_start``) waits ``load_back_s`` for its own host copies as for
    fetched ones; the queued data plane pays only Eq. 1's restore cost c3. The same when the
    router's plan backs the node's own prefix with a peer that has none of it (``backed``):
    the copies come from the node's own host memory all the same."""
    def first_chunk_of_the_return(mode: str) -> tuple[float, int]:
        clock, bus = VirtualClock(), Bus()
        cfg = FakeEngineConfig(peer_fetch=mode, l1_tokens=40_000)
        cluster = FakeCluster([("p0", Phase.PREFILL), ("p1", Phase.PREFILL)], cfg, clock, bus)
        cluster.record_prefill()
        cluster.start()
        rng, s = np.random.default_rng(2), Sampling(max_tokens=1)
        a, b = (rng.integers(0, 50_000, 32_000).astype(np.uint32) for _ in range(2))
        a2 = np.concatenate([a, rng.integers(0, 50_000, 1_000).astype(np.uint32)])
        engine = cluster.engines["p0"]
        for i, (toks, at) in enumerate(((a, 0.0), (b, 10.0), (a2, 20.0))):
            clock.run(until=at)  # b evicts a from GPU memory; a2 finds it in host memory
            if i:
                engine.release_source(f"r{i - 1}")  # no decode side: hand the KV back
            path = block_hashes(toks, PAGE)
            fetch = [FetchRun("p1", 0, path[:500])] if backed and i == 2 else []
            engine.submit_prefill(PrefillOrder(f"r{i}", toks, path, fetch, s))
        clock.run(until=30.0)
        last = engine.prefill_log[-1]
        return last.load, len(engine.prefill_log)

    assert first_chunk_of_the_return("queued") == (0.0, 9)
    load, n = first_chunk_of_the_return("prefill_start")
    assert n == 9 and load == 0.3  # no transfer: the load-back alone


def test_a_serving_engine_keeps_no_prefill_log() -> None:
    """The log grows by one entry per prefill iteration: only runs that ask for it
    (``record_prefill``, as the experiments do) keep one; ``evinfra serve`` does not."""
    clock, bus = VirtualClock(), Bus()
    cluster = FakeCluster([("p0", Phase.PREFILL)], FakeEngineConfig(), clock, bus)
    cluster.start()
    toks = np.random.default_rng(3).integers(0, 50_000, 2_000).astype(np.uint32)
    cluster.engines["p0"].submit_prefill(
        PrefillOrder("r", toks, block_hashes(toks, PAGE), [], Sampling(max_tokens=1)))
    clock.run(until=5.0)
    assert cluster.engines["p0"].prefill_log is None
    cluster.record_prefill()
    cluster.engines["p0"].submit_prefill(
        PrefillOrder("r2", toks[::-1].copy(), block_hashes(toks[::-1].copy(), PAGE), [],
                     Sampling(max_tokens=1)))
    clock.run(until=10.0)
    assert len(cluster.engines["p0"].prefill_log) >= 1
