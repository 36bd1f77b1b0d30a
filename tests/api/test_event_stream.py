"""Streams write what they have ready in one write (``sse.EventStream``): the headers with the
first events, a request's last events with the end of the body; tokens still go out as
they come. Each write the server makes is recorded where aiohttp hands it to the socket."""

from __future__ import annotations

import pytest
from aiohttp import http_writer, web_protocol

from evinfra.api.serving import Finished, Sample, Tokens, output_ready
from evinfra.core.events import RequestDone
from tests.api.conftest import body, model_says

TEXT = "one two three"
SLOW = {"fake": {"d0": 0.005, "d1": 0.0, "d2": 0.0}}  # one token per 5 ms step


@pytest.fixture
def writes(monkeypatch) -> list[bytes]:
    """What the server writes to its sockets, one item per write (aiohttp's writer hands
    each to the transport, which sends it at once)."""
    out: list[bytes] = []
    write, writelines = http_writer.StreamWriter._write, http_writer.StreamWriter._writelines

    def _write(self, chunk) -> None:
        if isinstance(self.protocol, web_protocol.RequestHandler):  # (not the client's)
            out.append(bytes(chunk))
        write(self, chunk)

    def _writelines(self, chunks) -> None:
        chunks = list(chunks)
        if isinstance(self.protocol, web_protocol.RequestHandler):
            out.append(b"".join(chunks))
        writelines(self, chunks)

    monkeypatch.setattr(http_writer.StreamWriter, "_write", _write)
    monkeypatch.setattr(http_writer.StreamWriter, "_writelines", _writelines)
    return out


ROUTES = {
    "/v1/completions": ({"prompt": "hi"}, b"data: [DONE]"),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}]},
                             b"data: [DONE]"),
    "/v1/messages": ({"messages": [{"role": "user", "content": "hi"}]},
                     b"event: message_stop"),
    "/v1/responses": ({"input": "hi"}, b"event: response.completed"),
}


@pytest.mark.parametrize("config_overrides", [SLOW])
@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_stream_writes_what_is_ready_together(client, monkeypatch, writes, route):
    model_says(monkeypatch, TEXT)
    fields, last_event = ROUTES[route]
    r = await client.post(route, data=body(model="evinfra-fake", max_tokens=64, stream=True,
                                           **fields))
    assert r.status == 200
    got = await r.read()
    # The headers leave with the first events (not alone)...
    head, _, first = writes[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert b"data: " in first, writes[0]
    # ...the request's last events with the end of the body...
    assert last_event in writes[-1] and writes[-1].endswith(b"\r\n0\r\n\r\n"), writes[-1]
    # ...and between them the tokens as they came, 5 ms apart, none waiting for the next.
    assert len(writes) >= len(TEXT) // 2, [len(w) for w in writes]
    assert b"".join(writes).count(b"data: ") == got.count(b"data: ")


@pytest.mark.parametrize("config_overrides", [SLOW])
async def test_the_stream_goes_out_as_the_tokens_come(client, service, monkeypatch):
    """The first token's event arrives while the request is still decoding (40 tokens,
    5 ms each)."""
    model_says(monkeypatch, "x" * 40)
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt="hi",
                                                       max_tokens=64, stream=True))
    first = await r.content.readline()
    assert first.startswith(b"data: ") and service.in_flight() == 1
    rest = await r.read()
    assert rest.count(b"data: ") >= 3 and rest.rstrip().endswith(b"data: [DONE]")
    assert service.in_flight() == 0


def _sample(queued: int, over: bool) -> Sample:
    """A choice with ``queued`` outputs waiting to be read; its request ``over`` (its end
    read) or not."""
    s = Sample(0, "r", None)
    if over:
        s.channel.done(RequestDone("r", "b", 0.0, 1.0, "ok", 1, 1), None)
        assert isinstance(s.channel.queue.get_nowait(), Finished)
    for _ in range(queued):
        s.channel.queue.put_nowait(Tokens([1]))
    return s


def test_output_is_ready_when_queued_or_when_every_request_is_over():
    assert not output_ready([_sample(0, False)])
    assert output_ready([_sample(1, False)])
    assert output_ready([_sample(0, True)])
    # One choice over and another still decoding: the next output is not ready (holding
    # the events until all are over would stop the stream).
    assert not output_ready([_sample(0, True), _sample(0, False)])
    assert output_ready([_sample(0, True), _sample(1, False)])
    assert output_ready([_sample(0, True), _sample(0, True)])
