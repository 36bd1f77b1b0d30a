"""``server.branch_idle_s``: a branch whose harness never reports its end is ended once idle,
and its KV counts are released; a busy or recently active branch is kept."""

import asyncio

import pytest

MODEL = "evinfra-fake"
IDLE = {"server": {"branch_idle_s": 0.3}, "fake": {"d0": 0.02}}


async def send(client, branch, text, max_tokens=2, **headers):
    r = await client.post("/v1/completions", json={
        "model": MODEL, "prompt": text, "max_tokens": max_tokens, "ignore_eos": True},
        headers={"X-Evinfra-Branch-Id": branch, **headers})
    assert r.status == 200, await r.text()


def counted(service, branch):
    return branch in service.directory.branches and any(service.branch_counts(branch).values())


@pytest.mark.parametrize("config_overrides", [IDLE])
async def test_an_idle_branch_is_ended_and_its_counts_released(client, service):
    await send(client, "forgotten", "a prompt long enough to fill some pages " * 8)
    assert counted(service, "forgotten")
    await asyncio.sleep(0.25)
    assert "forgotten" in service.directory.branches  # not idle long enough yet
    await asyncio.sleep(0.3)
    assert "forgotten" not in service.directory.branches
    assert service.counters["branches_expired"] == 1
    d = service.directory
    assert not any(d.branches.counts(d.index(n)) for n in service.nodes)


@pytest.mark.parametrize("config_overrides", [IDLE])
async def test_active_and_running_branches_are_kept(client, service):
    text = "an agent that keeps working "
    for i in range(6):  # a request every 0.1 s for 0.6 s: never idle for 0.3 s
        text += f"step {i} "
        await send(client, "busy", text)
        await asyncio.sleep(0.1)
    assert counted(service, "busy")
    # A request that runs longer than the idle limit (40 decode steps of 20 ms) keeps it too.
    await send(client, "busy", text + "a long answer", max_tokens=40)
    assert counted(service, "busy") and service.counters["branches_expired"] == 0
    await asyncio.sleep(0.6)
    assert "busy" not in service.directory.branches
    assert service.counters["branches_expired"] == 1


@pytest.mark.parametrize("config_overrides", [IDLE])
async def test_a_branch_ended_by_its_harness_is_not_expired_again(client, service):
    await send(client, "done", "one request", **{"X-Evinfra-Branch-Final": "true"})
    await send(client, "ended", "another request")
    r = await client.post("/v1/branches/ended/end")
    assert r.status == 200
    await asyncio.sleep(0.6)
    assert service.counters["branches_expired"] == 0
    assert not service.directory.branches.branches()
