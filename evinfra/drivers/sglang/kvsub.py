"""The async shell around :class:`~evinfra.drivers.sglang.kvstream.KVStream`: one engine's ZMQ
publisher subscribed, its replay ROUTER asked, the resulting batches handed on in order.

Frames (SGLang ``ZmqEventPublisher``): live ``[topic, seq, payload]`` on the PUB socket;
a replay is asked by sending the start sequence (8 bytes, big-endian) to the ROUTER from a
DEALER socket (``[b"", seq]``: the empty frame stands in for REQ's delimiter, and a DEALER,
unlike a REQ socket, can take the many answers of one request). Answers are
``[b"", topic, seq, payload]``, ended by ``[b"", b"", -1, b""]``.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import structlog
import zmq
import zmq.asyncio

from evinfra.core.events import END_SEQ, KVEventBatch, KVEventDecoder
from evinfra.drivers.sglang.kvstream import Action, Clear, Deliver, KVStream, Replay
from evinfra.errors import KVEventDecodeError

__all__ = ["KVSubscriber"]

log = structlog.get_logger(__name__)


class KVSubscriber:
    """Subscribes to ``endpoint``; calls ``deliver(seq, batch)`` in order and ``clear(reason,
    emptied)`` when the node's view must be rebuilt (see ``kvstream``)."""

    def __init__(self, node: str, endpoint: str, replay_endpoint: str | None, topic: str,
                 deliver: Callable[[int, KVEventBatch], None], clear: Callable[[str, bool], None],
                 replay_timeout_s: float = 2.0) -> None:
        self.node = node
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._deliver = deliver
        self._clear = clear
        self.replay_timeout_s = replay_timeout_s
        self.stream = KVStream(replay_available=replay_endpoint is not None)
        self.decoder = KVEventDecoder()
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self._replay_task: asyncio.Task | None = None

    async def run(self) -> None:
        """Read live frames until cancelled."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._sub = sub
        self._act(self.stream.connected())
        try:
            while True:
                frames = await sub.recv_multipart()
                seq, batch = self._decode(frames)
                if seq is None:
                    continue
                self._act(self.stream.live(seq, batch))
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        self._ctx.destroy(linger=0)

    # -- frames --------------------------------------------------------------------------

    def _decode(self, frames: list[bytes]) -> tuple[int | None, KVEventBatch | None]:
        """``(seq, batch)``; batch None when the payload is bad (the sequence still counts,
        so a bad batch is not mistaken for a gap); seq None for a frame we cannot place."""
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("kv_frame_malformed", node=self.node, frames=len(frames))
            return None, None
        seq = int.from_bytes(frames[1], "big", signed=True)
        dropped = self.decoder.dropped_events
        try:
            batch = self.decoder.decode(frames[2])
        except KVEventDecodeError as exc:
            log.warning("kv_batch_malformed", node=self.node, seq=seq, error=exc.message)
            return seq, None
        if self.decoder.dropped_events != dropped:
            log.warning("kv_events_dropped", node=self.node, seq=seq,
                        errors=self.decoder.last_errors[:3])
            return seq, None
        return seq, batch

    def _act(self, actions: list[Action]) -> None:
        for a in actions:
            if type(a) is Deliver:
                self._deliver(a.seq, a.batch)
            elif type(a) is Clear:
                log.warning("kv_view_resync", node=self.node, reason=a.reason)
                self._clear(a.reason, a.emptied)
            elif type(a) is Replay:
                self._spawn(self._replay(a.start))

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _replay(self, start: int) -> None:
        """One replay: a fresh DEALER each time, so a late answer to an abandoned replay can
        never be read as the answer to the next one."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and len(frames[1]) == 8 and \
                        int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    self._act(self.stream.replay_done())
                    return
                seq, batch = self._decode(frames)
                if seq is not None:
                    self._act(self.stream.replayed(seq, batch))
        except asyncio.TimeoutError:
            self._act(self.stream.replay_failed(
                f"no answer from {self.replay_endpoint} within {self.replay_timeout_s:g} s"))
        except zmq.ZMQError as exc:
            self._act(self.stream.replay_failed(f"{self.replay_endpoint}: {exc}"))
        finally:
            dealer.close(linger=0)
