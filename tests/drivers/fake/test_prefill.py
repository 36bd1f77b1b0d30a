"""Chunked prefill, FCFS packing, prefix reuse, host restores and peer fetches."""

import pytest
from fake_harness import PAGE, TEST_TIMING, Harness, path, tokens

from evinfra.core.contracts import FetchRun
from evinfra.core.events import (IterationReport, NodeKVEvents, PrefillDone, PrefillStarted,
                                 RequestFailed, Withdrawn)
from evinfra.core.types import Phase
from evinfra.drivers.fake import FakeEngineConfig

CFG = FakeEngineConfig(**TEST_TIMING)
THREE = [("p0", Phase.PREFILL), ("p1", Phase.PREFILL), ("d0", Phase.DECODE)]


def chunks(h: Harness, node: str = "p0") -> list[list[tuple[str, int, int, int]]]:
    return [[(i.request, i.t_uc, i.t_c, i.t_rst) for i in r.prefill]
            for r in h.of(IterationReport, node=node) if r.prefill]


def test_chunked_prefill_packs_queued_requests_fcfs_within_the_budget() -> None:
    h = Harness()
    h.submit("blocker", tokens(8192, seed=9))
    for i, n in enumerate((5000, 6000, 3000)):
        h.submit(f"r{i}", tokens(n, seed=i))
    h.run(5)
    assert chunks(h) == [
        [("blocker", 8192, 0, 0)],
        [("r0", 5000, 0, 0), ("r1", 3192, 0, 0)],
        [("r1", 2808, 3192, 0), ("r2", 3000, 0, 0)],
    ]
    started = {e.request: e.time for e in h.of(PrefillStarted)}
    reports = [r for r in h.of(IterationReport, node="p0") if r.prefill]
    assert started["r1"] == started["r0"] == reports[1].start and started["r2"] == reports[2].start
    assert h.one(PrefillDone, request="r1").time == pytest.approx(reports[2].start
                                                                  + reports[2].duration)
    h.check()


def test_prefix_reuse_and_at_least_one_computed_token() -> None:
    h = Harness()
    a = tokens(6400)  # exactly 100 pages
    h.submit("a", a)
    h.run(2)
    h.submit("a2", a)
    h.submit("b", tokens(7000, seed=1, base=a[:5000]))
    h.run(4)
    done = {e.request: e for e in h.of(PrefillDone)}
    assert (done["a2"].cached, done["a2"].computed) == (6400 - PAGE, PAGE)
    assert (done["b"].cached, done["b"].computed) == (4992, 7000 - 4992)
    assert [("a2", PAGE, 6400 - PAGE, 0)] in chunks(h)


def test_the_prompts_logprobs_take_its_whole_computation() -> None:
    """SGLang reuses no cached prefix when the prompt's log-probabilities are asked: the
    fake engine computes the whole prompt too, and reports each token's but the first."""
    h = Harness()
    a = tokens(640)
    h.submit("a", a)
    h.run(2)
    h.submit("again", a, logprobs=1, prompt_logprobs=True)
    h.run(4)
    done = h.one(PrefillDone, request="again")
    assert (done.cached, done.computed) == (0, 640)
    assert len(done.prompt_logprobs.sampled) == 639
    assert all(len(top) == 1 for top in done.prompt_logprobs.top)
    assert h.one(PrefillDone, request="a").prompt_logprobs is None
    h.check()

def test_host_copies_are_restored_and_counted_in_t_rst() -> None:
    h = Harness(l1_tokens=20_000)
    a = tokens(15_000)
    h.submit("a", a)
    h.run(2)
    h.submit("b", tokens(15_000, seed=1))  # pushes a out of p0's GPU memory
    h.run(4)
    c = h.engines["p0"].cache
    in_gpu = c.l1_prefix(path(a))
    assert 0 < in_gpu < 234 == c.l2_prefix(path(a))  # b evicted a's leaf end only
    h.submit("a2", tokens(17_000, seed=2, base=a))
    h.run(6)
    done = h.one(PrefillDone, request="a2")
    assert done.cached == 234 * PAGE and done.fetched == 0
    first = [c for c in chunks(h) if c[0][0] == "a2"][0][0]
    assert first == ("a2", 17_000 - 234 * PAGE, 234 * PAGE, (234 - in_gpu) * PAGE)
    h.check()


def test_a_prompt_larger_than_gpu_memory_fails_before_starting() -> None:
    h = Harness(l1_tokens=10_000)
    h.submit("big", tokens(12_000))
    h.submit("ok", tokens(2_000, seed=1))
    h.run(2)
    fail = h.one(RequestFailed, request="big")
    assert not fail.started and h.output("ok")[1] == "length"


# -- peer fetches (paper 4.2, D.6) ---------------------------------------------------------


