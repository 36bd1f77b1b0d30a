"""An operator cordons a node for maintenance: no new work goes there, its queued prefills
go elsewhere, what runs there finishes, the planner splits the other nodes; uncordoned, it
takes work again."""

import asyncio

import pytest

from tests.api.conftest import body, eventually

CHAT = "/v1/chat/completions"


def spy_nodes(service) -> list:
    """The node of each prefill order the service sends, from now on."""
    nodes = []
    for name, d in service.drivers.items():
        def spy(order, _f=d.submit_prefill, _n=name):
            nodes.append(_n)
            return _f(order)
        d.submit_prefill = spy
    return nodes


async def ask(client, text: str = "hi", tokens: int = 4):
    return await client.post(CHAT, data=body(model="evinfra-fake", max_tokens=tokens,
                                             messages=[{"role": "user", "content": text}]))


async def cordon(client, node: str, action: str = "cordon", force: bool = False) -> dict:
    r = await client.post(f"/v1/evinfra/nodes/{node}/{action}" + ("?force=true" if force else ""))
    assert r.status == 200, await r.text()
    return await r.json()


async def test_a_cordoned_node_gets_no_work_until_uncordoned(client, service):
    nodes = spy_nodes(service)
    view = await cordon(client, "n0")
    assert view["cordoned"] and view["withdrawn"] == 0
    for i in range(8):
        assert (await ask(client, f"q{i}")).status == 200
    assert len(nodes) == 8 and "n0" not in nodes
    status = await (await client.get("/v1/evinfra/status")).json()
    assert status["nodes"]["n0"]["cordoned"] is True
    # The planner's next decision splits the other nodes (it reads the router's loads).
    assert [x.serving for x in service.router.loads(0.0)] == [False, True, True, True]
    metrics = (await (await client.get("/metrics")).read()).decode()
    assert 'evinfra_node_routable{node="n0"} 0.0' in metrics
    assert 'evinfra_node_routable{node="n1"} 1.0' in metrics
    # Back in: with the others out, it takes everything.
    assert not (await cordon(client, "n0", "uncordon"))["cordoned"]
    for n in ("n1", "n2", "n3"):
        await cordon(client, n)
    nodes.clear()
    assert (await ask(client)).status == 200
    assert nodes == ["n0"]
    # The last routable node: refused with the reason, and nothing changed ...
    r = await client.post("/v1/evinfra/nodes/n0/cordon")
    error = (await r.json())["error"]
    assert r.status == 409 and error["code"] == "last_routable_node", error
    assert "no routable prefill node" in error["message"] and error["param"] == "node"
    assert (await ask(client)).status == 200 and nodes == ["n0", "n0"]
    r = await client.post("/v1/evinfra/nodes/n0/cordon?force=maybe")
    assert r.status == 400 and (await r.json())["error"]["param"] == "force"
    # ... unless forced. Every node out: a request has nowhere to go, and the service is
    # not ready.
    await cordon(client, "n0", force=True)
    r = await ask(client)
    assert r.status == 503 and "cordoned" in (await r.json())["error"]["message"]
    assert (await client.get("/ready")).status == 503


@pytest.mark.parametrize("config_overrides", [{"fake": {"c1": 2e-4}}])  # 0.2 s per 1K tokens
async def test_queued_prefills_leave_a_cordoned_node_and_all_finish(client, service,
                                                                    config_overrides):
    for n in ("n1", "n2", "n3"):
        await cordon(client, n)
    nodes = spy_nodes(service)
    asks = [asyncio.ensure_future(ask(client, f"{i} " + "x" * 1500)) for i in range(6)]
    assert await eventually(lambda: len(nodes) == 6)
    for n in ("n1", "n2", "n3"):
        await cordon(client, n, "uncordon")
    view = await cordon(client, "n0")
    assert view["withdrawn"] >= 3, view  # one runs, the others wait behind it
    assert [r.status for r in await asyncio.gather(*asks)] == [200] * 6
    assert nodes[:6] == ["n0"] * 6 and len(nodes) == 6 + view["withdrawn"]
    assert "n0" not in nodes[6:]


async def test_cordon_bad_requests(client):
    r = await client.post("/v1/evinfra/nodes/zz/cordon")
    assert r.status == 404 and (await r.json())["error"]["param"] == "node"
    assert (await client.post("/v1/evinfra/nodes/n0/reboot")).status == 404
    assert (await client.get("/v1/evinfra/nodes/n0/cordon")).status == 405


@pytest.mark.parametrize("config_overrides", [{"server": {"admin_key": "k2"}}])
async def test_cordoning_needs_the_admin_key(client):
    assert (await client.post("/v1/evinfra/nodes/n0/cordon")).status == 401
    r = await client.post("/v1/evinfra/nodes/n0/cordon", headers={"Authorization": "Bearer k2"})
    assert r.status == 200
