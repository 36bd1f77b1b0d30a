"""KVStream: ordered delivery, gaps recovered by replay, resync when they cannot be."""

from evinfra.core.events import AllBlocksCleared, BlockStored, KVEventBatch, KVEventDecoder, encode_frames
from evinfra.drivers.sglang.kvstream import Clear, KVStream


def b(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([i], None, [1, 2, 3, 4], 4)])


def kinds(actions):
    return [(type(a).__name__, getattr(a, "seq", getattr(a, "start", None))) for a in actions]


def test_connect_replays_from_zero_then_delivers_in_order():
    s = KVStream(replay_available=True)
    assert kinds(s.connected()) == [("Replay", 0)]
    assert s.live(3, b(3)) == []  # held while the replay runs
    out = s.replayed(0, b(0)) + s.replayed(1, b(1)) + s.replayed(2, b(2)) + s.replay_done()
    assert [a.seq for a in out] == [0, 1, 2, 3]
    assert kinds(s.live(4, b(4))) == [("Deliver", 4)]


def test_gap_is_replayed_and_duplicates_are_dropped():
    s = KVStream(replay_available=True)
    s.connected()
    s.replay_done()
    s.live(0, b(0))
    assert kinds(s.live(3, b(3))) == [("Replay", 1)]
    s.live(4, b(4))
    out = s.replayed(1, b(1)) + s.replayed(2, b(2)) + s.replayed(3, b(3)) + s.replay_done()
    assert [a.seq for a in out] == [1, 2, 3, 4]
    assert s.stats.gaps == 1 and s.next_seq == 5


def test_unrecoverable_gap_clears_then_goes_on_with_what_is_known():
    s = KVStream(replay_available=True)
    s.connected()
    s.replay_done()
    s.live(0, b(0))
    s.live(7, b(7))  # 1..6 missed
    out = s.replayed(5, b(5)) + s.replayed(6, b(6)) + s.replayed(7, b(7)) + s.replay_done()
    assert isinstance(out[0], Clear) and "no longer" in out[0].reason
    assert not out[0].emptied  # the engine still holds what we missed hearing of
    assert [a.seq for a in out[1:]] == [5, 6, 7]


def test_publisher_restart_clears_and_replays_from_zero():
    s = KVStream(replay_available=True)
    s.connected()
    s.replay_done()
    for i in range(5):
        s.live(i, b(i))
    out = s.live(1, b(1))  # a new engine process counts from 0 again
    assert out[0] == Clear("publisher restarted (sequence 1 after 5)", emptied=True)
    assert kinds(out[1:]) == [("Replay", 0)]
    out = s.replayed(0, b(0)) + s.replayed(1, b(1)) + s.replay_done()
    assert [a.seq for a in out] == [0, 1]


def test_replay_timeout_clears_and_continues_from_held_frames():
    s = KVStream(replay_available=True)
    s.connected()
    s.live(4, b(4))
    s.live(5, b(5))
    out = s.replay_failed("no answer")
    assert isinstance(out[0], Clear)
    assert [a.seq for a in out[1:]] == [4, 5]
    assert s.replay_failed("late") == []


def test_without_replay_endpoint_a_gap_clears():
    s = KVStream(replay_available=False)
    assert s.connected() == []
    assert kinds(s.live(10, b(10))) == [("Deliver", 10)]
    out = s.live(12, b(12))
    assert isinstance(out[0], Clear) and [a.seq for a in out[1:]] == [12]


def test_undecodable_batch_counts_its_sequence_and_clears():
    s = KVStream(replay_available=True)
    s.connected()
    s.replay_done()
    s.live(0, b(0))
    out = s.live(1, None)
    assert len(out) == 1 and isinstance(out[0], Clear)
    assert kinds(s.live(2, b(2))) == [("Deliver", 2)]  # no gap was invented
    assert s.stats.malformed == 1


def test_frames_round_trip_through_the_wire_encoding():
    """The subscriber decodes what an SGLang publisher sends (the shared wire schema)."""
    topic, seq, payload = encode_frames(b"", 41, KVEventBatch(1.0, [AllBlocksCleared()], 0))
    assert int.from_bytes(seq, "big", signed=True) == 41
    batch = KVEventDecoder().decode(payload)
    assert isinstance(batch.events[0], AllBlocksCleared)
