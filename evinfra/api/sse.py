"""A streamed answer of server-sent events: :class:`EventStream`, and :func:`sse_event`.

Each write to a client's socket is a syscall, and on loopback the kernel runs the reader's
side of TCP in it too: tens of µs of the server's CPU (``bench.api``'s floor: a bare aiohttp
server's CPU per answer grows by some 20 µs per write). So a stream writes what it has
ready in one write: its headers leave with its first events, and events made together (a
request's last tokens, its finish, usage and ``[DONE]``; or outputs that queued up while the
loop was busy) leave together, with the end of the body when that follows. No event waits
for an output that has not arrived: the stream still goes out as the tokens come.
"""

from __future__ import annotations

from typing import Callable

import msgspec
from aiohttp import web

__all__ = ["EventStream", "sse_event"]


class EventStream(web.StreamResponse):
    """A ``text/event-stream`` answer. ``ready()`` says whether the handler can make more
    events without waiting (an output is queued, or the requests are over); while it can,
    :meth:`send` holds what it is given, to be written with what follows."""

    _send_headers_immediately = False
    """aiohttp's switch (``web.Response`` sets it so too): the headers wait for the first
    write and go out in it."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        super().__init__(headers={"Content-Type": "text/event-stream",
                                  "Cache-Control": "no-cache"})
        self._ready = ready
        self._held: list[bytes] = []

    async def send(self, data: bytes) -> None:
        if data:
            self._held.append(data)
        if self._held and not self._ready():
            held, self._held = self._held, []
            await self.write(held[0] if len(held) == 1 else b"".join(held))

    async def end(self) -> None:
        """What is held and the end of the body, in one write."""
        held, self._held = b"".join(self._held), []
        await self.write_eof(held)


def sse_event(event: dict) -> bytes:
    """A server-sent event named by its ``type``, as Anthropic's and the Responses API's
    streams write them."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
