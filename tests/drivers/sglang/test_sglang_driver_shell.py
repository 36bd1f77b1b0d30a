"""The driver's I/O shell against a scripted fake SGLang HTTP server (no engine needed):
refusals, streams, withdrawals and a dying engine become the right bus events."""

import asyncio
import contextlib
import json

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from evinfra.api.metrics import Metrics
from evinfra.core.bus import Bus
from evinfra.core.clock import WallClock
from evinfra.core.contracts import DecodeOrder, HintDelta, PrefillOrder, Sampling
from evinfra.core.events import (END_SEQ, AllBlocksCleared, BlockStored, IterationReport,
                                 KVEventBatch, NodeDown, NodeState, NodeUp, PhaseSwitched,
                                 PrefillDone, PrefillItem, PrefillStarted, RequestFailed,
                                 TokensOut, Withdrawn, encode_frames)
from evinfra.core.types import Phase, Tier
from evinfra.drivers.sglang.driver import DriverSettings, SGLangDriver
from evinfra.drivers.sglang.pairs import PairBook
from evinfra.errors import ConfigError

from test_sglang_wire import LOADS, PATCH_INFO, SERVER_INFO

FAST = DriverSettings(poll_interval_s=0.05, down_after_s=0.3, discovery_timeout_s=2.0,
                      finish_wait_s=0.5, rejoin_interval_s=0.1)