def _seed_peer(h: Harness, n: int, seed: int = 42, node: str = "p1") -> list[int]:
    """Prefill ``n`` tokens on ``node`` so its host memory holds them; return the tokens."""
    t = tokens(n, seed=seed)
    h.submit(f"seed-{node}-{seed}", t, prefill=node)
    h.run(h.clock.now() + 5)
    return t


def _fetch_behind_a_long_prefill(h: Harness, long: int, prompt: int
                                 ) -> tuple[float, list[int], int]:
    """p1 holds a 20,000-token prefix; p0 gets a ``long`` prefill, then r: ``prompt`` tokens
    on that prefix, with a fetch plan for it from p1. Returns the time before both were
    submitted, r's tokens and the fetched blocks."""
    base = _seed_peer(h, 20_000)
    t0 = h.clock.now()
    h.submit("long", tokens(long, seed=3))
    t = tokens(prompt, base=base)
    k = 20_000 // PAGE
    h.submit("r", t, fetch=[FetchRun("p1", 0, path(t)[:k])])
    return t0, t, k


def fetch_time(blocks: int) -> float:
    return CFG.fetch_latency + blocks * PAGE * CFG.fetch_s_per_token


def test_fetch_is_exposed_when_the_queue_is_empty() -> None:
    h = Harness(THREE)
    base = _seed_peer(h, 50_000)
    t0 = h.clock.now()
    t = tokens(52_000, base=base)
    k = 50_000 // PAGE
    h.submit("r", t, fetch=[FetchRun("p1", 0, path(t)[:k])])
    h.run(t0 + 5)
    assert h.one(PrefillStarted, request="r").time == pytest.approx(t0 + fetch_time(k))
    done = h.one(PrefillDone, request="r")
    assert (done.cached, done.fetched, done.computed) == (k * PAGE, k * PAGE, 52_000 - k * PAGE)
    assert chunks(h)[0][0] == ("r", 52_000 - k * PAGE, k * PAGE, k * PAGE)
    stored = [e for b in h.of(NodeKVEvents, node="p0") for e in b.batch.events][:2]
    assert {e.medium for e in stored} == {"GPU", "CPU_PINNED"}  # fetched KV lands in L2 and L1
    assert stored[0].block_hashes == path(t)[:k]
    h.check()


def test_fetch_is_hidden_while_the_request_waits() -> None:
    h = Harness(THREE)
    t0, t, k = _fetch_behind_a_long_prefill(h, 60_000, 24_000)
    h.submit("later", tokens(3_000, seed=4))
    h.run(t0 + 10)
    fetch_end = t0 + fetch_time(k)
    start = h.one(PrefillStarted, request="r").time
    assert fetch_end <= start and start > t0 + 0.5  # it waited for the queue, not the fetch
    # FCFS: r arrived before "later" and is ready by the time the long prefill ends
    assert start <= h.one(PrefillStarted, request="later").time
    assert h.one(PrefillDone, request="r").fetched == k * PAGE


def test_a_request_still_fetching_does_not_block_the_queue() -> None:
    h = Harness(THREE)
    base = _seed_peer(h, 50_000)
    t0 = h.clock.now()
    t = tokens(51_000, base=base)
    h.submit("fetching", t, fetch=[FetchRun("p1", 0, path(t)[:781])])
    h.submit("plain", tokens(2_000, seed=5))
    h.run(t0 + 5)
    assert h.one(PrefillStarted, request="plain").time == t0
    assert h.one(PrefillStarted, request="fetching").time >= t0 + fetch_time(781)


def test_blocks_the_peer_lost_are_recomputed() -> None:
    h = Harness(THREE)
    base = _seed_peer(h, 30_000)
    t = tokens(32_000, base=base)
    k = 30_000 // PAGE
    h.submit("r", t, fetch=[FetchRun("p1", 0, path(t)[:k])])
    h.engines["p1"].crash("gone")  # before the fetch lands
    h.run(h.clock.now() + 5)
    done = h.one(PrefillDone, request="r")
    assert (done.cached, done.fetched, done.computed) == (0, 0, 32_000)


def test_a_fetch_keeps_the_part_the_peer_still_holds() -> None:
    h = Harness(THREE)
    base = _seed_peer(h, 10_000)  # p1 holds 156 blocks
    t = tokens(30_000, base=base)
    h.submit("r", t, fetch=[FetchRun("p1", 0, path(t)[:300])])  # the plan claims 300
    h.run(h.clock.now() + 5)
    done = h.one(PrefillDone, request="r")
    assert done.fetched == done.cached == 156 * PAGE


