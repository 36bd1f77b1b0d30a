"""Anthropic's Messages API, read by the official ``anthropic`` client: answers whole and
streamed, tool use both ways, stop sequences, thinking, token counts, the prefix reuse in
``usage``, agent hints, and errors in Anthropic's shape."""

import anthropic
import msgspec
import pytest

from evinfra.api.tokenizer import ByteTokenizer
from tests.api.conftest import eventually, model_says

TOOLS = [{"name": "read_file", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
SAYS_CALL = ('Let me read it.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
             '</tool_call>')
USER = [{"role": "user", "content": "what is in a.py?"}]


def anthropic_client(client, key: str = "none") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=key,
                                    max_retries=0)


async def both(client, **kw):
    """The whole answer and the one the client builds from the stream's events."""
    a = anthropic_client(client)
    whole = await a.messages.create(model="evinfra-fake", max_tokens=200, **kw)
    async with a.messages.stream(model="evinfra-fake", max_tokens=200, **kw) as s:
        streamed = await s.get_final_message()
    return whole, streamed


def blocks(m) -> list:
    return [b.model_dump(exclude={"citations", "parsed_output", "caller"}, exclude_none=True)
            for b in m.content]


async def test_text_whole_and_streamed(client, monkeypatch):
    model_says(monkeypatch, "Hello there")
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Be kind."}]
    for m in await both(client, system=system, messages=USER):
        assert blocks(m) == [{"type": "text", "text": "Hello there"}]
        assert (m.role, m.stop_reason, m.stop_sequence) == ("assistant", "end_turn", None)
        assert m.usage.output_tokens == len("Hello there")
        prompt = ByteTokenizer().apply_chat_template(
            [{"role": "system", "content": "You are terse.\nBe kind."}, *USER])
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt.encode())


async def test_stop_sequences(client, monkeypatch):
    model_says(monkeypatch, "abcEND more")
    for m in await both(client, messages=USER, stop_sequences=["zz", "END"]):
        assert blocks(m) == [{"type": "text", "text": "abc"}]
        assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "END")


async def test_max_tokens(client):
    # (A fake engine's output with max_tokens = 1 always runs to the limit.)
    m = await anthropic_client(client).messages.create(model="evinfra-fake", max_tokens=1,
                                                       messages=USER)
    assert (m.usage.output_tokens, m.stop_reason) == (1, "max_tokens")


async def test_tool_use_comes_back_and_goes_in(client, service, monkeypatch):
    model_says(monkeypatch, SAYS_CALL)
    for m in await both(client, messages=USER, tools=TOOLS):
        got = blocks(m)
        assert got[0] == {"type": "text", "text": "Let me read it."}
        assert {k: got[1][k] for k in ("type", "name", "input")} == \
            {"type": "tool_use", "name": "read_file", "input": {"path": "a.py"}}
        assert got[1]["id"].startswith("toolu_") and m.stop_reason == "tool_use"
    # The harness sends the call and its result back: the template gets them as a chat's
    # tool_calls and tool message.
    prompts = []
    submit = service.submit
    service.submit = lambda sub, sink: prompts.append(bytes(sub.tokens.astype("u1"))) or \
        submit(sub, sink)
    model_says(monkeypatch, "It prints hi.")
    a = anthropic_client(client)
    m = await a.messages.create(model="evinfra-fake", max_tokens=50, tools=TOOLS, messages=[
        *USER,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me read it."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print('hi')"}]}])
    assert m.content[0].text == "It prints hi."
    assert prompts[0].decode().endswith(
        '<|assistant|>\nLet me read it.\n<tool_call>\n{"name": "read_file", "arguments": '
        '{"path": "a.py"}}\n</tool_call>\n<|tool|>\nprint(\'hi\')\n<|assistant|>\n')
    assert prompts[0].decode().startswith('<|tools|>\n[{"type": "function", "function": '
                                          '{"name": "read_file"')