class FakePublisher:
    """An SGLang KV event publisher on loopback: batches numbered from 0 on a PUB socket, and
    a ROUTER that replays the last ``keep`` of them (SGLang's ``buffer_steps``)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.sent: list[list[bytes]] = []
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in (self._pub, self._router)]
        self.descriptor = {"publisher": "zmq", "endpoint_port_base": ports[0], "block_size": 4,
                           "replay_endpoint_port_base": ports[1]}
        self._task = asyncio.get_running_loop().create_task(self._replays())

    async def publish(self, *events) -> None:
        frames = encode_frames(b"", len(self.sent), KVEventBatch(0.0, list(events)))
        self.sent.append(frames)
        await self._pub.send_multipart(frames)

    async def _replays(self) -> None:
        while True:
            peer, _, start = await self._router.recv_multipart()
            first = max(int.from_bytes(start, "big", signed=True), len(self.sent) - self.keep)
            for frames in self.sent[first:]:
                await self._router.send_multipart([peer, b"", *frames])
            await self._router.send_multipart(
                [peer, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._task.cancel()
        self._ctx.destroy(linger=0)


class FakeEngine:
    def __init__(self, role: str, patch: dict | None = None,
                 kv: FakePublisher | None = None) -> None:
        self.role = role
        self.patch = patch
        self.kv = kv
        self.generate = None  # async handler(request, body) -> response
        self.hints = None  # async handler(request, body) -> response; the patch's route
        self.kv_resync = None  # async handler(request) -> response; the patch's route
        self.loads = json.loads(json.dumps(LOADS))  # what /v1/loads answers
        self.passes: list[dict] = []  # the patch's iteration log (GET /evinfra/iterations)
        self.passes_asked: list[int] = []
        self.aborted: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> None:
        app = web.Application()
        info = {**SERVER_INFO, "kv_events": self.kv.descriptor if self.kv else None,
                "disaggregation_mode": self.role}
        if self.patch is not None:
            info["evinfra_engine_patch"] = self.patch
            info["evinfra_count_hints"] = "/evinfra/hints"

        def answer(body):
            async def handler(request):
                return web.json_response(body)
            return handler

        app.router.add_get("/server_info", answer(info))
        app.router.add_get("/model_info", answer({"disaggregation_mode": self.role,
                                                  "served_model_name": "m"}))
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/pd_role_switch", self._switch)
        app.router.add_get("/evinfra/status", self._status)
        app.router.add_post("/evinfra/hints", self._hints)
        app.router.add_post("/evinfra/kv_resync", self._kv_resync)
        app.router.add_get("/evinfra/iterations", self._iterations)
        # A stopped engine drops its open streams at once (no graceful wait for handlers).
        self.runner = web.AppRunner(app, shutdown_timeout=0.05)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _generate(self, request):
        return await self.generate(request, await request.json())

    async def _hints(self, request):
        return await self.hints(request, await request.json())

    async def _loads(self, request):
        return web.json_response(self.loads)

    async def _kv_resync(self, request):
        return await self.kv_resync(request)

    async def _iterations(self, request):
        after = int(request.query["after"])
        self.passes_asked.append(after)
        return web.json_response({"last": self.passes[-1]["seq"] if self.passes else -1,
                                  "records": [p for p in self.passes if p["seq"] > after]})

    async def _switch(self, request):
        await asyncio.sleep(getattr(self, "switch_delay_s", 0.0))  # a patched engine drains
        self.role = (await request.json())["new_role"]
        self.switches = getattr(self, "switches", 0) + 1
        return web.json_response({"success": True, "message": "ok"})

    async def _status(self, request):
        if self.patch is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        rec = {"drain_s": 0.5, "rebuild_s": 0.1, "switch_s": 0.6}
        return web.json_response({"switch": {"history": [rec]}})

    async def _abort(self, request):
        self.aborted.append((await request.json())["rid"])
        return web.Response()

    async def stop(self) -> None:
        await self.runner.cleanup()


async def sse(request, chunks):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for c in chunks:
        await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
        await asyncio.sleep(0.01)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def meta(n, finish=None, cached=0):
    return {"finish_reason": finish, "prompt_tokens": 9, "completion_tokens": n,
            "cached_tokens": cached}


@pytest.fixture(params=[False])
async def cluster(request):
    bus, events = Bus(), []
    for t in (PhaseSwitched, PrefillStarted, PrefillDone, TokensOut, RequestFailed, Withdrawn,
              NodeDown, NodeUp, NodeState, IterationReport):
        bus.subscribe(t, events.append)
    patched = request.param
    p = FakeEngine("prefill", {**PATCH_INFO, "pool": "127.0.0.1:6001"} if patched else None)
    d = FakeEngine("decode", {**PATCH_INFO, "pool": "127.0.0.1:6002"} if patched else None)
    await p.start()
    await d.start()
    pairs = PairBook()
    drivers = {n: SGLangDriver(n, e.url, WallClock(), bus, pairs, 4, FAST)
               for n, e in (("p", p), ("d", d))}
    for drv in drivers.values():
        await drv.start()
    yield drivers, {"p": p, "d": d}, events
    for drv in drivers.values():
        await drv.stop()
    for e in (p, d):
        await e.stop()


def of(events, t, **kw):
    return [e for e in events if isinstance(e, t) and all(getattr(e, k) == v for k, v in kw.items())]


async def until(pred, timeout=3.0):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


ORDER = PrefillOrder("r1", np.arange(3, 12, dtype=np.uint32), [], [], Sampling(max_tokens=3))


async def test_a_pd_pair_streams_tokens_and_reports_the_prefill(cluster):
    drivers, engines, events = cluster
    assert {e.node: e.phase for e in of(events, PhaseSwitched)} == {"p": "prefill", "d": "decode"}
    rooms = []

    async def prefill(request, body):
        rooms.append((body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]))
        return await sse(request, [{"output_ids": [7], "meta_info": meta(1, {"type": "length"}, 4)}])

    async def decode(request, body):
        rooms.append((body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]))
        return await sse(request, [{"output_ids": [7], "meta_info": meta(1)},
                                   {"output_ids": [7, 8], "meta_info": meta(2)},
                                   {"output_ids": [7, 8, 9], "meta_info": meta(3, {"type": "length"})}])

    engines["p"].generate, engines["d"].generate = prefill, decode
    drivers["p"].submit_prefill(ORDER)
    await until(lambda: of(events, PrefillStarted))
    drivers["d"].submit_decode(DecodeOrder("r1", "p", ORDER.tokens, [], ORDER.sampling))
    await until(lambda: of(events, TokensOut, finish="length"))
    assert rooms[0] == rooms[1] and rooms[0][:2] == ("127.0.0.1", 44321)
    assert [t for e in of(events, TokensOut) for t in e.tokens] == [7, 8, 9]
    done = of(events, PrefillDone)[0]
    assert (done.cached, done.computed) == (4, 5)
    assert events.index(done) < events.index(of(events, TokensOut, finish="length")[0])
    assert of(events, NodeState)  # the loads poller reports


async def test_a_refused_prefill_has_not_started_and_says_why(cluster):
    drivers, engines, events = cluster

    async def refuse(request, body):
        return web.json_response({"error": {"message": "server overloaded"}}, status=503)

    engines["p"].generate = refuse
    drivers["p"].submit_prefill(ORDER)
    await until(lambda: of(events, RequestFailed))
    f = of(events, RequestFailed)[0]
    assert f.started is False and "HTTP 503: server overloaded" in f.error
    assert not of(events, PrefillStarted)


async def test_withdraw_before_the_engine_accepts(cluster):
    drivers, engines, events = cluster
    hold = asyncio.Event()

    async def slow(request, body):
        await hold.wait()
        return web.Response()

    engines["p"].generate = slow
    drivers["p"].submit_prefill(ORDER)
    await asyncio.sleep(0.1)
    drivers["p"].withdraw("r1")
    await until(lambda: of(events, Withdrawn))
    await until(lambda: engines["p"].aborted)
    hold.set()
    await asyncio.sleep(0.1)
    assert not of(events, RequestFailed) and not of(events, PrefillStarted)


async def test_an_engine_that_dies_mid_stream_fails_its_requests_and_goes_down(cluster):
    drivers, engines, events = cluster

    async def accept_then_hang(request, body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(30)
        return resp

    engines["p"].generate = accept_then_hang
    drivers["p"].submit_prefill(ORDER)
    await until(lambda: of(events, PrefillStarted))
    await engines["p"].stop()  # the engine is gone: its connections close, its port refuses
    await until(lambda: of(events, NodeDown, node="p"))
    await until(lambda: of(events, RequestFailed))
    f = of(events, RequestFailed)[0]
    assert f.node == "p" and f.started is True and f.error.startswith("p: ")
    assert not drivers["p"].healthy() and drivers["d"].healthy()
    # A later order on the dead node fails at once, as not started (the service may reroute).
    events.clear()
    drivers["p"].submit_prefill(PrefillOrder("r2", ORDER.tokens, [], [], ORDER.sampling))
    await until(lambda: of(events, RequestFailed))
    assert of(events, RequestFailed)[0].started is False
    engines["p"].runner = web.AppRunner(web.Application())  # for the fixture's cleanup
    await engines["p"].runner.setup()


async def test_a_restarted_engine_rejoins(cluster):
    """A down engine is looked for again: once it answers (restarted) the node is up, in
    the role the engine reports, and serves requests."""
    drivers, engines, events = cluster
    port = int(engines["p"].url.rsplit(":", 1)[1])
    await engines["p"].stop()
    await until(lambda: of(events, NodeDown, node="p"))
    await asyncio.sleep(0.3)  # a few looks at a dead port
    assert not of(events, NodeUp)
    events.clear()
    engines["p"].role = "decode"  # relaunched in the other role
    await engines["p"].start(port)
    await until(lambda: of(events, NodeUp, node="p"))
    await until(lambda: of(events, PhaseSwitched, node="p"))
    assert events.index(of(events, NodeUp)[0]) < events.index(of(events, PhaseSwitched)[0])
    assert of(events, PhaseSwitched, node="p")[0].phase == "decode"
    assert drivers["p"].healthy()
    await until(lambda: of(events, NodeState, node="p"))  # polled again

    async def prefill(request, body):
        return await sse(request, [{"output_ids": [7], "meta_info": meta(1, {"type": "length"})}])
    engines["p"].generate = prefill
    drivers["p"].submit_prefill(PrefillOrder("r3", ORDER.tokens, [], [], ORDER.sampling))
    await until(lambda: of(events, PrefillDone, request="r3"))


@pytest.mark.parametrize("cluster", [False, True], indirect=True, ids=["stock", "patched"])
async def test_a_fetch_plan_goes_to_a_patched_engine_only(cluster):
    """A patched prefill engine gets the plan in ``kv_hints`` (peers named by their pool
    servers) and reports what it fetched; a stock one gets no plan."""
    from evinfra.core.contracts import FetchRun

    drivers, engines, events = cluster
    patched = engines["p"].patch is not None
    bodies = []
    details = {"device": 8, "host": 0, "evinfra_fetched": 8, "evinfra_restored": 8,
               "evinfra_fetch_s": 0.0071}

    async def prefill(request, body):
        bodies.append(body)
        m = {**meta(1, {"type": "length"}, 8), "cached_tokens_details": details}
        return await sse(request, [{"output_ids": [7], "meta_info": m}])

    engines["p"].generate = prefill
    order = PrefillOrder("r1", ORDER.tokens, [11, 12], [FetchRun("d", 0, [11, 12])],
                         ORDER.sampling, cached_tokens=8)
    drivers["p"].submit_prefill(order)
    await until(lambda: of(events, PrefillDone))
    done = of(events, PrefillDone)[0]
    if patched:
        plan = bodies[0]["kv_hints"]["actions"][0]
        assert plan["action_type"] == "evinfra.fetch"
        assert plan["payload"] == {"page_size": 4, "runs": [
            {"peer": "127.0.0.1:6002", "start": 0, "blocks": [11, 12]}]}
        assert drivers["p"].stats["fetch_plans_sent"] == 1
    else:
        assert "kv_hints" not in bodies[0]
        assert drivers["p"].stats["fetch_plans_ignored"] == 1
    # Whatever the engine says it pulled, and how long the pull took, is reported (a stock
    # engine never says it).
    assert (done.cached, done.fetched, done.fetch_s) == (8, 8, 0.0071)


@pytest.mark.parametrize("cluster", [True], indirect=True, ids=["patched"])
async def test_an_in_place_switch_does_not_wait_for_a_cache_clear(cluster):
    """A patched engine keeps its cache: the driver publishes ``PhaseSwitched`` as soon as
    the switch call returns, without the stock engine's wait for ``AllBlocksCleared``."""
    from evinfra.core.types import Phase

    drivers, engines, events = cluster
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    drivers["p"].switch_phase(Phase.DECODE)
    await until(lambda: of(events, PhaseSwitched, node="p", phase="decode"))
    assert loop.time() - t0 < FAST.clear_wait_s / 2
    assert engines["p"].switches == 1 and drivers["p"].stats["switches"] == 1


