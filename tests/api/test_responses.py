"""OpenAI's Responses API, read by the official client: output items whole and streamed
(the client checks the events' order and identities), function calls both ways, reasoning,
the prefix reuse in ``usage``, and what is refused."""

import json

import msgspec
import pytest

from evinfra.api.tokenizer import ByteTokenizer
from tests.api.conftest import eventually, model_says, openai_client

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
SAYS_CALL = ('Let me read it.<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n'
             '</tool_call>')


async def both(client, **kw):
    """The whole response and the one the client builds from the stream's events."""
    oa = openai_client(client)
    whole = await oa.responses.create(model="evinfra-fake", max_output_tokens=200, **kw)
    async with oa.responses.stream(model="evinfra-fake", max_output_tokens=200, **kw) as s:
        async for _ in s:
            pass
        streamed = await s.get_final_response()
    return whole, streamed


def shape(r) -> list:
    """The output items without their generated ids."""
    out = []
    for it in r.output:
        d = it.model_dump(exclude_none=True)
        d.pop("id", None)
        d.pop("call_id", None)
        out.append(d)
    return out


async def test_text_whole_and_streamed(client, monkeypatch):
    model_says(monkeypatch, "Hello there")
    for r in await both(client, instructions="Be terse.", input="hi"):
        assert r.status == "completed" and r.output_text == "Hello there"
        assert shape(r) == [{"type": "message", "role": "assistant", "status": "completed",
                             "content": [{"type": "output_text", "text": "Hello there",
                                          "annotations": [], "logprobs": []}]}]
        prompt = ByteTokenizer().apply_chat_template(
            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}])
        assert r.usage.input_tokens == len(prompt.encode())
        assert r.usage.output_tokens == len("Hello there")


async def test_function_calls_come_back_and_go_in(client, service, monkeypatch):
    model_says(monkeypatch, SAYS_CALL)
    for r in await both(client, input="what is in a.py?", tools=TOOLS):
        items = shape(r)
        assert items[0]["content"][0]["text"] == "Let me read it."
        assert {k: items[1][k] for k in ("type", "name", "arguments", "status")} == \
            {"type": "function_call", "name": "read_file", "arguments": '{"path": "a.py"}',
             "status": "completed"}
        assert r.output[1].call_id.startswith("call_")
    prompts = []
    submit = service.submit
    service.submit = lambda sub, sink: prompts.append(bytes(sub.tokens.astype("u1"))) or \
        submit(sub, sink)
    model_says(monkeypatch, "It prints hi.")
    r = await openai_client(client).responses.create(model="evinfra-fake", tools=TOOLS, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "what is in a.py?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me read it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file",
         "arguments": '{"path": "a.py"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "print('hi')"}])
    assert r.output_text == "It prints hi."
    assert prompts[0].decode().endswith(
        '<|system|>\nAnswer briefly.\n<|user|>\nwhat is in a.py?\n<|assistant|>\nLet me read '
        'it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        "<|tool|>\nprint('hi')\n<|assistant|>\n")


@pytest.mark.parametrize("config_overrides", [{"model": {"reasoning_parser": "think"}}])
async def test_reasoning_is_an_item_of_its_own(client, monkeypatch, config_overrides):
    model_says(monkeypatch, "<think>2 and 2</think>4")
    for r in await both(client, input="2+2?"):
        items = shape(r)
        assert [i["type"] for i in items] == ["reasoning", "message"]
        assert items[0]["content"] == [{"type": "reasoning_text", "text": "2 and 2"}]
        assert r.output_text == "4"
        assert r.usage.output_tokens_details.reasoning_tokens == len("2 and 2")


async def test_length_is_incomplete_and_reuse_is_in_usage(client, service):
    oa = openai_client(client)
    long = "x" * 3000
    r = await oa.responses.create(model="evinfra-fake", input=long, max_output_tokens=1,
                                  extra_headers={"X-Evinfra-Branch-Id": "codex-1"})
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert "codex-1" in service.directory.branches
    again = await oa.responses.create(
        model="evinfra-fake", max_output_tokens=1, extra_headers={"X-Evinfra-Branch-Id": "codex-1"},
        input=[{"role": "user", "content": long}, {"role": "assistant", "content": r.output_text},
               {"role": "user", "content": "go on"}])
    assert again.usage.input_tokens_details.cached_tokens >= 3000 - 64


@pytest.mark.parametrize("bad,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "local_shell_call"}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "gpt-9", "input": "x"}, "model"),
])
async def test_refusals_name_the_field(client, bad, param):
    r = await client.post("/v1/responses", data=msgspec.json.encode(
        {"model": "evinfra-fake", **bad}))
    assert 400 <= r.status < 500, await r.text()
    err = (await r.json())["error"]
    assert err["param"] == param and err["message"]


async def test_a_client_that_goes_away_stops_the_request(client, service, monkeypatch):
    model_says(monkeypatch, "x" * 100_000)
    r = await client.post("/v1/responses", data=json.dumps(
        {"model": "evinfra-fake", "max_output_tokens": 100_000, "input": "x", "stream": True}))
    assert r.status == 200
    await r.content.readline()  # response.created is out
    assert service.in_flight() == 1
    r.close()
    assert await eventually(lambda: service.in_flight() == 0)
