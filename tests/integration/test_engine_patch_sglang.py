"""The evinfra engine patch on two real SGLang 0.5.23 engines on CPU (``evinfra/engine_patch``).

Engine ``a`` starts as prefill, ``b`` as decode; both run the patch with a HiCache host tier
(``HICACHE_ARGS``: 2048 device tokens, about 4100 host slots) and serve the context-sensitive
model of ``sglang_cpu/context_model.py`` (real weights at a realistic scale: the output depends
on the KV the engine attends to). Each equivalence test first checks that a prompt with another
prefix gives another output (``assert_context_matters``), then that local, fetched and kept KV
give the same greedy tokens, and log-probabilities within ``LOGPROB_TOL``; the tests ``..._
corrupted_...`` arm the patch's test-only corruption (``engine_patch/faults.py``: zeroed fetched
pages, a zeroed kept cache) and check that the same comparison then fails. The tests share the
pair and run in order:

* the engines advertise the patch;
* a prefill pulls a prefix from the decode engine's host memory while it waits in its queue
  (fetch end <= prefill start), and the output is the one computed from scratch;
* through the SGLang driver, the fetched and restored tokens reach ``PrefillDone`` and the
  iteration report (``t_rst``);
* with count hints, host eviction takes every zero-count block before a positive one;
* a switch drains by itself (switch time = drain time + a rebuild) and keeps the cache: after
  P->D->P the same prefix is reused and the output is unchanged;
* through ``evinfra serve``'s service: after a P->D->P round trip the directory still lists the
  engine's blocks (no ``AllBlocksCleared``) and a request reusing them reports cached tokens;
* a service started beside the engines, whose replay buffers (``KV_REPLAY_STEPS`` batches) no
  longer reach back to blocks they hold, asks them for a KV resync and lists those blocks.

At most these two engines run (the stock pair of the other modules starts after this module's
teardown).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import ServiceThread, _require_sglang, sglang_config
from context_model import write_context_model_dir
from engines import HICACHE_ARGS, PAGE_SIZE, SERVED_NAME, Engine, running, sglang_python
from evinfra.core.hashing import block_hashes
from pd_client import generate, http

pytestmark = pytest.mark.sglang

P = PAGE_SIZE
LP = 49
"""``logprob_start`` of the equivalence tests: log-probabilities of the prompt's tokens from
position 49 on, after its 48-token (12-page) prefix; SGLang then reuses at most 49 cached
tokens, i.e. the prefix's 12 pages."""
KV_REPLAY_STEPS = 8  # short, so that a driver started late cannot replay the engines' history
LOGPROB_TOL = 1e-3
"""Largest difference between the log-probabilities of an output token computed on local,
fetched or kept KV (float32; zeroed prefix KV moved them by 0.10 to 0.16, measured)."""
HOLD_S = 0.4
"""How long the switch test holds the decode engine's running request after the switch is
decided (the drain then lasts at least this long)."""
CORRUPT = "corrupt-kv"
"""The file named by ``EVINFRA_TEST_CORRUPT_KV`` in the engines' model directory."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The context-sensitive model (this module's ``model_dir``: the stock tests keep the
    dummy-weight one)."""
    _require_sglang()
    return write_context_model_dir(tmp_path_factory.mktemp("context-llama"), sglang_python())


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    _require_sglang()
    logs = Path(os.environ.get("EVINFRA_SGLANG_LOGS") or tmp_path_factory.mktemp("patch-logs"))
    env = {"EVINFRA_TEST_CORRUPT_KV": str(model_dir / CORRUPT)}
    es = {n: Engine(n, role, model_dir, logs, patch=True,
                    extra_args=HICACHE_ARGS + ("--load-format", "safetensors"), env=env,
                    max_total_tokens=2048, kv_replay_steps=KV_REPLAY_STEPS)
          for n, role in (("a", "prefill"), ("b", "decode"))}
    with running(es):
        yield es


@pytest.fixture(autouse=True)
def roles_restored(pair):
    """Each test starts with ``a`` prefill and ``b`` decode, whatever the one before left (a
    test that fails between its switches would otherwise fail the next ones too)."""
    yield
    for e, want in ((pair["a"], "prefill"), (pair["b"], "decode")):
        if role(e) != want:
            code, out, _ = switch(e, want)
            assert code == 200 and out["success"], out