@pytest.mark.parametrize("advertised", [1.0, None], ids=["drain-limit", "no-drain-limit"])
async def test_the_driver_waits_for_a_switch_as_long_as_the_engine_may_drain(advertised):
    """A patched engine that drains 0.6 s, with the driver's own switch timeout at 0.3 s: the
    driver waits the drain limit the engine advertises plus that timeout, and the node
    switches; an engine that advertises none (control) is marked down mid-switch."""
    bus, events = Bus(), []
    for t in (PhaseSwitched, NodeDown):
        bus.subscribe(t, events.append)
    info = {**PATCH_INFO, "drain_timeout_s": advertised}
    engine = FakeEngine("prefill", info)
    engine.switch_delay_s = 0.6
    await engine.start()
    driver = SGLangDriver("p", engine.url, WallClock(), bus, PairBook(), 4,
                          msgspec.structs.replace(FAST, switch_timeout_s=0.3))
    await driver.start()
    try:
        driver.switch_phase(Phase.DECODE)
        await until(lambda: of(events, PhaseSwitched, phase="decode") or of(events, NodeDown))
        if advertised is None:
            assert of(events, NodeDown, node="p")
            assert not of(events, PhaseSwitched, phase="decode")
        else:
            assert of(events, PhaseSwitched, node="p", phase="decode")
            assert not of(events, NodeDown)
    finally:
        await driver.stop()
        await engine.stop()


