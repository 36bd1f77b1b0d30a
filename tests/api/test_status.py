"""``GET /v1/evinfra/status``: the split as operators read it."""

import asyncio


async def split(client):
    return (await (await client.get("/v1/evinfra/status")).json())["split"]


async def test_the_split_label_says_collocated_during_the_warm_up(client):
    s = await split(client)
    assert s["label"] == "4C" and s["collocated"] == ["n0", "n1", "n2", "n3"]
    metrics = await (await client.get("/metrics")).text()
    assert 'evinfra_split_nodes{phase="collocated"} 4.0' in metrics
    r = await client.post("/v1/evinfra/split", json={"prefill": ["n0", "n1"]})
    assert r.status == 200 and (await r.json())["split"] == "2P2D"
    for _ in range(200):
        s = await split(client)
        if not s["switching"]:
            break
        await asyncio.sleep(0.01)
    assert s["label"] == "2P2D" and s["collocated"] == [] and s["decode"] == ["n2", "n3"]


async def test_metrics_time_per_output_token_and_prefill_queueing(client):
    r = await client.post("/v1/completions", json={"model": "evinfra-fake", "prompt": "hi",
                                                   "max_tokens": 5, "ignore_eos": True})
    assert r.status == 200, await r.text()
    metrics = await (await client.get("/metrics")).text()
    count = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
             if "_count" in line and not line.startswith("#")}
    assert count["evinfra_tpot_seconds_count"] == 1.0
    queued = {k: v for k, v in count.items() if k.startswith("evinfra_prefill_queue_seconds")}
    assert len(queued) == 1 and list(queued.values()) == [1.0]
    assert 'node="n' in next(iter(queued))
