"""The pool's lease protocol as every TP rank runs it (``pool.PoolServer``): rank 0 takes what
peers sent and the leases whose time ran out (``take_messages``), SGLang hands the same
messages to every rank in the same iteration (here: a loop), and each rank pins and unpins its
own tree the same way; rank 0 answers. The reader's ranks share one lease by its key and end
it with one release each; a reader of another tp is refused.

The radix tree is a stand-in (``tree_ops`` needs SGLang): it records the pins."""

from __future__ import annotations

import importlib
import queue
import sys
import types

import numpy as np
import pytest

from evinfra.engine_patch.layout import host_layout
from evinfra.engine_patch.wire import (LeaseReply, LeaseRequest, Release, Shard, pool_decoder,
                                       pool_encoder)

P = 4
SHARDS = [Shard(f"peer-{r}", host_layout("layer_first", 4096 * (r + 1), 64, 2, 16, P))
          for r in range(2)]


class Tree:
    """One rank's tree: it holds the first 3 pages of any prompt on host at slots 8.."""

    def __init__(self) -> None:
        self.page_size = P
        self.tree_core = self
        self.pins: list[tuple[str, str]] = []


def fake_tree_ops() -> types.ModuleType:
    m = types.ModuleType("evinfra.engine_patch.tree_ops")
    m.match = lambda tc, tokens: types.SimpleNamespace(best_match_node="n3")
    m.host_slots_to = lambda core, node: np.arange(8, 8 + 3 * P)
    m.host_tail = lambda core, node: node
    m.lock_host = lambda tc, node: tc.pins.append(("lock", node)) or "params"
    m.unlock_host = lambda tc, node, params: tc.pins.append(("unlock", node))
    return m


@pytest.fixture
def ranks(monkeypatch):
    """Rank 0 and rank 1 of a tp=2 engine's pool, without sockets (rank 0's answers are
    kept in its outbox)."""
    monkeypatch.setitem(sys.modules, "evinfra.engine_patch.tree_ops", fake_tree_ops())
    monkeypatch.delitem(sys.modules, "evinfra.engine_patch.pool", raising=False)
    pool = importlib.import_module("evinfra.engine_patch.pool")
    out = []
    for rank in (0, 1):
        s = pool.PoolServer.__new__(pool.PoolServer)
        s.tree_cache, s.page_size, s.rank, s.shards = Tree(), P, rank, SHARDS
        s._leases, s._keys, s._ids = {}, {}, iter(range(1, 100))
        s.stats = dict.fromkeys(("leases", "pages_leased", "refused", "released", "expired",
                                 "bad_messages"), 0)
        s._inbox, s._outbox = queue.SimpleQueue(), queue.SimpleQueue()
        s._wake_tx = types.SimpleNamespace(send=lambda b: None)
        out.append(s)
    yield out
    sys.modules.pop("evinfra.engine_patch.pool", None)


def iteration(ranks, *sent):
    """Peers' messages reach rank 0's socket; one scheduler iteration hands what rank 0
    took to every rank; rank 0's answers, decoded."""
    for ident, msg in sent:
        ranks[0]._inbox.put((ident, pool_encoder.encode(msg)))
    for params in ranks[0].take_messages():
        for r in ranks:
            r.on_message(params)
    answers = []
    while not ranks[0]._outbox.empty():
        ident, payload = ranks[0]._outbox.get()
        answers.append((ident, pool_decoder.decode(payload)))
    return answers


def lease(key: str = "reader/7/0", ranks: int = 2, ttl_s: float = 30.0) -> LeaseRequest:
    return LeaseRequest(list(range(3 * P)), 0, 3, key=key, ranks=ranks, ttl_s=ttl_s)


def test_every_rank_pins_once_for_all_the_readers_ranks_and_unpins_after_the_last(ranks):
    (a, first), = iteration(ranks, (b"r0", lease()))
    assert a == b"r0" and isinstance(first, LeaseReply) and first.ok and first.pages == 3
    assert first.slots == list(range(8, 8 + 3 * P)) and first.shards == SHARDS
    (b, second), = iteration(ranks, (b"r1", lease()))  # the reader's rank 1, same key
    assert b == b"r1" and second == first
    for r in ranks:
        assert r.tree_cache.pins == [("lock", "n3")]  # one pin, on every rank
    iteration(ranks, (b"r0", Release(first.lease)))
    assert all(r.tree_cache.pins == [("lock", "n3")] for r in ranks)  # rank 1 still reads
    iteration(ranks, (b"r1", Release(first.lease)))
    for r in ranks:
        assert r.tree_cache.pins == [("lock", "n3"), ("unlock", "n3")]
        assert r._leases == {} and r._keys == {}


def test_a_reader_of_another_tp_is_refused(ranks):
    (_, reply), = iteration(ranks, (b"r0", lease(ranks=1)))
    assert not reply.ok and "2 TP shard(s), the asking engine has tp=1" in reply.reason
    assert all(r.tree_cache.pins == [] for r in ranks)


def test_rank_0_decides_an_expiry_once_and_every_rank_unpins(ranks):
    (_, reply), = iteration(ranks, (b"r0", lease(ttl_s=0.0)))
    assert reply.ok and reply.lease > 0
    expired = ranks[0].take_messages()  # rank 0 finds it expired, on its own clock
    assert expired == [{"expire": reply.lease}]
    assert ranks[0].take_messages() == []  # said once, while that message is on its way
    for params in expired:  # the next iteration: every rank unpins
        for r in ranks:
            r.on_message(params)
    for r in ranks:
        assert r.tree_cache.pins == [("lock", "n3"), ("unlock", "n3")]
        assert r.stats["expired"] == 1