def test_the_switch_wait_covers_the_advertised_drain_limit():
    from evinfra.drivers.sglang.driver import switch_wait_s
    from evinfra.engine_patch.settings import PatchSettings
    from evinfra.engine_patch.wire import DRAIN_TIMEOUT_S

    s = DriverSettings()
    drain = PatchSettings.from_env({}).drain_timeout_s
    assert drain == DRAIN_TIMEOUT_S  # one source: the engine's default is the wire's
    assert switch_wait_s(s, drain) == drain + s.switch_timeout_s > drain
    assert switch_wait_s(s, None) == s.switch_timeout_s  # stock: no drain, one timeout
    custom = PatchSettings.from_env({"EVINFRA_DRAIN_TIMEOUT_S": "900"}).drain_timeout_s
    assert switch_wait_s(s, custom) >= 900


async def test_an_engine_still_starting_is_waited_for_and_the_wait_is_said_once(
        unused_tcp_port, logs):
    """An engine that answers only after a while (loading weights): the start waits for
    it, and one log line says what it waits for, not one per poll."""
    engine = FakeEngine("prefill")
    url = f"http://127.0.0.1:{unused_tcp_port}"
    driver = SGLangDriver("p", url, WallClock(), Bus(), PairBook(), 4, FAST)
    start = asyncio.ensure_future(driver.start())
    await asyncio.sleep(0.8)
    assert not start.done()
    await engine.start(unused_tcp_port)
    await asyncio.wait_for(start, 3.0)
    waits = [e for e in logs if e["event"] == "sglang_engine_waiting"]
    assert len(waits) == 1 and waits[0]["url"] == url and "unreachable" in waits[0]["reason"]
    assert driver.phase is Phase.PREFILL
    await driver.stop()
    await engine.stop()


