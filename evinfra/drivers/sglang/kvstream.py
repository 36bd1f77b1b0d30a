"""One engine's KV event stream in order, without holes: gap detection, replay, resync.

:class:`KVStream` is sans-I/O. The subscriber feeds it what arrives (live frames from the PUB
socket, answers from the replay ROUTER, timeouts) and carries out the actions it returns:

* :class:`Deliver` a batch to the directory (in sequence order, each sequence once);
* :class:`Replay` — ask the engine's ROUTER for every buffered batch from ``start`` on;
* :class:`Clear` — the view of this node can no longer be trusted: publish
  ``NodeKVViewLost`` for it (``AllBlocksCleared`` when the engine itself started over, its
  cache empty), then go on from what follows. The directory then *undercounts* the node
  (blocks it still holds but we never heard of are missing), which only costs cache hits; it
  never *overcounts* (claims blocks the node dropped), which would route requests to KV that
  is not there. The driver then asks an engine running the evinfra patch for a KV
  resync: the engine republishes its whole cache in this same stream, and from that batch on
  the view is exact again.

The publisher (SGLang ``ZmqEventPublisher``) numbers its batches 0, 1, 2... from its start and
keeps the last ``buffer_steps`` (10,000 by default) for replay. So:

* at (re)connection we know nothing: replay from 0 fetches what the engine published before we
  subscribed (a SUB socket misses everything sent before it joined);
* a live sequence above the next expected one is a gap: hold the frame, replay from the
  expected sequence;
* a replay whose first batch is past the expected sequence means the buffer already dropped
  it: unrecoverable, so Clear and go on from the replay;
* a live sequence *below* the expected one means the publisher restarted (a new engine process
  counts from 0 again, and SUB sockets never deliver twice): its cache is empty, so Clear and
  replay from 0;
* no replay endpoint, or no answer in time: Clear and go on from the held frames;
* a batch we cannot decode (or that lost an event) may have carried a removal: Clear.
"""

from __future__ import annotations

from typing import Union

import msgspec

from evinfra.core.events import KVEventBatch

__all__ = ["Clear", "Deliver", "KVStream", "KVStreamStats", "Replay", "Action"]


class Deliver(msgspec.Struct, frozen=True, gc=False):
    seq: int
    batch: KVEventBatch


class Replay(msgspec.Struct, frozen=True, gc=False):
    start: int


class Clear(msgspec.Struct, frozen=True, gc=False):
    reason: str
    emptied: bool = False
    """The engine itself started over (a new process, its cache empty): its blocks are gone,
    not just our view of them."""


Action = Union[Deliver, Replay, Clear]


class KVStreamStats(msgspec.Struct):
    delivered: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    clears: int = 0
    restarts: int = 0
    malformed: int = 0
    duplicates: int = 0


