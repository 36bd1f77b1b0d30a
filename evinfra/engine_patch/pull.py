"""The puller: the I/O thread of a prefill engine's fetches (engine process only).

Per job (:class:`Pull`), per segment: a lease from the peer's pool server (ZMQ DEALER, one
socket per peer, dropped after a timeout so a late answer is never read as the next one), one
Mooncake ``batch_transfer_sync_read`` of the leased slots straight into the job's local host
slots (chunks merged by :func:`~evinfra.engine_patch.layout.transfer_chunks`), and a release.
With TP every rank runs its own puller: rank i asks with the job's key (the same on every
rank: one lease for all of them) and reads the peer's shard i into its own host pool.
A segment that comes back short ends the job: later pages could not attach to the prefix. The
outcome (:class:`Pulled`: pages read, error) goes back to the scheduler thread, which alone
touches the radix tree.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from evinfra.engine_patch.fetch_plan import Segment
from evinfra.engine_patch.layout import transfer_chunks
from evinfra.engine_patch.wire import (HostLayout, LeaseReply, LeaseRequest, Release,
                                       pool_decoder, pool_encoder)

__all__ = ["Pull", "Pulled", "Puller"]


class Pull(msgspec.Struct):
    job: int
    tokens: list[int]
    segments: list[Segment]
    local_pages: int
    slots: list[int]


class Pulled(msgspec.Struct):
    job: int
    pages: int
    error: str
    start: float
    end: float


class Puller:
    """The I/O thread: leases, reads, releases. Owns its ZMQ sockets."""

    def __init__(self, engine: Any, layout: HostLayout, timeout_s: float, lease_ttl_s: float,
                 page_size: int, rank: int = 0, ranks: int = 1, reader: str = "") -> None:
        self.engine = engine
        self.layout = layout
        self.rank = rank
        self.ranks = ranks
        self.reader = reader  # names this engine in lease keys (its rank 0's session)
        self.timeout_ms = int(timeout_s * 1000)
        self.ttl_s = lease_ttl_s
        self.page_size = page_size
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._socks: dict[str, zmq.Socket] = {}
        self._thread = threading.Thread(target=self._run, name="evinfra-puller", daemon=True)
        self._thread.start()

    def submit(self, pull: Pull) -> None:
        self._todo.put(pull)

    def take(self) -> list[Pulled]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._todo.put(None)

    def _run(self) -> None:
        while True:
            pull = self._todo.get()
            if pull is None:
                return
            start = time.time()
            pages, error = 0, ""
            try:
                pages, error = self._pull(pull)
            except Exception as exc:  # noqa: BLE001 - reported to the scheduler thread
                error = f"{type(exc).__name__}: {exc}"
            self._done.put(Pulled(pull.job, pages, error, start, time.time()))

    def _pull(self, pull: Pull) -> tuple[int, str]:
        P = self.page_size
        got = 0  # pages read, from local_pages on
        for seg in pull.segments:
            if seg.start != pull.local_pages + got:
                break  # an earlier segment came back short: the rest cannot attach
            reply = self._ask(seg.peer, LeaseRequest(
                tokens=pull.tokens[: seg.end * P], start_page=seg.start, end_page=seg.end,
                ttl_s=self.ttl_s, key=f"{self.reader}/{pull.job}/{seg.start}",
                ranks=self.ranks))
            if reply is None:
                return got, f"no answer from {seg.peer}"
            if not reply.ok:
                return got, f"{seg.peer} refused: {reply.reason}"
            if reply.pages <= 0:
                return got, f"{seg.peer} holds none of pages {seg.start}..{seg.end} on host"
            try:
                if len(reply.shards) != self.ranks:  # (the peer checks it too)
                    return got, (f"{seg.peer} serves {len(reply.shards)} TP shard(s), this "
                                 f"engine has tp={self.ranks}")
                shard = reply.shards[self.rank]
                lo = (seg.start - pull.local_pages) * P
                local = pull.slots[lo: lo + reply.pages * P]
                la, ra, ln = transfer_chunks(self.layout, shard.layout, local, reply.slots)
                rc = self.engine.engine.batch_transfer_sync_read(shard.session, la, ra, ln)
            finally:
                self._send(seg.peer, Release(reply.lease))
            if rc != 0:
                return got, f"mooncake read from {shard.session} failed (rc={rc})"
            got += reply.pages
            if reply.pages < seg.pages:
                return got, ""
        return got, ""

    def _sock(self, peer: str) -> zmq.Socket:
        s = self._socks.get(peer)
        if s is None:
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{peer}")
            self._socks[peer] = s
        return s

    def _send(self, peer: str, msg: Any) -> None:
        self._sock(peer).send_multipart([b"", pool_encoder.encode(msg)])

    def _ask(self, peer: str, msg: LeaseRequest) -> LeaseReply | None:
        s = self._sock(peer)
        s.send_multipart([b"", pool_encoder.encode(msg)])
        if not s.poll(self.timeout_ms):
            # A late answer must not be read as the next one: drop the socket.
            s.close()
            self._socks.pop(peer, None)
            return None
        frames = s.recv_multipart()
        reply = pool_decoder.decode(frames[-1])
        return reply if isinstance(reply, LeaseReply) else None