async def test_node_urls_must_be_http_base_urls():
    from evinfra.config import parse_config
    from evinfra.control import Service

    config = parse_config({"cluster": {"driver": "sglang", "initial_prefill": 1, "nodes": [
        {"name": "a", "url": "localhost:30000"}, {"name": "b", "url": "http://127.0.0.1:1"}]}})
    with pytest.raises(ConfigError, match=r"\['localhost:30000'\] are not http\(s\) base URLs"):
        Service.from_config(config, WallClock())


@contextlib.asynccontextmanager
async def service_over(engines: dict[str, FakeEngine]):
    """The control plane in front of ``engines`` (started here), stopped with them."""
    from evinfra.config import parse_config
    from evinfra.control import Service

    for e in engines.values():
        await e.start()
    config = parse_config({"cluster": {
        "driver": "sglang", "page_size": 4, "initial_prefill": 1,
        "nodes": [{"name": n, "url": e.url} for n, e in engines.items()]}})
    bus, pairs = Bus(), PairBook()
    service = Service(config, WallClock(), bus, {
        n: SGLangDriver(n, e.url, WallClock(), bus, pairs, 4, FAST) for n, e in engines.items()})
    await service.start()
    try:
        yield service
    finally:
        await service.stop()
        for e in engines.values():
            await e.stop()


async def test_the_service_routes_to_a_node_again_once_it_rejoins():
    engines = {"p": FakeEngine("prefill"), "d": FakeEngine("decode")}
    async with service_over(engines) as service:
        port = int(engines["p"].url.rsplit(":", 1)[1])
        await engines["p"].stop()
        await until(lambda: not service.router.node_view("p")["healthy"])
        await engines["p"].start(port)
        await until(lambda: service.router.node_view("p")["healthy"])
        assert service.router.split() == (["p"], ["d"])


@pytest.mark.parametrize("cluster", [True], indirect=True, ids=["patched"])
async def test_count_hints_go_one_at_a_time_and_merge_while_one_is_out(cluster):
    """Hints pushed while a message is out wait, merged (a block's last crossing wins), and
    go next: the engine applies them in the order the directory noted them."""
    drivers, engines, _ = cluster
    got, first = [], asyncio.Event()

    async def slow(request, body):
        got.append(body)
        if len(got) == 1:
            first.set()
            await asyncio.sleep(0.2)  # a later POST, if one were sent, would overtake this
        return web.json_response({"ok": True})

    engines["p"].hints = slow
    drivers["p"].push_hints(HintDelta([1, 2], []))
    await first.wait()
    drivers["p"].push_hints(HintDelta([3], [1]))
    drivers["p"].push_hints(HintDelta([1], [3]))
    await until(lambda: len(got) == 2)
    await asyncio.sleep(0.1)
    assert got == [{"positive": [1, 2], "zero": [], "replace": False},
                   {"positive": [1], "zero": [3], "replace": False}]
    assert drivers["p"].stats["hints_sent"] == 2


@pytest.mark.parametrize("cluster", [True], indirect=True, ids=["patched"])
async def test_count_hints_the_engine_could_not_take_are_sent_again(cluster, logs):
    """An engine not ready (503) gets the hints again, merged with later ones; one that
    refuses a message as malformed (4xx) does not (it would refuse it again)."""
    drivers, engines, _ = cluster
    got, answers = [], [503, 503, 200, 400]

    async def flaky(request, body):
        got.append(body)
        status = answers.pop(0)
        return web.json_response({"error": "engine not ready" if status == 503 else "bad"},
                                 status=status)

    engines["p"].hints = flaky
    drivers["p"].push_hints(HintDelta([1, 2], []))
    await until(lambda: len(got) == 1)
    drivers["p"].push_hints(HintDelta([], [2]))
    await until(lambda: len(got) == 3, timeout=2.0)
    assert got[1:] == [{"positive": [1], "zero": [2], "replace": False}] * 2
    drivers["p"].push_hints(HintDelta([5], []))
    await until(lambda: len(got) == 4)
    await asyncio.sleep(3 * FAST.poll_interval_s)
    assert len(got) == 4 and drivers["p"].stats["hints_refused"] == 1
    assert drivers["p"].stats["hints_retried"] == 2
    failed = [e for e in logs if e["event"] == "sglang_hints_failed"]
    assert len(failed) == 1 and "engine not ready" in failed[0]["error"]  # said once


