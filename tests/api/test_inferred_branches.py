"""Requests without branch hints (a harness as it ships) join the branch whose last prompt
theirs extends (``evinfra/directory/chains.py``): through the chat and Messages APIs, an agent
loop is one branch from its second turn, a second continuation of one turn forks it, an
unrelated or one-off request holds no count, a compaction that restarts from the branch's
last answer rewrites the branch, a sub-agent whose report its parent takes in ends
(``evinfra/directory/carryover.py``), an idle inferred branch ends, and
``server.infer_branches = false`` leaves each request a branch of one."""

import asyncio
import json

import pytest

MODEL = "evinfra-fake"
SYSTEM = "You are a coding agent. Use the tools to read and edit files. " * 4  # > 2 pages


async def chat(client, messages, max_tokens=8):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True})
    assert r.status == 200, await r.text()
    out = await r.json()
    return messages + [{"role": "assistant", "content": out["choices"][0]["message"]["content"]}]


def tool(messages, result):
    return messages + [{"role": "user", "content": f"tool result: {result} " * 3}]


def inferred(service):
    """The live inferred branches and their requests' branch names, by counting."""
    return {b for b in service.directory.branches.branches() if b in service.chains}


def holds_counts(service):
    d = service.directory
    return any(d.branches.counts(d.index(n)) for n in service.nodes)


async def parent_and_sub_agent(client, service):
    """A parent chain and a sub-agent chain of two requests each (the messages so far and the
    inferred branch of each); the sub-agent's last answer is its report."""
    parent = await chat(client, await chat(client, [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "build it"}]))
    (p,) = inferred(service)
    sub_system = {"role": "system", "content": "You search the code base and report. " * 4}
    sub = await chat(client, [sub_system, {"role": "user", "content": "find the loader"}])
    sub = await chat(client, tool(sub, "grep: config.py"), 100)
    (s,) = inferred(service) - {p}
    return parent, p, sub, s


async def stream_chat(client, messages):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 400, "ignore_eos": True,
        "stream": True})
    assert r.status == 200
    return r


async def test_an_agent_loop_is_one_branch_from_its_second_turn(client, service):
    c = service.counters
    turn = await chat(client, [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "fix the failing test"}])
    # The first request is a branch of one: nothing counted once it is over.
    assert c.requests_chained == 0 and not holds_counts(service)
    turn = await chat(client, tool(turn, "test_x failed: KeyError"))
    assert c.branches_inferred == 1 and c.requests_chained == 1
    (branch,) = inferred(service)
    for i in range(3):
        turn = await chat(client, tool(turn, f"edited file {i}"))
    assert inferred(service) == {branch}  # continued, not forked
    assert c.branches_inferred == 1 and c.requests_chained == 4
    assert any(service.branch_counts(branch).values())  # its KV is counted while it waits
    assert service.directory.branches.version(branch) == 1  # appended only, no rewrite
    r = await client.get("/v1/evinfra/status")
    assert (await r.json())["inferred_branches"] == 1
    r = await client.get(f"/v1/branches/{branch}")
    view = await r.json()
    assert view["inferred"] and sum(view["counted_blocks"].values()) > 0


async def test_a_second_continuation_of_one_turn_forks(client, service):
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "plan"}]
    turn = await chat(client, await chat(client, base))
    (branch,) = inferred(service)
    # Two continuations of the same turn at once (a harness forking its context).
    await asyncio.gather(chat(client, tool(turn, "option a")), chat(client, tool(turn, "b")))
    live = inferred(service)
    assert branch in live and len(live) == 2  # the branch and its fork
    assert service.counters.branches_inferred == 2


async def test_unrelated_requests_hold_no_counts(client, service):
    for i in range(4):
        await chat(client, [{"role": "user", "content": f"question {i}: " + "why? " * 40}])
    assert service.counters.requests_chained == 0
    assert not inferred(service) and not holds_counts(service)
    assert not service.directory.branches.branches()


async def test_a_compaction_without_the_branchs_last_answer_starts_a_new_chain(client, service):
    turn = await chat(client, [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "long task"}])
    turn = await chat(client, tool(turn, "step one done"))
    (old,) = inferred(service)
    # The history is replaced by a summary the harness wrote (not the model's last answer):
    # the prompt extends no earlier request and holds no answer.
    compacted = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "summary of the work so far " * 4}]
    turn = await chat(client, compacted)
    turn = await chat(client, tool(turn, "resumed"))
    live = inferred(service)
    assert old in live and len(live) == 2  # the old chain waits for its idle limit