def test_withdrawing_a_fetching_request_cancels_its_fetch() -> None:
    h = Harness(THREE)
    base = _seed_peer(h, 50_000)
    n = len(h.kv("p0"))
    t = tokens(51_000, base=base)
    h.submit("r", t, fetch=[FetchRun("p1", 0, path(t)[:781])])
    h.engines["p0"].withdraw("r")
    h.run(h.clock.now() + 5)
    assert h.one(Withdrawn).request == "r" and len(h.kv("p0")) == n
    assert not h.of(PrefillStarted, request="r")
    h.check()


def _landed(h: Harness, node: str, block: int) -> float:
    """When ``node`` stored ``block`` in L1 last."""
    return max(b.batch.ts for b in h.of(NodeKVEvents, node=node) for e in b.batch.events
               if e.medium == "GPU" and block in getattr(e, "block_hashes", ()))


@pytest.mark.parametrize("ahead, staggered", [(0.15, True), (1.0, False)])
def test_queued_fetches_start_within_the_fetch_ahead_share(ahead, staggered) -> None:
    """With 100K tokens of L1 and a 15 % share, one 12K-token fetch runs ahead of the
    queue at a time and the next starts when the request before it starts its prefill; with
    the whole of L1 (the control) all start at once. Every fetch lands whole."""
    h = Harness(THREE, l1_tokens=100_000, l2_tokens=400_000, fetch_ahead=ahead)
    ctx = [_seed_peer(h, 12_000, seed) for seed in (50, 51, 52)]
    t0 = h.clock.now()
    h.submit("long", tokens(60_000, seed=3))
    k = 12_000 // PAGE
    for i, c in enumerate(ctx):
        t = tokens(12_500, base=c)
        h.submit(f"r{i}", t, fetch=[FetchRun("p1", 0, path(t)[:k])])
    h.run(t0 + 30)
    landed = [_landed(h, "p0", path(c)[0]) for c in ctx]
    assert landed[0] == pytest.approx(t0 + fetch_time(k))
    for i in (1, 2):
        started = h.one(PrefillStarted, request=f"r{i - 1}").time
        assert (landed[i] >= started) is staggered, (landed, started)
    assert all(h.one(PrefillDone, request=f"r{i}").fetched == k * PAGE for i in range(3))
    h.check()


@pytest.mark.parametrize("backed", [True, False])
def test_own_blocks_evicted_while_queued_are_fetched_from_the_backing_peer(backed) -> None:
    """p0 and p1 both hold context C; r (C plus 500 tokens) queues on p0 behind a request
    whose fetch fills the fetch-ahead share and a long prefill whose pages evict C from
    p0's small cache. The plan's backing run names p1 for C: when r's turn to fetch comes
    p0 lacks C and pulls it. Without the run (the control) r recomputes C."""
    h = Harness(THREE, l1_tokens=60_000, l2_tokens=60_000, fetch_ahead=0.2)
    c = _seed_peer(h, 12_000, 60)
    _seed_peer(h, 12_000, 60, node="p0")
    d = _seed_peer(h, 12_000, 61)
    k = 12_000 // PAGE
    h.submit("long", tokens(50_000, seed=3))
    h.submit("mid", tokens(12_500, base=d), fetch=[FetchRun("p1", 0, path(d)[:k])])
    t = tokens(12_500, base=c)
    h.submit("r", t, fetch=[FetchRun("p1", 0, path(t)[:k])] if backed else [])
    h.run(h.clock.now() + 30)
    done = h.one(PrefillDone, request="r")
    assert (done.cached, done.fetched) == ((k * PAGE, k * PAGE) if backed else (0, 0)), done
    h.check()


def test_a_fetch_without_gpu_room_lands_in_host_memory() -> None:
    """p0's GPU memory is held by a long prefill when r's fetch lands: the part that finds no
    L1 room stays in p0's host memory (as the SGLang engine's fetch puts it there) and is
    loaded back when r is admitted, so r reuses all of it and each block is restored once.
    Before, the blocks without L1 room were dropped and recomputed."""
    h = Harness(THREE, l1_tokens=60_000, l2_tokens=400_000)
    t0, t, k = _fetch_behind_a_long_prefill(h, 55_000, 21_000)
    h.run(t0 + 0.5)
    c = h.engines["p0"].cache
    assert not h.of(PrefillStarted, request="r")  # landed while long still computes
    assert 0 < c.l1_prefix(path(t)) < k == c.l2_prefix(path(t))
    h.run(t0 + 30)
    done = h.one(PrefillDone, request="r")
    assert (done.cached, done.fetched, done.computed) == (k * PAGE, k * PAGE, 21_000 - k * PAGE)
    assert [c for c in chunks(h) if c[0][0] == "r"][0][0] == ("r", 21_000 - k * PAGE,
                                                              k * PAGE, k * PAGE)
    h.check()
