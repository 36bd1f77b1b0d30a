"""Engine faults: a crash fails (or re-routes) the node's requests and the service serves on;
a stalled node trips a timeout instead of hanging a client."""

import asyncio

import numpy as np
import pytest

from evinfra.drivers.fake.outputs import OutputPlanner

MODEL = "evinfra-fake"


def engine(service, node):
    return service.fake_cluster.engines[node]


async def completion(client, prompt, max_tokens=8, stream=False, **kw):
    return await client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": stream, **kw})


@pytest.mark.parametrize("config_overrides", [{"fake": {"d0": 0.02}}])
async def test_a_crash_mid_decode_fails_the_request_and_the_rest_keeps_serving(client, service):
    resp = await completion(client, "a long story " * 20, max_tokens=400, stream=True)
    assert resp.status == 200
    await resp.content.readline()  # the first chunk: the request is decoding
    node = next(iter(service.ledger)).decode
    engine(service, node).crash()
    body = (await resp.read()).decode()
    assert '"error"' in body and node in body and body.rstrip().endswith("data: [DONE]")
    d = service.directory
    assert not d.tree.blocks_on(d.index(node))  # the node's KV is gone from the directory
    for i in range(3):
        r = await completion(client, f"still serving {i}")
        assert r.status == 200, await r.text()
        assert (await r.json())["usage"]["completion_tokens"] == 8
    assert node not in {v.prefill for v in service.ledger}


async def test_a_restarted_node_is_routed_to_again(client, service):
    engine(service, "n0").crash()
    r = await completion(client, "while n0 is down")
    assert r.status == 200
    status = await (await client.get("/v1/evinfra/status")).json()
    assert not status["nodes"]["n0"]["healthy"]
    engine(service, "n0").restart()
    status = await (await client.get("/v1/evinfra/status")).json()
    assert status["nodes"]["n0"]["healthy"]
    r = await completion(client, "n0 is back, " * 20)  # all idle: the first node by name
    assert r.status == 200, await r.text()
    d = service.directory
    assert d.tree.held(d.index("n0")) >= 3  # it prefilled: its new KV is in the directory

async def test_a_crash_before_the_prefill_starts_reroutes_the_request(client, service):
    engine(service, "n0").stall()  # the first request goes to n0 (all idle, name order)
    task = asyncio.ensure_future(completion(client, "rerouted please", max_tokens=5))
    for _ in range(100):
        if service.in_flight():
            break
        await asyncio.sleep(0.01)
    (flight,) = service.ledger
    assert flight.prefill == "n0"
    engine(service, "n0").crash()
    resp = await task
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 5
    assert service.counters.rerouted == 1


@pytest.mark.parametrize("config_overrides", [{"server": {"first_token_timeout_s": 0.5}}])
async def test_a_stalled_node_trips_a_timeout(client, service):
    engine(service, "n0").stall()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await completion(client, "stuck")
    assert resp.status == 504
    err = (await resp.json())["error"]
    assert err["type"] == "timeout" and "n0" in err["message"]
    assert loop.time() - t0 < 3
    engine(service, "n0").resume()
    assert (await completion(client, "unstuck")).status == 200


@pytest.mark.parametrize("config_overrides", [{"fake": {"d0": 0.02}}])
async def test_a_client_that_goes_away_mid_stream_aborts_its_request(client, service):
    """The request stops on its engines and is counted as aborted, not as a failure of the
    cluster; the next request is served."""
    resp = await completion(client, "a long story " * 20, max_tokens=400, stream=True)
    assert resp.status == 200
    await resp.content.readline()  # the first chunk: the request is decoding
    resp.close()
    for _ in range(200):
        if not service.in_flight():
            break
        await asyncio.sleep(0.01)
    assert not service.in_flight()
    assert service.counters.aborted == 1 and service.counters.failed == 0
    assert not any(e._decodes or e._prefills for e in service.fake_cluster.engines.values())
    r = await completion(client, "still serving")
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 8
    assert service.counters.ok == 1


STREAMS = {  # a long streamed request per dialect, and what its error event looks like
    "/v1/messages": ({"model": MODEL, "max_tokens": 400, "stream": True,
                      "messages": [{"role": "user", "content": "a long story " * 20}]},
                     "event: error"),
    "/v1/responses": ({"model": MODEL, "max_output_tokens": 400, "stream": True,
                       "input": "a long story " * 20}, "event: error"),
    "/v1/chat/completions": ({"model": MODEL, "max_tokens": 400, "stream": True, "n": 3,
                              "ignore_eos": True,
                              "messages": [{"role": "user", "content": "a long story " * 20}]},
                             '"error"'),
}


@pytest.mark.parametrize("config_overrides", [{"fake": {"d0": 0.02}}])
@pytest.mark.parametrize("path", list(STREAMS))
async def test_a_crash_mid_stream_is_an_error_event_in_every_dialect(client, service,
                                                                     monkeypatch, path):
    monkeypatch.setattr(OutputPlanner, "plan", lambda self, request, sampling: (
        np.full(400, 120, dtype=np.uint32), "length"))  # long, whatever the dialect asks
    body, error = STREAMS[path]
    resp = await client.post(path, json=body)
    assert resp.status == 200
    await resp.content.readline()  # the stream has begun
    node = next(iter(service.ledger)).decode
    engine(service, node).crash()
    text = (await resp.read()).decode()
    assert error in text and node in text
    assert not service.in_flight()  # every choice of the request is over
    r = await completion(client, "still serving")
    assert r.status == 200, await r.text()


@pytest.mark.parametrize("config_overrides", [{"server": {"first_token_timeout_s": 0.5}}])
async def test_a_timeout_in_anthropic_shape(client, service):
    for n in service.fake_cluster.engines:
        engine(service, n).stall()
    resp = await client.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "stuck"}]})
    assert resp.status == 504
    body = await resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "api_error"


async def test_a_request_an_engine_refuses_is_the_clients_error(client, service, monkeypatch):
    """An engine that refuses a request itself (SGLang: a schema its grammar cannot compile,
    an abort with status 400) fails it with a 400 and the engine's reason; it is not routed
    again (every engine would refuse it) and the cluster has not failed."""
    from evinfra.core.events import RequestFailed
    from evinfra.drivers.fake.driver import FakeDriver

    tried = []

    def refuse(self, order):
        tried.append(self.node)
        self.engine.bus.publish(RequestFailed(order.request, self.node, 0.0,
                                              f"{self.node}: unsupported type 'nonsense'",
                                              False, rejected=True))
    monkeypatch.setattr(FakeDriver, "submit_prefill", refuse)
    r = await completion(client, "hello")
    assert r.status == 400
    assert "refused the request" in (err := (await r.json())["error"])["message"]
    assert "nonsense" in err["message"]
    assert len(tried) == 1 and service.counters.rejected == 1
    assert service.counters.failed == service.counters.rerouted == 0
    assert service.in_flight() == 0