async def test_a_compaction_that_restarts_from_the_summary_rewrites_the_branch(client, service):
    c = service.counters
    system = {"role": "system", "content": SYSTEM}
    turn = await chat(client, await chat(client, [system, {"role": "user", "content": "task"}]))
    (branch,) = inferred(service)
    # The compaction request continues the branch; its answer is the summary ...
    turn = await chat(client, turn + [{"role": "user", "content": "Summarize."}], 120)
    summary = turn[-1]["content"]
    # ... which the compacted context carries after the same system prompt.
    compacted = [system, {"role": "user", "content": f"Earlier work, summarized:\n{summary}"}]
    turn = await chat(client, compacted)
    assert inferred(service) == {branch} and c.compactions_inferred == 1
    assert service.directory.branches.version(branch) == 2  # E.1: a rewrite
    await chat(client, tool(turn, "resumed"))
    assert inferred(service) == {branch} and service.directory.branches.version(branch) == 2


async def test_a_sub_agents_report_taken_in_by_its_parent_ends_it(client, service):
    c = service.counters
    parent, p, sub, s = await parent_and_sub_agent(client, service)
    report = sub[-1]["content"]
    # A fresh context quoting the report (another system prompt) neither ends nor rewrites.
    await chat(client, [{"role": "user", "content": f"Review this: {report}"}])
    assert inferred(service) == {p, s} and service.directory.branches.version(s) == 1
    # The parent's next prompt takes the report in: the sub-agent is over.
    await chat(client, parent + [{"role": "user", "content": f"Task result: {report}"}])
    assert inferred(service) == {p} and c.branches_joined == 1
    assert s not in service.directory.branches and any(service.branch_counts(p).values())
    r = await client.get("/metrics")
    assert 'evinfra_inferred_branch_events_total{event="branches_joined"} 1.0' in await r.text()


@pytest.mark.parametrize("config_overrides", [{"fake": {"d0": 0.02}}])
async def test_only_a_whole_answer_of_an_idle_branch_ends_it(client, service):
    parent, p, sub, s = await parent_and_sub_agent(client, service)
    report = sub[-1]["content"]
    # The sub-agent goes on: while its request is in flight, its last answer is not its last.
    resp = await stream_chat(client, tool(sub, "more"))
    await resp.content.readline()
    await chat(client, parent + [{"role": "user", "content": f"Task result: {report}"}])
    assert s in inferred(service) and service.counters.branches_joined == 0
    # Cut off mid-answer (the client went away): what it got so far is no answer either.
    text = ""
    while len(text) < 80:
        line = (await resp.content.readline()).decode()
        if line.startswith("data: {"):
            text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    resp.close()
    for _ in range(200):
        if not service.in_flight():
            break
        await asyncio.sleep(0.01)
    assert service.counters.aborted == 1
    await chat(client, parent + [{"role": "user", "content": f"Task result: {text}"}])
    assert s in inferred(service) and service.counters.branches_joined == 0


@pytest.mark.parametrize("config_overrides", [{"server": {"inferred_branch_idle_s": 0.3}}])
async def test_an_idle_inferred_branch_ends_and_its_tip_starts_anew(client, service):
    turn = await chat(client, await chat(client, [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": "go"}]))
    (branch,) = inferred(service)
    await asyncio.sleep(0.7)
    assert branch not in service.directory.branches and not holds_counts(service)
    assert service.counters.branches_expired == 1 and len(service.chains) == 0
    await chat(client, tool(turn, "back after a long pause"))
    (again,) = inferred(service)
    assert again != branch and service.counters.branches_inferred == 2


async def test_hints_win_and_forks_of_n_choices_stay_branches_of_one(client, service):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hinted"}]
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 4}, headers={"X-Evinfra-Branch-Id": "h"})
    assert r.status == 200
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs + [{"role": "user", "content": "more"}],
        "max_tokens": 4, "n": 3})
    assert r.status == 200
    assert service.counters.requests_chained == 0  # hinted tips are not indexed
    assert set(service.directory.branches.branches()) == {"h"}
    r = await client.get("/v1/branches/h")
    assert (await r.json())["inferred"] is False


async def test_messages_api_requests_chain(client, service):
    async def send(messages):
        r = await client.post("/v1/messages", json={
            "model": MODEL, "system": SYSTEM, "messages": messages, "max_tokens": 8})
        assert r.status == 200, await r.text()
        text = "".join(b["text"] for b in (await r.json())["content"] if b["type"] == "text")
        return messages + [{"role": "assistant", "content": text}]

    turn = await send([{"role": "user", "content": "list the files"}])
    for i in range(2):
        turn = await send(turn + [{"role": "user", "content": f"ls output {i} " * 5}])
    assert len(inferred(service)) == 1 and service.counters.requests_chained == 2


@pytest.mark.parametrize("config_overrides", [{"server": {"infer_branches": False}}])
async def test_without_inference_each_request_is_a_branch_of_one(client, service):
    turn = await chat(client, [{"role": "system", "content": SYSTEM},
                               {"role": "user", "content": "go"}])
    await chat(client, tool(turn, "done"))
    assert service.chains is None and service.counters.requests_chained == 0
    assert not service.directory.branches.branches() and not holds_counts(service)
