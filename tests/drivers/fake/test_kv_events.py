"""KV events: SGLang bytes, sequence numbers, faults the directory must tolerate, and the
determinism of the whole event stream."""

import msgspec
import numpy as np
from fake_harness import EVENTS, Harness, path, tokens

from evinfra.core.contracts import HintDelta
from evinfra.core.events import BlockRemoved, KVEventDecoder, NodeKVEvents, encode_frames
from evinfra.core.types import Phase, Tier
from evinfra.directory import Directory

NODES = [("p0", Phase.PREFILL), ("d0", Phase.DECODE)]


def _traffic(h: Harness, n: int = 12) -> None:
    rng = np.random.default_rng(0)
    base = tokens(30_000, seed=99)
    for i in range(n):
        h.clock.call_at(float(rng.uniform(0, 5)), h.submit, f"r{i}",
                        tokens(int(rng.integers(5_000, 30_000)), seed=i, base=base[:10_000]),
                        "p0", "d0", (), int(rng.integers(1, 100)), False)
    h.run(30)


def test_events_are_sglang_bytes_numbered_per_node() -> None:
    h = Harness(l1_tokens=60_000, l2_tokens=100_000)
    _traffic(h)
    decoder = KVEventDecoder()
    for node in ("p0", "d0"):
        batches = h.of(NodeKVEvents, node=node)
        assert [b.seq for b in batches] == list(range(len(batches)))
        for b in batches:
            assert b.batch.events and b.batch.attn_dp_rank == 0
            frames = encode_frames(b"kv", b.seq, b.batch)
            topic, seq, batch = decoder.decode_frames(frames)
            # Decoded token ids are lists, the engine's numpy views: compare the bytes.
            assert (topic, seq) == (b"kv", b.seq) and encode_frames(topic, seq, batch) == frames
    assert decoder.dropped_events == 0
    kinds = {(type(e).__name__, e.medium) for node in ("p0", "d0") for e in h.kv(node)}
    assert kinds == {("BlockStored", "GPU"), ("BlockStored", "CPU_PINNED"),
                     ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU_PINNED")}


def test_a_directory_fed_the_events_sees_exactly_the_engines_memory() -> None:
    h = Harness(l1_tokens=60_000, l2_tokens=100_000)
    d = Directory(NODES, page_size=64)
    h.bus.subscribe(NodeKVEvents, lambda m: d.apply_batch(m.node, m.batch))
    _traffic(h)
    for node, engine in h.engines.items():
        i = d.index(node)
        for tier in (Tier.L1, Tier.L2):
            seen = {b for b in d.tree.blocks_on(i) if tier in d.tree.tiers(b, i)}
            assert engine.cache.blocks(tier) == seen
    assert d.tree.stats.unknown_removal == d.tree.stats.unknown_parent == 0


def test_faulty_event_streams_do_not_break_the_directory() -> None:
    h = Harness(l1_tokens=60_000, l2_tokens=100_000, kv_drop=0.1, kv_duplicate=0.1,
                kv_reorder=0.1)
    d = Directory(NODES, page_size=64)
    seqs: list[int] = []

    def apply(m: NodeKVEvents) -> None:
        if m.node == "p0":
            seqs.append(m.seq)
        d.apply_batch(m.node, m.batch)

    h.bus.subscribe(NodeKVEvents, apply)
    _traffic(h)
    assert len(seqs) != len(set(seqs))  # duplicates
    assert sorted(set(seqs)) != list(range(max(seqs) + 1))  # gaps
    assert seqs != sorted(seqs)  # reordering
    d.check_invariants()
    assert h.output("r0")[1] is not None  # serving goes on


def test_one_shot_faults() -> None:
    h = Harness()
    seqs: list[int] = []
    h.bus.subscribe(NodeKVEvents, lambda m: seqs.append(m.seq) if m.node == "p0" else None)
    kv = h.engines["p0"].kv
    kv.drop_next()  # batch 0 is lost
    kv.duplicate_next()  # batch 1 comes twice ...
    kv.reorder_next()  # ... after batch 2
    for i in range(5):
        h.submit(f"r{i}", tokens(8192, seed=i), decode=None)
    h.run(5)
    assert seqs == [2, 1, 1, 3, 4]


def test_same_seed_same_event_stream() -> None:
    def stream(seed: int) -> bytes:
        h = Harness(seed=seed, noise=0.05, kv_drop=0.05, kv_reorder=0.05)
        _traffic(h, 8)
        # Output tokens travel as numpy arrays on the bus: encode them as lists.
        return msgspec.msgpack.encode([e for e in h.events if type(e) in EVENTS],
                                      enc_hook=lambda o: o.tolist())

    assert stream(1) == stream(1)
    assert stream(1) != stream(2)


def test_hints_change_what_the_host_tier_keeps() -> None:
    keep, stale = tokens(20_000, seed=1), tokens(20_000, seed=2)

    def evicted(eviction: str) -> set[int]:
        h = Harness(l1_tokens=40_000, l2_tokens=60_000, eviction=eviction)
        h.submit("keep", keep, max_tokens=1)  # older, but its branch is still active
        h.run(2)
        h.submit("stale", stale, max_tokens=1)
        h.run(4)
        h.engines["p0"].push_hints(HintDelta(positive=path(keep), zero=[]))
        h.submit("new", tokens(30_000, seed=3), max_tokens=1)
        h.run(8)
        h.check()
        return {b for e in h.kv("p0", "CPU_PINNED") if type(e) is BlockRemoved
                for b in e.block_hashes}

    count, lru = evicted("count"), evicted("lru")
    assert count and count <= set(path(stale))
    assert lru and lru <= set(path(keep))