@pytest.mark.parametrize("config_overrides", [{"model": {"reasoning_parser": "think"}}])
async def test_thinking_is_a_block_of_its_own(client, monkeypatch, config_overrides):
    model_says(monkeypatch, "<think>2 and 2</think>4" + SAYS_CALL)
    for m in await both(client, messages=USER, tools=TOOLS,
                        thinking={"type": "enabled", "budget_tokens": 1024}):
        got = blocks(m)
        assert [b["type"] for b in got] == ["thinking", "text", "tool_use"]
        assert (got[0]["thinking"], got[1]["text"]) == ("2 and 2", "4Let me read it.")
        assert m.stop_reason == "tool_use"


async def test_count_tokens_and_prefix_reuse_in_usage(client, service):
    a = anthropic_client(client)
    long = [{"role": "user", "content": "x" * 3000}]
    n = (await a.messages.count_tokens(model="evinfra-fake", messages=long)).input_tokens
    first = await a.messages.create(model="evinfra-fake", max_tokens=5, messages=long,
                                    extra_headers={"X-Evinfra-Branch-Id": "cc-1"})
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == n
    assert "cc-1" in service.directory.branches
    # The next turn of the branch reuses the first one's prompt pages.
    nxt = long + [{"role": "assistant", "content": first.content[0].text},
                  {"role": "user", "content": "go on"}]
    second = await a.messages.create(model="evinfra-fake", max_tokens=5, messages=nxt,
                                     extra_headers={"X-Evinfra-Branch-Id": "cc-1"})
    assert second.usage.cache_read_input_tokens >= 3000 - 64


@pytest.mark.parametrize("bad,status,kind,where", [
    ({"messages": USER}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "claude-x", "messages": USER, "max_tokens": 5}, 404, "not_found_error", "model"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
      "max_tokens": 5}, 400, "invalid_request_error", "messages[0].content[0]"),
    ({"messages": USER, "max_tokens": 5, "tools": TOOLS, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ({"messages": USER, "max_tokens": 5, "tools": [{"type": "bash_20250124", "name": "bash",
                                                    "input_schema": {}}]}, 400,
     "invalid_request_error", "tools[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                 "input": {}}]}], "max_tokens": 5}, 400,
     "invalid_request_error", "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}],
      "max_tokens": 5}, 400, "invalid_request_error", "messages[0].content[0].content[0]"),
    ({"messages": [], "max_tokens": 5}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [1]}]}], "max_tokens": 5}, 400,
     "invalid_request_error", "messages[0].content[0].content[0]"),  # (was a 500)
    ({"messages": USER, "max_tokens": 5, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
])
async def test_errors_in_anthropic_shape(client, bad, status, kind, where):
    r = await client.post("/v1/messages", data=msgspec.json.encode(
        {"model": "evinfra-fake", **bad}))
    assert r.status == status, await r.text()
    body = await r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert body["error"]["message"].startswith(where)


@pytest.mark.parametrize("config_overrides", [{"server": {"api_key": "sk-1"}}])
async def test_the_key_may_come_as_x_api_key(client, config_overrides):
    m = await anthropic_client(client, "sk-1").messages.create(
        model="evinfra-fake", max_tokens=3, messages=USER)
    assert m.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError) as e:
        await anthropic_client(client, "sk-2").messages.create(
            model="evinfra-fake", max_tokens=3, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"


async def test_a_client_that_goes_away_stops_the_request(client, service, monkeypatch):
    model_says(monkeypatch, "x" * 100_000)
    r = await client.post("/v1/messages", data=msgspec.json.encode(
        {"model": "evinfra-fake", "max_tokens": 100_000, "messages": USER, "stream": True}))
    assert r.status == 200
    await r.content.readline()  # message_start is out
    assert service.in_flight() == 1
    r.close()
    assert await eventually(lambda: service.in_flight() == 0)