async def test_an_engine_gets_the_directory_s_marks_in_full_at_start_and_when_back():
    """Engines may hold marks from an earlier control plane, or of counts the directory
    released when they went down: at the service's start and once back, their marks are
    replaced by the directory's."""
    engines = {"p": FakeEngine("prefill", PATCH_INFO), "d": FakeEngine("decode", PATCH_INFO)}
    got: list[dict] = []

    async def take(request, body):
        got.append(body)
        return web.json_response({"ok": True})

    for e in engines.values():
        e.hints = take
    async with service_over(engines) as service:
        await until(lambda: len(got) == 2)
        assert got == [{"positive": [], "zero": [], "replace": True}] * 2
        service.drivers["p"].push_hints(HintDelta([1, 2], []))
        await until(lambda: len(got) == 3)
        port = int(engines["p"].url.rsplit(":", 1)[1])
        await engines["p"].stop()
        await until(lambda: not service.router.node_view("p")["healthy"])
        got.clear()
        await engines["p"].start(port)
        await until(lambda: got)
        assert got == [{"positive": [], "zero": [], "replace": True}]
        # Operators see what the drivers did: in the status and in /metrics.
        await until(lambda: service.drivers["p"].stats["hints_sent"] == 3)
        assert service.status()["nodes"]["p"]["driver"]["hints_sent"] == 3
        text = Metrics(service).render().decode()
        assert 'evinfra_driver_events_total{event="hints_sent",node="p"} 3.0' in text


async def test_a_patched_engine_republishes_its_cache_when_the_view_of_it_broke():
    """A control plane started beside an engine whose replay buffer no longer reaches back to
    its first batch clears its view of the node (never overcount) and asks the engine for a
    KV resync, which comes in the stream: afterwards the directory lists every block the
    engine holds, the ones published before it started included. An engine not ready (503)
    is asked again."""
    kv = FakePublisher(keep=2)
    old = [BlockStored([10 + i], 10 + i - 1 if i else None, [1, 2, 3, 4], 4, medium="GPU")
           for i in range(4)]
    for e in old:  # batches 0..3: only 2 and 3 are still replayable
        await kv.publish(e)
    asked = []

    async def resync(request):
        asked.append(len(kv.sent))
        if len(asked) == 1:
            return web.json_response({"error": "engine not ready"}, status=503)
        chain = BlockStored([10, 11, 12, 13], None, [1, 2, 3, 4] * 4, 4, medium="GPU")
        await kv.publish(AllBlocksCleared(), chain)
        return web.json_response({"ok": True})

    engines = {"p": FakeEngine("prefill", PATCH_INFO, kv),
               "d": FakeEngine("decode", PATCH_INFO)}
    engines["p"].kv_resync = resync

    async def take(request, body):
        return web.json_response({"ok": True})

    for e in engines.values():
        e.hints = take
    try:
        async with service_over(engines) as service:
            p, node = service.drivers["p"], service.directory.index("p")
            tiers = lambda *hs: [service.directory.tree.tiers(h, node) for h in hs]  # noqa
            await until(lambda: p.stats["kv_resync_received"] == 1)
            assert tiers(10, 11, 12, 13) == [{Tier.L1}] * 4
            assert p.stats["kv_resyncs"] == 1 and p.stats["kv_resync_sent"] == 1
            assert p.stats["kv_resync_retried"] == 1 and len(asked) == 2
            assert p._engine_clears == 0  # the resync's AllBlocksCleared is no cache drop
            # The stream goes on from the resync.
            await kv.publish(BlockStored([14], 13, [1, 2, 3, 4], 4, medium="GPU"))
            await until(lambda: tiers(14) == [{Tier.L1}])
            assert p.stats["kv_resyncs"] == 1 and len(asked) == 2
    finally:
        kv.close()


