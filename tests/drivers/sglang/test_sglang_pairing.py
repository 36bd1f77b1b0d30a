"""A prefill routed again to the node it failed on keeps the room it was given there.

Under load an engine may drop a prefill before accepting it (a keep-alive connection it was
closing, an overloaded answer). The service routes the request again from inside that
failure's event, and with one prefill node it routes it to the same node: a new room is opened
there before the failed leg has ended. The failed leg's end must close its own room, not the
new one, or the decode bound when the new prefill starts finds nothing to pair with (the 502
"no open prefill of this request on a to pair with" of ``test_sglang_serve.py`` under load).
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from evinfra.drivers.sglang.pairs import PairBook
from test_driver_contract import Sink, request
from test_sglang_driver_shell import FakeEngine, meta, service_over, sse, until


def test_a_legs_end_touches_its_own_room_only():
    book = PairBook()
    book.register_engine("p", "10.0.0.1", 8998)
    old = book.open("r", "p", now=0.0)
    new = book.open("r", "p", now=1.0)  # routed again to the same node
    book.prefill_over("r", "p", old.room)
    book.close("r", "p", old.room)
    assert book.find("r", "p") == new
    assert not asyncio.run(book.wait_prefill("r", "p", new.room, 0.05))  # still running
    book.prefill_over("r", "p", new.room)
    assert asyncio.run(book.wait_prefill("r", "p", new.room, 0.05))
    book.close("r", "p", new.room)
    assert book.find("r", "p") is None


async def _drop(request, body):
    """The engine closes the connection before answering."""
    request.transport.close()
    return web.Response()


async def _busy(request, body):
    return web.json_response({"error": {"message": "server overloaded"}}, status=503)


@pytest.mark.parametrize("first", [_drop, _busy], ids=["dropped", "overloaded"])
async def test_a_prefill_routed_again_to_its_only_node_pairs_with_its_decode(first):
    engines = {"p": FakeEngine("prefill"), "d": FakeEngine("decode")}
    rooms = {"p": [], "d": []}

    async def prefill(req, body):
        rooms["p"].append(body["bootstrap_room"])
        if len(rooms["p"]) == 1:
            return await first(req, body)
        return await sse(req, [{"output_ids": [7], "meta_info": meta(1, {"type": "length"})}])

    async def decode(req, body):
        rooms["d"].append(body["bootstrap_room"])
        return await sse(req, [{"output_ids": [7, 8], "meta_info": meta(2)},
                               {"output_ids": [7, 8, 9, 10],
                                "meta_info": meta(4, {"type": "length"})}])

    engines["p"].generate, engines["d"].generate = prefill, decode
    async with service_over(engines) as service:
        await until(lambda: service.router.routable("p") and service.router.routable("d"))
        sink = Sink()
        service.submit(request("r0", n=16), sink)
        await until(lambda: sink.record is not None)
        assert service.counters.rerouted == 1  # the first attempt failed, unaccepted
        assert sink.error is None, sink.error
        assert sink.record.status == "ok" and sink.record.output_tokens == 4
        assert sink.record.reroutes == 1
        assert len(rooms["p"]) == 2 and rooms["d"] == rooms["p"][1:]
