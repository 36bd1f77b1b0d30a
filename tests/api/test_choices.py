"""``n`` > 1: the choices come back whole and streamed (read by the official client); the
forks are sent once choice 0 has prefilled, as branches of one forked from the request's
branch, and reuse its prompt's KV; each choice is read on its own (stop strings, tool calls);
a client that goes away stops them all."""

import asyncio

import msgspec
import pytest

from tests.api.conftest import (body, eventually, model_says, openai_client,
                                spy_prefill_orders, spy_submissions)

CHAT = "/v1/chat/completions"
PROMPT = "".join(chr(33 + i % 90) for i in range(2_000))  # 2,000 byte tokens: 31 full pages


async def test_choices_whole(client, service):
    orders = spy_prefill_orders(service)
    submitted = spy_submissions(service)
    r = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=PROMPT, n=3, max_tokens=40, seed=7,
        extra_headers={"X-Evinfra-Branch-Id": "agent-1"},
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [c.model_extra["token_ids"] for c in r.choices]
    assert len({tuple(i) for i in ids}) == 3  # three samples of 40, not one thrice
    assert r.usage.prompt_tokens == len(PROMPT)  # the prompt counts once
    assert r.usage.completion_tokens == sum(map(len, ids))
    # Choice 0 on the request's branch; the others forks of it, each a branch of one, with
    # their own seeds.
    assert [(s.branch, s.parent, s.final, s.sampling.seed) for s in submitted] == \
        [("agent-1", None, False, 7), (None, "agent-1", True, 8), (None, "agent-1", True, 9)]
    # The forks were sent after choice 0 prefilled, so the router found the prompt's pages.
    assert [o.cached_tokens for o in orders] == [0, 31 * 64, 31 * 64]
    assert service.in_flight() == 0 and "agent-1" in service.directory.branches


async def test_choices_streamed(client, service):
    stream = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=[{"role": "user", "content": PROMPT}], n=3,
        max_tokens=30, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    text, roles, finish, usage = {}, {}, {}, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finish, "a chunk after the choice's finish"
            if c.delta.role:
                roles[c.index] = c.delta.role
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {i: "assistant" for i in range(3)} and set(finish) == {0, 1, 2}
    assert len(set(text.values())) == 3
    assert usage.completion_tokens == sum(len(t.encode()) for t in text.values())


async def test_each_choice_is_read_on_its_own(client, monkeypatch):
    model_says(monkeypatch, 'ab<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>END x')
    oa = openai_client(client)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = await oa.chat.completions.create(model="evinfra-fake", n=2, max_tokens=80,
                                         messages=[{"role": "user", "content": "x"}],
                                         tools=tools, stop=["END"])
    assert [(c.message.content, c.finish_reason) for c in r.choices] == \
        [("ab", "tool_calls")] * 2
    ids = [c.message.tool_calls[0].id for c in r.choices]
    assert ids[0] != ids[1]
    calls: dict[int, list] = {0: [], 1: []}
    async for chunk in await oa.chat.completions.create(
            model="evinfra-fake", n=2, max_tokens=80, stop=["END"], stream=True, tools=tools,
            messages=[{"role": "user", "content": "x"}]):
        for c in chunk.choices:
            calls[c.index] += [(t.index, t.function.name) for t in c.delta.tool_calls or ()]
    assert calls == {0: [(0, "f")], 1: [(0, "f")]}  # call indexes count per choice


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_goes_away_stops_every_choice(client, service, stream):
    seen = []
    submit = service.submit
    service.submit = lambda sub, sink: seen.append(sub) or submit(sub, sink)
    task = asyncio.ensure_future(client.post(CHAT, data=body(
        model="evinfra-fake", messages=[{"role": "user", "content": "x"}], n=3,
        max_tokens=100_000, ignore_eos=True, stream=stream)))
    assert await eventually(lambda: len(seen) == 3 and service.in_flight() == 3)
    if task.done():  # a stream's headers came: drop the connection
        task.result().close()
    else:
        task.cancel()
    assert await eventually(lambda: service.in_flight() == 0)


async def test_n_is_checked(client):
    for n in (0, 129, "2"):
        r = await client.post(CHAT, data=msgspec.json.encode(
            {"model": "evinfra-fake", "messages": [{"role": "user", "content": "x"}], "n": n}))
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"
