"""An agent over HTTP: five appended requests, a fork, a sub-agent, a compaction and branch
ends leave the directory's counts exactly as Algorithm E.2 says (checked in-process)."""

import asyncio

import numpy as np
import pytest

from evinfra.api.tokenizer import ByteTokenizer
from evinfra.core.events import RequestDone

TOK = ByteTokenizer()
rng = np.random.default_rng(7)


def words(n: int) -> list[int]:
    return rng.integers(97, 123, size=n).tolist()  # lowercase letters as byte tokens


async def complete(client, prompt, branch, parent=None, final=False, max_tokens=16):
    headers = {"X-Evinfra-Branch-Id": branch}
    if parent:
        headers["X-Evinfra-Parent-Branch-Id"] = parent
    if final:
        headers["X-Evinfra-Branch-Final"] = "true"
    r = await client.post("/v1/completions", json={"model": "evinfra-fake", "prompt": prompt,
                                                  "max_tokens": max_tokens, "ignore_eos": True},
                          headers=headers)
    assert r.status == 200, await r.text()
    out = await r.json()
    return prompt + TOK.encode(out["choices"][0]["text"]).tolist(), out["usage"]


def expected_counts(service, last):
    """E.2 once every move settled: each active branch counts the blocks of its last path on
    the node(s) of its last request (collocated: prefill and decode on one node)."""
    want = {}
    for branch, (node, tokens) in last.items():
        for h in service.directory.branches.hasher.hash(np.asarray(tokens, np.uint32)).hashes:
            want[h, node] = want.get((h, node), 0) + 1
    return want


def actual_counts(service):
    d = service.directory
    return {(h, n): r for n in d.nodes for h, r in d.branches.counts(d.index(n)).items()}


async def test_agent_scenario_counts(client, service):
    done = {}
    service.bus.subscribe(RequestDone, lambda r: done.__setitem__(r.branch, r))
    last = {}  # branch -> (node of its last request, its input tokens)

    def note(branch, prompt):
        rec = done[branch]
        assert rec.prefill_node == rec.decode_node  # collocated warm-up
        last[branch] = (rec.prefill_node, prompt)

    system = words(700)
    ctx = system + words(300)
    cached = []
    for step in range(5):  # five appended requests
        prompt = ctx
        ctx, usage = await complete(client, prompt, "main")
        note("main", prompt)
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
        ctx = ctx + words(150)
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])

    fork_prompt = ctx + words(40)  # a fork: a new branch on the same context
    await complete(client, fork_prompt, "fork", parent="main")
    note("fork", fork_prompt)
    assert actual_counts(service) == expected_counts(service, last)
    # A sub-agent: a fresh context, parallel; its last request ends it.
    await complete(client, words(500), "sub", parent="main", final=True)
    assert "sub" not in service.directory.branches
    assert actual_counts(service) == expected_counts(service, last)

    compacted = system + words(200)  # compaction: system prompt + summary
    await complete(client, compacted, "main")
    note("main", compacted)
    assert service.directory.branches.version("main") == 2

    r = await client.post("/v1/branches/fork/end")
    assert r.status == 200
    del last["fork"]
    assert actual_counts(service) == expected_counts(service, {"main": last["main"]})
    r = await client.post("/v1/branches/main/end")
    assert r.status == 200
    assert actual_counts(service) == {}
    assert len(service.directory.branches) == 0


@pytest.mark.parametrize("config_overrides", [{"fake": {"d0": 0.02}}])
async def test_a_final_request_ends_its_branch_after_the_branch_s_other_requests(client,
                                                                                service):
    """Parallel calls on one branch: the one flagged final finishes first; the branch (and its
    counts) lives until the other is done, and then it ends."""
    prompt = "a shared agent context " * 10

    async def call(text, max_tokens, **headers):
        return await client.post("/v1/completions", json={
            "model": "evinfra-fake", "prompt": text, "max_tokens": max_tokens,
            "ignore_eos": True}, headers={"X-Evinfra-Branch-Id": "par", **headers})

    long = asyncio.ensure_future(call(prompt + "think long", 40))
    await asyncio.sleep(0.1)
    short = await call(prompt + "answer", 1, **{"X-Evinfra-Branch-Final": "true"})
    assert short.status == 200
    assert not long.done() and "par" in service.directory.branches
    r = await long
    assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 40
    assert "par" not in service.directory.branches
    assert service.bus.errors == 0 and service.counters.ok == 2