def status(e: Engine) -> dict:
    code, body = http("GET", e.url + "/evinfra/status")
    assert code == 200, body
    return body


def gen(p: Engine, d: Engine, ids: list[int], n: int, **kw) -> dict:
    return generate(p.url, d.url, p.bootstrap_port, ids, n, **kw)


def flush(e: Engine) -> None:
    """Drop an idle engine's cache (SGLang's ``/flush_cache``; refused while it works)."""
    for _ in range(50):
        code, body = http("POST", e.url + "/flush_cache")
        if code == 200 and str(body).startswith("Cache flushed"):
            return
        time.sleep(0.1)
    raise AssertionError(f"could not flush {e.name}: {body}")


def switch(e: Engine, role: str) -> tuple[int, dict, float]:
    body = {"new_role": role}
    if role == "decode":
        body["decode_cuda_graph_memory_gb"] = 0
    t = time.monotonic()
    code, out = http("POST", e.url + "/pd_role_switch", body, timeout=120)
    return code, out, time.monotonic() - t


def role(e: Engine) -> str:
    return http("GET", e.url + "/model_info")[1]["disaggregation_mode"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def assert_context_matters(a: Engine, b: Engine, prompt: list[int], prefix_len: int,
                           base: dict) -> None:
    """The control of an equivalence: the same tail after another prefix gives another
    output, so equal outputs below do say the prefix's KV was right."""
    other = tokens(prompt[0] * 7919 + 1, prefix_len) + prompt[prefix_len:]
    if "input_logprobs" not in base:
        out = gen(a, b, other, len(base["output_ids"]))["output_ids"]
        assert out != base["output_ids"], "the model ignores its context: equality says nothing"
        return
    diffs = differences(gen(a, b, other, len(base["output_ids"]), logprob_start=LP), base)
    assert "tokens" in diffs and any(d.startswith("input_logprobs") for d in diffs), diffs


def differences(r: dict, base: dict) -> list[str]:
    """How ``r`` differs from ``base`` (both asked with ``logprob_start``): the greedy tokens,
    the prefill engine's log-probabilities of the prompt's tail (computed on the prefix's KV
    on that engine: local, fetched or kept), the decode engine's of the output."""
    out = []
    if r["output_ids"] != base["output_ids"]:
        out.append("tokens")
    for key in ("input_logprobs", "logprobs"):
        a, b = r[key], base[key]
        # (SGLang gives no log-probability for the first token it is asked about: None.)
        numbers = [(x, y) for x, y in zip(a, b) if x is not None or y is not None]
        assert len(a) == len(b) and len(numbers) >= len(a) - 1 >= 1, (key, a, b)
        diff = max(abs(x - y) if None not in (x, y) else float("inf") for x, y in numbers)
        if diff > LOGPROB_TOL:
            out.append(f"{key} (max diff {diff:.4f})")
    return out


def assert_same_output(r: dict, base: dict) -> None:
    assert differences(r, base) == []


class corrupted:
    """Arm the engines' test-only KV corruption (``fetch`` or ``switch``) for a block."""

    def __init__(self, model_dir: Path, what: str) -> None:
        self.path, self.what = model_dir / CORRUPT, what

    def __enter__(self):
        self.path.write_text(self.what)

    def __exit__(self, *exc):
        self.path.unlink()


def test_the_engines_advertise_the_patch(pair):
    for e in pair.values():
        info = http("GET", e.url + "/server_info")[1]
        patch = info["evinfra_engine_patch"]
        assert patch["switch_in_place"] and patch["host_tier"]
        assert patch["fetch_action"] == "evinfra.fetch/1" and patch["pool"].count(":") == 1
        assert info["evinfra_count_hints"] == "/evinfra/hints"
        st = status(e)
        assert st["disabled"] == {} and st["host_tier"]["slots"] >= 4096
        assert patch["kv_resync"] == "/evinfra/kv_resync"
        assert patch["iterations"] == "/evinfra/iterations"


def test_a_queued_prefill_pulls_its_prefix_from_a_peers_host_memory(pair):
    """Output equivalence (computed locally / fetched from a peer) and the fetch's timing."""
    a, b = pair["a"], pair["b"]
    prompt = tokens(1, 48) + tokens(2, 9)  # 12 full pages of prefix, then a tail
    base = gen(a, b, prompt, 8, logprob_start=LP)
    assert base["prefill"]["cached_tokens"] == 0  # computed from scratch
    assert_context_matters(a, b, prompt, 48, base)
    # Each engine logs its passes: a's prefill of the prompt, b's decode steps.
    passes = http("GET", a.url + "/evinfra/iterations?after=-1")[1]["records"]
    mine = [(rec, item) for rec in passes for item in rec.get("prefill", [])
            if item[0] == base["rid"]]
    assert sum(item[1] for _, item in mine) == len(prompt) and mine[0][1][2:] == [0, 0]
    assert all(rec["duration"] > 0 for rec, _ in mine)
    decoded = http("GET", b.url + "/evinfra/iterations?after=-1")[1]["records"]
    assert any(rec.get("batch", 0) >= 1 and rec["accepted"] >= 1 for rec in decoded)
    assert http("GET", a.url + "/evinfra/iterations?after=soon")[0] == 400
    local = gen(a, b, prompt, 8, logprob_start=LP)
    assert local["prefill"]["cached_tokens"] >= 48  # the prefix from a's own cache
    assert_same_output(local, base)
    # b decoded the prompt: its radix cache and (write-through) host tier hold it. a forgets.
    flush(a)
    peer = http("GET", b.url + "/server_info")[1]["evinfra_engine_patch"]["pool"]
    from evinfra.engine_patch.wire import FetchPlan, FetchRunWire, fetch_kv_hints

    plan = FetchPlan(P, [FetchRunWire(peer, 0, block_hashes(prompt, P)[:12])])
    # The decode half comes 0.5 s later: the prefill waits in a's bootstrap queue meanwhile.
    r = gen(a, b, prompt, 8, kv_hints=fetch_kv_hints(plan, "t-fetch"), decode_delay_s=0.5,
            logprob_start=LP)
    assert_same_output(r, base)
    details = r["prefill"]["cached_tokens_details"]
    assert details["evinfra_fetched"] == 48 and details["evinfra_restored"] >= 48
    assert r["prefill"]["cached_tokens"] >= 48
    rec = next(x for x in status(a)["fetch"]["recent"] if x["rid"] == r["rid"])
    t = rec["times"]
    assert rec["outcome"] == "fetched" and rec["peers"] == [peer]
    assert t["arrival"] <= t["fetch_start"] <= t["fetch_end"] <= t["load_end"] <= \
        t["prefill_start"]
    assert t["prefill_start"] - t["arrival"] > 0.3  # it was queued, the fetch ran meanwhile
    sb = status(b)
    pool = sb["pool"]
    assert pool["leases"] >= 1 and pool["open_leases"] == 0 and pool["released"] >= 1
    # The decode engine wrote its KV through to host memory, and never fetched.
    assert sb["host_tier"]["free"] < sb["host_tier"]["slots"] and sb["fetch"]["jobs"] == 0
    print(f"\nfetch of 12 pages: queued at {t['arrival']:.3f}, fetch "
          f"{t['fetch_start'] - t['arrival']:.4f}..{t['fetch_end'] - t['arrival']:.4f} s, "
          f"loaded at {t['load_end'] - t['arrival']:.4f} s, prefill started at "
          f"{t['prefill_start'] - t['arrival']:.4f} s")


def test_the_fetch_equivalence_fails_on_corrupted_fetched_pages(pair, model_dir):
    """The same fetch as above with the fetched pages zeroed before they join a's tree: the
    request reuses 48 fetched tokens and its output is no longer the one computed locally."""
    from evinfra.engine_patch.wire import FetchPlan, FetchRunWire, fetch_kv_hints

    a, b = pair["a"], pair["b"]
    prompt = tokens(21, 48) + tokens(22, 9)
    base = gen(a, b, prompt, 8, logprob_start=LP)
    flush(a)
    peer = http("GET", b.url + "/server_info")[1]["evinfra_engine_patch"]["pool"]
    plan = FetchPlan(P, [FetchRunWire(peer, 0, block_hashes(prompt, P)[:12])])
    try:
        with corrupted(model_dir, "fetch"):
            r = gen(a, b, prompt, 8, kv_hints=fetch_kv_hints(plan, "t-bad"), decode_delay_s=0.5,
                    logprob_start=LP)
        assert r["prefill"]["cached_tokens_details"]["evinfra_fetched"] == 48
        # The prefill's log-probabilities of the tail, computed on the zeroed prefix, differ.
        # (The decode engine decodes from its own cached copy of the prefix: its tokens
        # after the first need not change.)
        diffs = differences(r, base)
        assert any(d.startswith("input_logprobs") for d in diffs), diffs
        print(f"\nzeroed fetched pages: {diffs}; tokens {r['output_ids']} instead of "
              f"{base['output_ids']}")
    finally:
        flush(a)  # its tree now holds the zeroed pages


async def test_the_driver_sends_fetch_plans_and_reports_restored_tokens(pair):
    """``PrefillOrder.fetch`` reaches the engine through the driver; ``PrefillDone.fetched``
    and the prefill iteration report's ``t_rst`` carry what it pulled and restored, and
    ``PrefillDone.fetch_s`` how long the pull took."""
    from evinfra.core.bus import Bus
    from evinfra.core.clock import WallClock
    from evinfra.core.events import (IterationReport, PrefillDone, PrefillStarted,
                                     RequestFailed, TokensOut)
    from evinfra.core.contracts import DecodeOrder, FetchRun, PrefillOrder, Sampling
    from evinfra.drivers.sglang.driver import DriverSettings, SGLangDriver
    from evinfra.drivers.sglang.pairs import PairBook

    a, b = pair["a"], pair["b"]
    prompt = tokens(3, 40) + tokens(4, 5)
    base = await asyncio.to_thread(gen, a, b, prompt, 8)
    await asyncio.to_thread(assert_context_matters, a, b, prompt, 40, base)
    await asyncio.to_thread(flush, a)
    bus, events = Bus(), []
    for t in (PrefillStarted, PrefillDone, IterationReport, TokensOut, RequestFailed):
        bus.subscribe(t, events.append)
    book = PairBook()
    drivers = {n: SGLangDriver(n, e.url, WallClock(), bus, book, P,
                               DriverSettings(poll_interval_s=0.1))
               for n, e in pair.items()}
    for d in drivers.values():
        await d.start()
    try:
        ids = np.asarray(prompt, dtype=np.uint32)
        path = block_hashes(prompt, P)
        sampling = Sampling(max_tokens=8, temperature=0.0, ignore_eos=True)

        def bind(ev):
            drivers["b"].submit_decode(DecodeOrder(ev.request, "a", ids, path, sampling))

        bus.subscribe(PrefillStarted, bind)
        drivers["a"].submit_prefill(PrefillOrder("r-drv", ids, path, [FetchRun("b", 0, path[:10])],
                                                 sampling, cached_tokens=40))

        async def until(pred, timeout=30.0):
            for _ in range(int(timeout / 0.05)):
                if (v := pred()):
                    return v
                await asyncio.sleep(0.05)
            raise AssertionError(f"timed out; events: {events}")

        await until(lambda: [e for e in events if isinstance(e, TokensOut) and e.finish])
        assert not [e for e in events if isinstance(e, RequestFailed)]
        out = [t for e in events if isinstance(e, TokensOut) for t in e.tokens]
        assert out == base["output_ids"]
        done = next(e for e in events if isinstance(e, PrefillDone))
        assert done.fetched == 40 and done.cached >= 40
        # The read's own time, for the router's fetch-time model (0 before the patch said it).
        assert 0 < done.fetch_s < 5, done
        # The engine's own log of passes: its prefill of the request (named by the engine's
        # rid), whose 40 fetched tokens were loaded while it was queued, none in the pass.
        report = await until(lambda: [e for e in events if isinstance(e, IterationReport)
                                      and any(i.request.startswith("r-drv-p")
                                              for i in e.prefill)])
        item = next(i for i in report[0].prefill if i.request.startswith("r-drv-p"))
        assert item.t_rst == 0 and item.t_c == done.cached >= 40
        assert item.t_uc == len(prompt) - done.cached
        await until(lambda: [e for e in events if isinstance(e, IterationReport)
                             and e.node == "b" and e.batch >= 1])
        assert drivers["a"].stats["fetch_plans_sent"] == 1
    finally:
        for d in drivers.values():
            await d.stop()


def test_host_eviction_takes_zero_count_blocks_first(pair):
    a, b = pair["a"], pair["b"]
    old = [tokens(100 + i, 200) for i in range(3)]    # zero count, the oldest
    kept = [tokens(200 + i, 200) for i in range(3)]   # a branch's context: positive count
    flood = [tokens(300 + i, 200) for i in range(30)]  # zero count, newer than `kept`
    for p in old + kept:
        gen(a, b, p, 1)
    positive = [h for p in kept for h in block_hashes(p, P)]
    code, body = http("POST", a.url + "/evinfra/hints", {"positive": positive, "zero": []})
    assert code == 200 and body["positive"] == len(positive)
    for p in flood:  # 6000 new tokens through 2048 device + ~4100 host slots
        gen(a, b, p, 1)
    ev = status(a)["eviction"]
    assert ev["positive_blocks"] == len(positive)
    assert ev["evicted_zero_nodes"] > 0 and ev["evicted_positive_nodes"] == 0
    assert ev["violations"] == 0
    evicted = set().union(*(set(r["blocks"]) for r in ev["recent"]))
    for p in kept:
        assert not set(block_hashes(p, P)) & evicted
    assert all(set(block_hashes(p, P)) <= evicted for p in old)
    # Under LRU the kept context (older) would have gone before these newer flood blocks.
    assert set(block_hashes(flood[0], P)) <= evicted
    for p in kept:  # the kept context is still on host: reused, loaded back while queued
        r = gen(a, b, p + [5, 6, 7, 8], 1)
        assert r["prefill"]["cached_tokens"] == 200
        assert r["prefill"]["cached_tokens_details"]["evinfra_restored"] >= 4
    # A resync replaces the engine's marks with the ones it names.
    code, _ = http("POST", a.url + "/evinfra/hints",
                   {"positive": positive[:3], "zero": [], "replace": True})
    assert code == 200 and status(a)["eviction"]["positive_blocks"] == 3
    print(f"\nhost evictions: {ev['evicted_zero_nodes']} zero-count nodes "
          f"({ev['evicted_zero_blocks']} blocks), {ev['evicted_positive_nodes']} positive")


def test_the_directorys_counts_pushed_by_the_driver_decide_what_the_engine_evicts(
        pair, model_dir):
    """The hint path end to end: requests of three named branches go through ``evinfra
    serve``'s service; its directory counts their blocks, its SGLang driver pushes the
    crossings to the engines (``POST /evinfra/hints``), and a's host eviction then keeps
    them while it evicts zero-count blocks, older and newer ones (under LRU the branches'
    blocks, older than the flood, would have gone first), through a resync of a's cache in
    between. No hint is posted by the test."""
    from openai import OpenAI

    from evinfra.config import parse_config

    a, b = pair["a"], pair["b"]
    flush(a)
    flush(b)
    old = [tokens(400 + i, 200) for i in range(3)]     # zero count, the oldest
    kept = [tokens(500 + i, 200) for i in range(3)]    # the branches' contexts
    flood = [tokens(600 + i, 200) for i in range(30)]  # zero count, newer than `kept`
    for p in old:
        gen(a, b, p, 1)
    svc = ServiceThread(parse_config(sglang_config(pair, model_dir))).start()
    try:
        client = OpenAI(base_url=svc.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for i, p in enumerate(kept):
            client.completions.create(model=SERVED_NAME, prompt=p, max_tokens=1, temperature=0,
                                      extra_headers={"X-Evinfra-Branch-Id": f"agent-hint-{i}"},
                                      extra_body={"ignore_eos": True})
        positive = {h for p in kept for h in block_hashes(p, P)}
        deadline = time.monotonic() + 30
        while status(a)["eviction"]["positive_blocks"] < len(positive):
            assert time.monotonic() < deadline, status(a)["eviction"]
            time.sleep(0.1)
        assert svc.call(lambda s: s.drivers["a"].stats["hints_sent"]) >= 1
        # A resync now (as after any break in the driver's view of a) republishes a's cache
        # after a clear, in one batch: the branches' blocks were never let go, so they keep
        # their counts and the engine its marks.
        clears = svc.call(lambda s: s.directory.tree.stats.clears)
        code, _ = http("POST", a.url + "/evinfra/kv_resync", {})
        assert code == 200
        deadline = time.monotonic() + 30
        while svc.call(lambda s: s.directory.tree.stats.clears) == clears:
            assert time.monotonic() < deadline, "a's resync never reached the directory"
            time.sleep(0.1)
        assert positive <= set(svc.call(lambda s: s.directory.positive_blocks("a")))
        for p in flood:  # direct to the engines: no branch, zero count
            gen(a, b, p, 1)
        ev = status(a)["eviction"]
    finally:
        svc.stop()
    assert ev["positive_blocks"] >= len(positive)
    assert ev["evicted_zero_nodes"] > 0 and ev["evicted_positive_nodes"] == 0
    assert ev["violations"] == 0
    evicted = set().union(*(set(r["blocks"]) for r in ev["recent"]))
    assert not positive & evicted
    assert all(set(block_hashes(p, P)) <= evicted for p in old)
    assert set(block_hashes(flood[0], P)) <= evicted  # newer than the branches' blocks
    print(f"\nhints through the driver: {ev['positive_blocks']} positive blocks kept, "
          f"{ev['evicted_zero_blocks']} zero-count blocks evicted")


def test_a_switch_drains_by_itself_and_keeps_the_cache(pair):
    a, b = pair["a"], pair["b"]
    prompt = tokens(5, 48) + tokens(6, 7)
    base = gen(a, b, prompt, 8, logprob_start=LP)
    assert_context_matters(a, b, prompt, 48, base)
    # Finished, though still in b's batch until its next step: not running.
    assert status(b)["running"] == 0
    long: dict = {}

    def run_long():
        long["r"] = gen(a, b, tokens(7, 30), 300)
        long["end"] = time.time()

    th = threading.Thread(target=run_long)
    th.start()
    deadline = time.monotonic() + 60
    while status(b)["running"] < 1:  # until b is decoding the long request
        assert time.monotonic() < deadline and th.is_alive(), "the long request never reached b"
        time.sleep(0.05)
    # b's decode is held in place (SGLang's own pause) until the switch is decided, so the
    # request is still running at the decision whatever the machine's load: without the
    # hold, a loaded machine once delivered the switch after the request's last token
    # (running_at_decision 0).
    code, out = http("POST", b.url + "/pause_generation", {"mode": "in_place"})
    assert code == 200, out
    with ThreadPoolExecutor(2) as pool:
        try:
            to_p = pool.submit(switch, b, "prefill")
            to_d = pool.submit(switch, a, "decode")
            while not status(b)["switch"]["draining"]:
                assert time.monotonic() < deadline, "b never decided its switch"
                time.sleep(0.05)
            time.sleep(HOLD_S)
        finally:
            code, out = http("POST", b.url + "/continue_generation", {})
        assert code == 200, out
        (cb, ob, tb), (ca, oa, ta) = to_p.result(), to_d.result()
    th.join(60)
    assert cb == 200 and ob["success"] and ca == 200 and oa["success"], (ob, oa)
    assert len(long["r"]["output_ids"]) == 300  # the running request finished in place
    assert (role(a), role(b)) == ("decode", "prefill")
    rec = status(b)["switch"]["history"][-1]
    assert rec["ok"] and rec["running_at_decision"] >= 1
    # The switch time is the drain time (at least the hold) plus a rebuild of the role's
    # queues. (Bounds leave room for a loaded 2-core machine; measured: rebuild 0.1-0.5 s.)
    assert rec["drain_s"] > HOLD_S and rec["switch_s"] - rec["drain_s"] < 2.0
    assert abs(rec["decided_at"] + rec["drain_s"] - long["end"]) < 2.0
    r = gen(b, a, prompt, 8, logprob_start=LP)  # b prefills from what it kept as a decode engine
    assert_same_output(r, base)
    assert r["prefill"]["cached_tokens"] >= 48
    for e, new in ((b, "decode"), (a, "prefill")):
        code, out, _ = switch(e, new)
        assert code == 200 and out["success"]
    r = gen(a, b, prompt, 8, logprob_start=LP)  # a went P -> D -> P and kept its cache
    assert_same_output(r, base)
    assert r["prefill"]["cached_tokens"] >= 48
    hist = status(a)["switch"]["history"]
    print("\nswitches (drain_s / switch_s): b D->P "
          f"{rec['drain_s']:.3f} / {rec['switch_s']:.3f} (HTTP {tb:.3f}); a (HTTP {ta:.3f}) "
          + ", ".join(f"{h['old_role'][0].upper()}->{h['new_role'][0].upper()} "
                      f"{h['drain_s']:.3f} / {h['switch_s']:.3f}" for h in hist))


def test_the_switch_equivalence_fails_on_a_corrupted_kept_cache(pair, model_dir):
    """The round trip above with every kept KV page zeroed at the flips: the prefix is still
    matched in the tree, and the output is no longer the one computed before the switch."""
    a, b = pair["a"], pair["b"]
    prompt = tokens(23, 48) + tokens(24, 7)
    base = gen(a, b, prompt, 8, logprob_start=LP)
    try:
        with corrupted(model_dir, "switch"):
            for e, new in ((a, "decode"), (b, "prefill")):
                code, out, _ = switch(e, new)
                assert code == 200 and out["success"], out
        for e, new in ((b, "decode"), (a, "prefill")):
            code, out, _ = switch(e, new)
            assert code == 200 and out["success"], out
        r = gen(a, b, prompt, 8, logprob_start=LP)
        assert r["prefill"]["cached_tokens"] >= 48
        diffs = differences(r, base)
        assert "tokens" in diffs and any(d.startswith("input_logprobs") for d in diffs), diffs
        print(f"\nzeroed kept cache: {diffs}; tokens {r['output_ids']} instead of "
              f"{base['output_ids']}")
    finally:
        flush(a)
        flush(b)


def test_a_round_trip_through_the_service_keeps_the_blocks_in_the_directory(pair, model_dir):
    from openai import OpenAI

    from evinfra.config import parse_config
    from evinfra.core.events import PhaseSwitched, SplitChanged, TokensOut
    from evinfra.core.types import Tier

    svc = ServiceThread(parse_config(sglang_config(pair, model_dir))).start()
    try:
        seen: list = []

        def spy(s):
            for t in (PhaseSwitched, SplitChanged, TokensOut):
                s.bus.subscribe(t, seen.append)

        svc.call(spy)
        client = OpenAI(base_url=svc.url + "/v1", api_key="none", max_retries=0, timeout=60)
        branch = {"X-Evinfra-Branch-Id": "agent-patch"}
        prompt = tokens(8, 41)  # 10 full pages
        hashes = block_hashes(prompt, P)
        client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=6,
                                  temperature=0, extra_headers=branch,
                                  extra_body={"ignore_eos": True})

        def tiers_on(node: str) -> list[set]:
            return svc.call(lambda s: [s.directory.tree.tiers(h, s.directory.index(node))
                                       for h in hashes])

        def wait(pred, timeout=60.0, what=""):
            deadline = time.monotonic() + timeout
            while not pred():
                assert time.monotonic() < deadline, f"timed out: {what}"
                time.sleep(0.05)

        wait(lambda: all(t == {Tier.L1, Tier.L2} for t in tiers_on("a")), what="a L1+L2")
        # (The drivers replay the engines' event history at start, the flushes of the tests
        # above included: wait until both have it all, then count only what comes from now on.
        # On a loaded machine b's replay can still be under way once a's blocks are listed.)
        caught_up = lambda: svc.call(lambda s: all(  # noqa
            d._kv is not None and d._kv.stream.next_seq is not None
            and not d._kv.stream.replaying for d in s.drivers.values()))
        wait(caught_up, what="both KV streams replayed")
        clears = lambda: svc.call(lambda s: [d._engine_clears for d in s.drivers.values()])  # noqa
        clears_before = clears()
        long: dict = {}

        def run_long():
            r = client.completions.create(model=SERVED_NAME, prompt=tokens(9, 20),
                                          max_tokens=300, temperature=0,
                                          extra_body={"ignore_eos": True})
            long["finish"] = r.choices[0].finish_reason

        th = threading.Thread(target=run_long)
        th.start()
        # Bound to b for decode (at its prefill start): b's drain must let it finish.
        wait(lambda: svc.call(lambda s: bool(s.router._nodes["b"].decoding)), what="bound to b")
        roles = lambda: svc.call(lambda s: {n: s.router.phase(n).value for n in s.nodes})  # noqa
        code, body = http("POST", svc.url + "/v1/evinfra/split", {"prefill": ["b"]})
        assert code == 200, body
        wait(lambda: roles() == {"a": "decode", "b": "prefill"}, what="a D, b P")
        th.join(60)
        assert long["finish"] == "length"
        code, body = http("POST", svc.url + "/v1/evinfra/split", {"prefill": ["a"]})
        assert code == 200, body
        wait(lambda: roles() == {"a": "prefill", "b": "decode"}, what="back to a P, b D")
        # a went P -> D -> P: its blocks are listed all along, in both tiers.
        assert all(t == {Tier.L1, Tier.L2} for t in tiers_on("a"))
        assert clears() == clears_before  # no AllBlocksCleared from either switch
        r = client.completions.create(model=SERVED_NAME, prompt=prompt + tokens(10, 7),
                                      max_tokens=4, temperature=0, extra_headers=branch,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens_details.cached_tokens >= 40
        # Switch time (decision -> serving the new phase) against the drain of b's decode.
        t0 = next(e.time for e in seen if isinstance(e, SplitChanged))
        t_b = next(e.time for e in seen if isinstance(e, PhaseSwitched) and e.node == "b"
                   and e.time > t0)
        t_drained = max(e.time for e in seen if isinstance(e, TokensOut) and e.node == "b"
                        and e.finish and e.time < t_b)
        assert t_drained - t0 > 0.3 and 0 <= t_b - t_drained < 3.0
        print(f"\nservice switch of b D->P: {t_b - t0:.3f} s, of which drain "
              f"{t_drained - t0:.3f} s")
    finally:
        svc.stop()


def test_a_service_started_beside_running_engines_learns_what_they_hold(pair, model_dir):
    """The engines stored a prompt's blocks, then published more batches than their replay
    buffers keep: a control plane started now cannot replay that history. Its drivers clear
    their view of each node and ask each engine for a KV resync, which republishes the
    engine's whole cache in its event stream: the directory then lists the prompt's blocks in
    both tiers of the prefill engine, as the engine holds them."""
    from evinfra.config import parse_config
    from evinfra.core.types import Tier

    a, b = pair["a"], pair["b"]
    prompt = tokens(11, 40)  # 10 full pages
    gen(a, b, prompt, 2)
    for i in range(KV_REPLAY_STEPS + 2):  # each request publishes a batch or more
        gen(a, b, tokens(40 + i, 8), 1)
    hashes = block_hashes(prompt, P)
    svc = ServiceThread(parse_config(sglang_config(pair, model_dir))).start()
    try:
        deadline = time.monotonic() + 30
        held = lambda: svc.call(lambda s: [s.directory.tree.tiers(h, s.directory.index("a"))  # noqa
                                           for h in hashes])
        while held() != [{Tier.L1, Tier.L2}] * len(hashes):
            assert time.monotonic() < deadline, held()
            time.sleep(0.05)
        # (b published fewer batches: its replay buffer may still reach back to its start.)
        stats = svc.call(lambda s: s.drivers["a"].stats)
        assert stats["kv_resyncs"] >= 1 and stats["kv_resync_received"] >= 1
        assert status(a)["kv_resyncs"] >= 1
    finally:
        svc.stop()
