"""P->D transfers, decode batching, the two streaming modes, and outputs."""

import numpy as np
import pytest
from fake_harness import PAGE, TEST_TIMING, Harness, path, tokens

from evinfra.core.contracts import DecodeOrder
from evinfra.core.events import (IterationReport, NodeKVEvents, NodeState, PrefillDone,
                                 PrefillStarted, RequestFailed, TokensOut)
from evinfra.core.hashing import block_hashes
from evinfra.core.types import Phase
from evinfra.drivers.fake import FakeEngineConfig
from evinfra.drivers.fake.timing import phi

CFG = FakeEngineConfig(**TEST_TIMING)


def first_token_time(h: Harness, request: str) -> float:
    return h.of(TokensOut, request=request)[0].time


def test_pd_transfer_moves_only_the_kv_the_decode_node_lacks() -> None:
    h = Harness()
    a = tokens(20_000)
    h.submit("t1", a, max_tokens=100)
    h.run(5)
    out1, finish, _ = h.output("t1")
    assert finish == "length" and len(out1) == 100
    # the output's full pages were written through on d0, chained from the input (SGLang hashes)
    seq = np.concatenate([a, np.array(out1[:-1], dtype=np.uint32)])
    full = block_hashes(seq, PAGE)
    stored = [e for e in h.kv("d0", "GPU") if type(e).__name__ == "BlockStored"]
    assert stored[-1].block_hashes == full[len(path(a)):]
    assert stored[-1].parent_block_hash == path(a)[-1]

    t2 = np.concatenate([seq, np.array([out1[-1]], dtype=np.uint32), tokens(2_000, seed=7)])
    h.submit("t2", t2, max_tokens=10)
    h.run(10)
    new = t2.size - len(full) * PAGE  # d0 holds every full page of t1's input and output
    ready = h.one(PrefillDone, request="t2").time + new * CFG.pd_s_per_token
    assert first_token_time(h, "t2") == pytest.approx(ready)
    h.check()


def test_a_decode_order_after_the_prefill_starts_the_transfer_then() -> None:
    h = Harness()
    t = tokens(10_000)
    order = h.submit("r", t, decode=None)
    h.run(3)
    assert not h.of(TokensOut)
    h.engines["d0"].submit_decode(DecodeOrder("r", "p0", t, order.path, order.sampling))
    h.run(6)
    assert first_token_time(h, "r") == pytest.approx(3 + t.size * CFG.pd_s_per_token)


def test_the_decode_node_reserves_nothing_while_the_request_is_queued() -> None:
    h = Harness()
    h.submit("long", tokens(80_000, seed=1), max_tokens=2)
    h.submit("r", tokens(30_000, seed=2), max_tokens=2)
    rooms: list[tuple[float, int]] = []
    h.bus.subscribe(PrefillStarted, lambda e: rooms.append(
        (e.time, h.engines["d0"].cache.kv_room)) if e.request == "r" else None)
    h.run(10)
    assert rooms == [(rooms[0][0], CFG.l1_tokens)]  # bound at prefill start, room untouched
    assert h.output("r")[1] == "length"


def test_collocated_requests_need_no_transfer() -> None:
    h = Harness(nodes=[("c0", Phase.COLLOCATED)])
    h.submit("r", tokens(9_000), prefill="c0", decode="c0", max_tokens=100)
    h.run(3)
    assert first_token_time(h, "r") == h.one(PrefillDone, request="r").time
    assert len(h.of(NodeKVEvents, node="c0")) == 3  # two chunks, then the output pages
    h.check()


def test_decode_iterations_batch_every_running_request() -> None:
    h = Harness()
    for i in range(8):
        h.submit(f"r{i}", tokens(4_000, seed=i), max_tokens=200)
    h.run(30)
    reports = [r for r in h.of(IterationReport, node="d0") if r.batch]
    assert 8 in {r.batch for r in reports}
    for r in reports:
        B = r.batch  # noqa: N806
        assert r.duration == pytest.approx(CFG.d0 + CFG.d1 * phi(B, CFG.k_over_e, 2)
                                           + CFG.d2 * B + CFG.d_ctx * 4_000 * B, rel=1e-12)
    full = [r for r in reports if r.batch == 8]
    assert sum(r.accepted for r in full) / sum(r.batch for r in full) == pytest.approx(1.8, 0.02)
    states = h.of(NodeState, node="d0")
    assert max(s.decoding for s in states) == 8