async def test_a_view_lost_mid_run_keeps_the_branches_counts_and_the_engines_marks():
    """A gap in the stream that the replay buffer no longer covers: the directory forgets what
    it lists on the node (never overcount) but no eviction was seen, so a live branch's
    counts there stay, no zero hint goes out, and once the engine's resync (a clear and its
    cache stored again, one batch) comes in the blocks are listed with their counts. An
    engine that started over is another matter: its blocks are gone."""
    kv = FakePublisher(keep=2)
    hints: list[dict] = []

    async def take(request, body):
        hints.append(body)
        return web.json_response({"ok": True})

    engines = {"p": FakeEngine("prefill", PATCH_INFO, kv),
               "d": FakeEngine("decode", PATCH_INFO)}
    for e in engines.values():
        e.hints = take
    try:
        async with service_over(engines) as service:
            p, d = service.drivers["p"], service.directory
            path = d.step("br", list(range(16))).path.hashes
            d.place("br", "p")
            service.engines.flush_hints()
            stored = BlockStored(list(path), None, list(range(16)), 4, medium="GPU")

            async def resync(request):
                await kv.publish(AllBlocksCleared(), stored)
                return web.json_response({"ok": True})

            engines["p"].kv_resync = resync
            # Its subscription is up once its first replay is answered (the SUB socket
            # connects before the replay is asked): from then on no live frame is missed.
            await until(lambda: p._kv is not None and p._kv.stream.next_seq is not None
                        and not p._kv.stream.replaying)
            await kv.publish(stored)
            await until(lambda: d.match(path).own[d.index("p")] == 4)
            for i in range(3):  # published while the driver was not listening
                kv.sent.append(encode_frames(b"", len(kv.sent), KVEventBatch(0.0, [
                    BlockStored([900 + i], None, [1, 2, 3, 4], 4, medium="GPU")])))
            await kv.publish(BlockStored([910], None, [1, 2, 3, 4], 4, medium="GPU"))
            await until(lambda: p.stats["kv_resync_received"] == 1)
            assert p.stats["kv_resyncs"] == 1
            assert d.match(path).own[d.index("p")] == 4
            assert d.branches.counted("br", d.index("p")) == set(path)
            await asyncio.sleep(3 * FAST.poll_interval_s)
            assert not any(set(h["zero"]) & set(path) for h in hints)
            assert any(set(path) <= set(h["positive"]) for h in hints)
            # The control: an engine that started over (its sequence back at 0) did lose its
            # blocks, and their counts go with them.
            kv.sent.clear()
            await kv.publish(BlockStored([920], None, [1, 2, 3, 4], 4, medium="GPU"))
            await until(lambda: not d.branches.counted("br", d.index("p")))
            assert p._kv.stream.stats.restarts == 1 and p.stats["kv_resyncs"] == 2
            await until(lambda: any(set(path) <= set(h["zero"]) for h in hints))
    finally:
        kv.close()


@pytest.mark.parametrize("cluster", [True], indirect=True, ids=["patched"])
async def test_a_patched_engine_s_passes_are_the_planner_s_reports(cluster):
    """Each pass of the engine's own log becomes one report (and only those: the cumulative
    counters of /v1/loads are not read as well), asked for after the last one seen."""
    drivers, engines, events = cluster
    p = engines["p"]
    moments = p.loads["loads"][0]["decode_moments"]  # 5 more decode steps by the counters
    for i, more in ((0, 5), (1, 10), (2, 25000), (5, 10)):
        moments[i] += more
    p.passes += [{"seq": 0, "start": 1.0, "duration": 0.25,
                  "prefill": [["r1-p1", 40, 8, 0], ["r2-p2", 12, 0, 4]]},
                 {"seq": 1, "start": 1.3, "duration": 0.02, "batch": 2, "accepted": 2}]
    await until(lambda: len(of(events, IterationReport, node="p")) == 2)
    first, second = of(events, IterationReport, node="p")
    assert first.prefill == [PrefillItem("r1-p1", 40, 8, 0), PrefillItem("r2-p2", 12, 0, 4)]
    assert first.duration == 0.25 and (second.batch, second.accepted) == (2, 2)
    assert second.start - first.start == pytest.approx(0.3)
    p.passes.append({"seq": 4, "start": 2.0, "duration": 0.1, "batch": 1, "accepted": 1})
    await until(lambda: drivers["p"].stats["iterations_missed"] == 2)
    await until(lambda: p.passes_asked[-1] == 4)
    assert len(of(events, IterationReport, node="p")) == 3
    assert drivers["p"].stats["iteration_reports"] == 3