class KVStream:
    """Sequence tracking of one publisher. ``replay_available``: the engine has a ROUTER."""

    def __init__(self, replay_available: bool) -> None:
        self.replay_available = replay_available
        self.stats = KVStreamStats()
        self._next: int | None = None  # the sequence we deliver next; None: unknown
        self._held: dict[int, KVEventBatch | None] = {}  # live frames waiting for a replay
        self._replaying: int | None = None  # the start of the replay in flight
        self._replay_seen = False

    @property
    def next_seq(self) -> int | None:
        return self._next

    @property
    def replaying(self) -> bool:
        return self._replaying is not None

    # -- inputs ----------------------------------------------------------------------------

    def connected(self) -> list[Action]:
        """A (re)connection: we know nothing of what the engine published meanwhile.

        With a replay endpoint, fetch the whole buffer; without one, start from the next live
        frame (the view is then what we see from now on)."""
        self._held.clear()
        self._replaying = None
        if not self.replay_available:
            self._next = None
            return []
        self._next = 0
        return self._start_replay(0)

    def live(self, seq: int, batch: KVEventBatch | None) -> list[Action]:
        """A frame from the PUB socket; ``batch`` None when its payload did not decode."""
        if self._replaying is not None:
            self._held[seq] = batch
            return []
        if self._next is None:  # first frame after a connection without replay
            self._next = seq
        if seq == self._next:
            return self._accept(seq, batch)
        if seq < self._next:
            # SUB sockets never deliver twice, so the publisher started over: a new engine
            # process, whose cache is empty.
            self.stats.restarts += 1
            out: list[Action] = [self._clear(f"publisher restarted (sequence {seq} after "
                                             f"{self._next})", emptied=True)]
            self._next = 0
            if self.replay_available:
                self._held[seq] = batch
                return out + self._start_replay(0)
            self._next = seq
            return out + self._accept(seq, batch)
        # seq > next: we missed frames.
        self.stats.gaps += 1
        self._held[seq] = batch
        if self.replay_available:
            return self._start_replay(self._next)
        return [self._clear(f"missed sequences {self._next}..{seq - 1} and the engine has no "
                            "replay endpoint")] + self._skip_to_held()

    def replayed(self, seq: int, batch: KVEventBatch | None) -> list[Action]:
        """A batch of the replay answer."""
        if self._replaying is None:
            return []  # a late answer to a replay we gave up on
        self.stats.replayed_batches += 1
        out: list[Action] = []
        if not self._replay_seen:
            self._replay_seen = True
            if self._next is not None and seq > self._next:
                out.append(self._clear(f"sequences {self._next}..{seq - 1} are no longer in "
                                       "the engine's replay buffer"))
                self._next = seq
        if self._next is None or seq < self._next:
            self.stats.duplicates += 1
            return out
        if seq > self._next:  # a hole inside the replay itself (should not happen)
            out.append(self._clear(f"replay skipped sequences {self._next}..{seq - 1}"))
            self._next = seq
        return out + self._accept(seq, batch)

    def replay_done(self) -> list[Action]:
        """The end marker (sequence -1): go on with the frames held meanwhile."""
        if self._replaying is None:
            return []
        self._replaying = None
        return self._drain_held()

    def replay_failed(self, why: str) -> list[Action]:
        """No answer in time (or the ROUTER is unreachable)."""
        if self._replaying is None:
            return []
        self._replaying = None
        return [self._clear(f"replay failed: {why}")] + self._skip_to_held()

    # -- internals -------------------------------------------------------------------------

    def _start_replay(self, start: int) -> list[Action]:
        self._replaying = start
        self._replay_seen = False
        self.stats.replays += 1
        return [Replay(start)]

    def _accept(self, seq: int, batch: KVEventBatch | None) -> list[Action]:
        self._next = seq + 1
        if batch is None:
            self.stats.malformed += 1
            return [self._clear(f"batch {seq} could not be decoded")]
        self.stats.delivered += 1
        return [Deliver(seq, batch)]

    def _clear(self, reason: str, emptied: bool = False) -> Clear:
        self.stats.clears += 1
        return Clear(reason, emptied)

    def _drain_held(self) -> list[Action]:
        out: list[Action] = []
        for seq in sorted(self._held):
            batch = self._held.pop(seq)
            if self._next is None:
                self._next = seq
            if seq < self._next:
                self.stats.duplicates += 1
                continue
            if seq > self._next:
                # Still a hole after the replay: ask again from it (frames above stay held).
                self._held[seq] = batch
                self.stats.gaps += 1
                if self.replay_available:
                    return out + self._start_replay(self._next)
                return out + [self._clear(f"missed sequences {self._next}..{seq - 1}")] \
                    + self._skip_to_held()
            out += self._accept(seq, batch)
        return out

    def _skip_to_held(self) -> list[Action]:
        """After a Clear: continue from the oldest held frame."""
        if not self._held:
            self._next = None
            return []
        self._next = min(self._held)
        return self._drain_held()
