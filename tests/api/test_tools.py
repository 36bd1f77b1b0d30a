"""Tool calling through the chat route: the tools reach the prompt, the model's calls come
back as ``tool_calls`` (whole and streamed, read by the official client), and what cannot be
served is refused."""

import json

import numpy as np
import pytest

from tests.api.conftest import body, model_says, openai_client

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
MSG = [{"role": "user", "content": "what is in a.py?"}]
SAYS = ('Let me read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n'
        '</tool_call>')




@pytest.fixture
def says_calls(monkeypatch):
    model_says(monkeypatch, SAYS)


async def test_calls_come_back_as_tool_calls(client, says_calls):
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MSG, tools=TOOLS, max_tokens=len(SAYS))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me read it."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("function", "read_file", {"path": "a.py"}), ("function", "read_file", {"path": "b.py"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


async def test_streamed_calls_read_the_same(client, says_calls):
    stream = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MSG, tools=TOOLS, max_tokens=len(SAYS), stream=True)
    content, calls, finish = [], {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for c in delta.tool_calls or ():
            got = calls.setdefault(c.index, {"id": c.id, "name": "", "arguments": ""})
            got["name"] += c.function.name or ""
            got["arguments"] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "".join(content) == "Let me read it."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py"})]
    assert sorted(calls) == [0, 1]


async def test_the_tools_and_the_call_history_reach_the_prompt(client, service):
    prompts = []
    for d in service.drivers.values():
        def spy(order, _f=d.submit_prefill):
            prompts.append(bytes(order.tokens.astype(np.uint8)).decode())
            return _f(order)
        d.submit_prefill = spy
    history = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"}]
    r = await client.post(CHAT, data=body(model="evinfra-fake", messages=history, tools=TOOLS,
                                          max_tokens=2))
    assert r.status == 200, await r.text()
    r = await client.post(CHAT, data=body(model="evinfra-fake", messages=MSG, tools=TOOLS,
                                          tool_choice="none", max_tokens=2))
    assert r.status == 200, await r.text()
    with_tools, without = prompts
    assert '"name": "read_file", "description": "Read a file"' in with_tools
    assert '{"name": "read_file", "arguments": {"path": "a.py"}}' in with_tools
    assert "print(1)" in with_tools
    assert "read_file" not in without  # tool_choice "none": the model is not shown the tools


async def test_what_cannot_be_served_is_refused(client):
    async def refused(param, **kw):
        r = await client.post(CHAT, data=body(model="evinfra-fake", max_tokens=2, **kw))
        assert r.status == 400, await r.text()
        err = (await r.json())["error"]
        assert err["param"] == param, err
        return err["message"]

    assert "constrained decoding" in await refused("tool_choice", messages=MSG, tools=TOOLS,
                                                   tool_choice="required")
    await refused("tool_choice", messages=MSG, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "read_file"}})
    await refused("tools[0].function.name", messages=MSG,
                  tools=[{"type": "function", "function": {}}])
    bad = MSG + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    await refused("messages[1].tool_calls", messages=bad)
    # Whatever message carries them (the fuzzed-bodies test found a user's: a 500).
    await refused("messages[0].tool_calls", messages=[{"role": "user", "tool_calls": [None]}])


@pytest.mark.parametrize("config_overrides", [{"model": {"dir": "/models/some-model"}}])
async def test_tools_without_a_parser_are_refused(client, config_overrides):
    """A model dir's tool-call format is not guessed (the built-in model's is hermes)."""
    r = await client.post(CHAT, data=body(model="evinfra-fake", messages=MSG, tools=TOOLS,
                                          max_tokens=2))
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["param"] == "tools" and "model.tool_call_parser" in err["message"]
    r = await client.post(CHAT, data=body(model="evinfra-fake", messages=MSG, tools=TOOLS,
                                          tool_choice="none", max_tokens=2))
    assert r.status == 200, await r.text()


@pytest.mark.parametrize("config_overrides", [{"model": {"dir": "/models/qwen",
                                                         "tool_call_parser": "hermes"}}])
async def test_a_model_dir_with_its_parser_named_serves_tools(client, config_overrides,
                                                              says_calls):
    r = await client.post(CHAT, data=body(model="evinfra-fake", messages=MSG, tools=TOOLS,
                                          max_tokens=len(SAYS)))
    assert r.status == 200, await r.text()
    assert len((await r.json())["choices"][0]["message"]["tool_calls"]) == 2


@pytest.mark.parametrize("config_overrides", [{"model": {"dir": "/models/qwen3-coder",
                                                         "tool_call_parser": "qwen3_coder"}}])
async def test_qwen3_coder_calls_are_typed_by_the_requests_tools(client, config_overrides,
                                                                 monkeypatch):
    model_says(monkeypatch, "<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n"
                            "</parameter>\n<parameter=lines>\n20\n</parameter>\n</function>\n"
                            "</tool_call>")
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"},
                                         "lines": {"type": "integer"}}}}}]
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MSG, tools=tools, max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "read_file"
    assert json.loads(call.function.arguments) == {"path": "a.py", "lines": 20}
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


async def test_parallel_tool_calls_false_returns_the_first_call_only(client, says_calls):
    oa = openai_client(client)
    r = await oa.chat.completions.create(model="evinfra-fake", messages=MSG, tools=TOOLS,
                                         max_tokens=len(SAYS), parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"path": "a.py"}
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content == "Let me read it."
    streamed = []
    async for chunk in await oa.chat.completions.create(
            model="evinfra-fake", messages=MSG, tools=TOOLS, max_tokens=len(SAYS),
            parallel_tool_calls=False, stream=True):
        streamed += chunk.choices[0].delta.tool_calls or []
    assert [(c.index, json.loads(c.function.arguments)) for c in streamed] == \
        [(0, {"path": "a.py"})]