def _workload(streaming: str, noise: float = 0.0, seed: int = 3) -> Harness:
    nodes = [("p0", Phase.PREFILL), ("p1", Phase.PREFILL), ("d0", Phase.DECODE),
             ("c0", Phase.COLLOCATED)]
    h = Harness(nodes, seed=seed, streaming=streaming, noise=noise, l1_tokens=300_000)
    rng = np.random.default_rng(seed)
    for i in range(40):
        at = float(rng.uniform(0, 20))
        n = int(rng.integers(500, 40_000))
        p = ["p0", "p1", "c0"][i % 3]
        d = "c0" if p == "c0" else "d0"
        h.clock.call_at(at, h.submit, f"r{i}", tokens(n, seed=i), p, d, (),
                        int(rng.integers(1, 400)), bool(i % 2))
    h.run(200)
    return h


def _finishes(h: Harness) -> dict[str, tuple[float, float, list[int], str]]:
    out = {}
    for r in {e.request for e in h.of(TokensOut)}:
        toks, finish, end = h.output(r)
        out[r] = (first_token_time(h, r), end, toks, finish)
    return out


def test_iteration_and_batched_streaming_give_identical_times() -> None:
    it, ba = _workload("iteration"), _workload("batched")
    assert _finishes(it) == _finishes(ba) and len(_finishes(it)) == 40

    def expanded(h: Harness) -> list[tuple[str, float, int]]:
        return sorted((r.node, r.duration, r.batch) for r in h.of(IterationReport) if r.batch
                      for _ in range(r.count))

    assert expanded(it) == expanded(ba)
    wakes = [sum(1 for r in h.of(IterationReport) if r.batch) for h in (it, ba)]
    assert wakes[1] < wakes[0] / 5  # batched does not wake every iteration
    it.check()
    ba.check()


def test_outputs_are_deterministic_and_honour_sampling() -> None:
    h = Harness(output_vocab=(32, 40))
    h.submit("eos", tokens(1_000), max_tokens=300, ignore_eos=True)
    h.submit("nat", tokens(1_000, seed=1), max_tokens=300, ignore_eos=False)
    h.submit("stop", tokens(1_000, seed=2), max_tokens=300, ignore_eos=False,
             stop_token_ids=[35])
    h.run(30)
    toks, finish, _ = h.output("eos")
    assert len(toks) == 300 and finish == "length" and all(32 <= t < 40 for t in toks)
    toks, finish, _ = h.output("nat")
    assert 1 <= len(toks) <= 300 and finish == ("length" if len(toks) == 300 else "stop")
    toks, finish, _ = h.output("stop")
    assert finish == "stop" and toks[-1] == 35 and 35 not in toks[:-1]
    again = Harness(output_vocab=(32, 40), streaming="batched")
    again.submit("nat", tokens(1_000, seed=1), max_tokens=300, ignore_eos=False)
    again.run(30)
    assert again.output("nat")[:2] == h.output("nat")[:2]


def test_making_decode_room_does_not_evict_the_prefix_the_request_reuses() -> None:
    # Host memory smaller than the GPU's: what d0 stores is in L1 only (the write-through
    # finds no room), so evicting a block there loses it.
    h = Harness(l1_tokens=4_096, l2_tokens=PAGE)
    a = tokens(2_560)
    h.submit("a", a, max_tokens=16)
    h.run(1)
    h.submit("z", tokens(960, seed=9), max_tokens=16)  # more recent than a on d0
    h.run(2)
    out, _, _ = h.output("a")
    b = np.concatenate([a, np.array(out, dtype=np.uint32), tokens(1_500, seed=5)])
    # b fits on d0 beside its reused prefix (a's 40 pages) once z is evicted; LRU alone
    # would evict a's tail, the older leaf, first.
    h.submit("b", b, max_tokens=16)
    h.run(4)
    out_b, finish, _ = h.output("b")
    assert finish == "length" and len(out_b) == 16
    moved = b.size - 40 * PAGE
    ready = h.one(PrefillDone, request="b").time + moved * CFG.pd_s_per_token
    assert first_token_time(h, "b") == pytest.approx(ready)  # a's pages did not move again
    h.check()


def test_a_request_larger_than_the_decode_gpu_fails_though_it_reuses_a_prefix_there() -> None:
    h = Harness(l1_tokens=4_096)
    a = tokens(2_560)
    h.submit("a", a, max_tokens=16)
    h.run(1)
    out, _, _ = h.output("a")
    # 2,576 + 1,000 input tokens and 600 outputs: more than d0's GPU holds, though the part
    # d0 lacks (its GPU has a's 40 pages) would fit.
    big = np.concatenate([a, np.array(out, dtype=np.uint32), tokens(1_000, seed=4)])
    h.submit("big", big, max_tokens=600)
    h.run(5)
    failed = h.one(RequestFailed, request="big")
    assert failed.node == "d0" and "capacity" in failed.error
    h.check()
