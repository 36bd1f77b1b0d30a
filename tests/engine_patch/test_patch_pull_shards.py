"""A fetch with tensor parallelism: each rank's puller reads its own shard of the peer's host
pool (rank i reads shard i: the peer's KV heads of rank i) into its own host pool, under one
lease key for all ranks; a peer with another tp is refused.

The peer's shards and the readers' host pools are numpy buffers laid out as SGLang's
``layer_first`` host pool with one KV head each (of two); the Mooncake read is a memmove of
the chunks the puller computes (the addresses are this process's)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from evinfra.engine_patch.fetch_plan import Segment
from evinfra.engine_patch.layout import host_layout
from evinfra.engine_patch.pull import Pull, Puller
from evinfra.engine_patch.wire import LeaseReply, Release, Shard

L, HEADS, D, P, SLOTS = 3, 2, 4, 4, 32  # layers, KV heads of the model, head dim, page, slots
ITEM = 2  # bf16
TB = D * ITEM  # one head per rank
PAGES = 3
PEER_SLOTS = list(range(12, 12 + PAGES * P))  # where the peer holds the prefix
LOCAL_SLOTS = list(range(4, 4 + PAGES * P))  # where the reader allocated it


class FakeMooncake:
    """``engine.engine.batch_transfer_sync_read``: copies the chunks, records the session."""

    def __init__(self) -> None:
        self.engine = self
        self.sessions: list[str] = []

    def batch_transfer_sync_read(self, session, local, remote, lengths) -> int:
        self.sessions.append(session)
        for la, ra, n in zip(local, remote, lengths):
            ctypes.memmove(la, ra, n)
        return 0


def shard_buffers(full: np.ndarray) -> list[np.ndarray]:
    """Rank r's host buffer: head r of every token, layer and plane."""
    return [np.ascontiguousarray(full[..., r:r + 1, :]) for r in range(HEADS)]


def layout(buf: np.ndarray):
    return host_layout("layer_first", buf.ctypes.data, SLOTS, L, TB, P)


def read(rank_as: int, local: np.ndarray, peer: list[np.ndarray], shards: int = HEADS):
    """Run one rank's puller (``rank_as``: the shard it believes is its own) over a lease
    whose reply names ``shards`` of the peer's shards."""
    engine = FakeMooncake()
    puller = Puller(engine, layout(local), 1.0, 5.0, P, rank=rank_as, ranks=HEADS,
                    reader="reader-session")
    asked, sent = [], []
    reply = LeaseReply(True, lease=9, pages=PAGES, slots=PEER_SLOTS,
                       shards=[Shard(f"peer-{r}", layout(peer[r])) for r in range(shards)])
    puller._ask = lambda peer_addr, msg: asked.append(msg) or reply
    puller._send = lambda peer_addr, msg: sent.append(msg)
    try:
        got = puller._pull(Pull(7, list(range(PAGES * P)), [Segment("peer:1", 0, PAGES)], 0,
                                LOCAL_SLOTS))
    finally:
        puller.close()
    return got, engine.sessions, asked, sent


@pytest.fixture
def peer_kv():
    rng = np.random.default_rng(7)
    return rng.integers(-30000, 30000, size=(2, L, SLOTS, HEADS, D), dtype=np.int16)


def test_each_rank_reads_its_own_shard_under_one_lease(peer_kv):
    peer = shard_buffers(peer_kv)
    local = [np.zeros_like(b) for b in peer]
    keys = set()
    for r in range(HEADS):
        got, sessions, asked, sent = read(r, local[r], peer)
        assert got == (PAGES, "") and sessions == [f"peer-{r}"]
        assert sent == [Release(9)]
        keys.add((asked[0].key, asked[0].ranks))
    assert keys == {("reader-session/7/0", HEADS)}  # every rank asks for the same lease
    # Both ranks' heads together are the peer's KV of the prefix, every plane and layer.
    fetched = np.concatenate(local, axis=3)[:, :, LOCAL_SLOTS]
    assert np.array_equal(fetched, peer_kv[:, :, PEER_SLOTS])
    assert not np.array_equal(fetched, peer_kv[:, :, LOCAL_SLOTS])  # (the slots differ)


def test_a_rank_that_read_another_ranks_shard_would_hold_the_wrong_heads(peer_kv):
    """The control: rank 1 reading shard 0 (the addressing error this guards against) gets
    bytes, but not its heads."""
    peer = shard_buffers(peer_kv)
    local = np.zeros_like(peer[1])
    got, sessions, _, _ = read(0, local, peer)
    assert got == (PAGES, "") and sessions == ["peer-0"]
    assert not np.array_equal(local[:, :, LOCAL_SLOTS, 0], peer_kv[:, :, PEER_SLOTS, 1])


def test_a_peer_with_another_tp_is_refused_and_its_lease_released(peer_kv):
    peer = shard_buffers(peer_kv)
    local = np.zeros_like(peer[0])
    got, sessions, _, sent = read(0, local, peer, shards=1)
    assert got[0] == 0 and "serves 1 TP shard(s), this engine has tp=2" in got[1]
    assert sessions == [] and sent == [Release(9)] and not local.any()
