"""A thinking model's reasoning comes back as ``reasoning_content``, whole and streamed, apart
from its answer and from the tool calls in the answer."""

import json

import pytest

from evinfra.api.tokenizer import ByteTokenizer
from tests.api.conftest import model_says, openai_client

MSG = [{"role": "user", "content": "2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "calc"}}]


@pytest.fixture
def config_overrides():
    return {"model": {"reasoning_parser": "think"}}


async def both(client, **kw) -> tuple[dict, dict]:
    """The whole answer's message and finish, and the same read from the stream."""
    oa = openai_client(client)
    r = await oa.chat.completions.create(model="evinfra-fake", messages=MSG, max_tokens=200,
                                         **kw)
    m = r.choices[0].message
    whole = {"reasoning": getattr(m, "reasoning_content", None), "content": m.content,
             "calls": [(c.function.name, json.loads(c.function.arguments))
                       for c in m.tool_calls or ()], "finish": r.choices[0].finish_reason}
    parts: dict = {"reasoning": [], "content": [], "calls": {}, "finish": None}
    async for chunk in await oa.chat.completions.create(
            model="evinfra-fake", messages=MSG, max_tokens=200, stream=True, **kw):
        d = chunk.choices[0].delta
        parts["reasoning"].append(getattr(d, "reasoning_content", None) or "")
        parts["content"].append(d.content or "")
        for c in d.tool_calls or ():
            got = parts["calls"].setdefault(c.index, ["", ""])
            got[0] += c.function.name or ""
            got[1] += c.function.arguments or ""
        parts["finish"] = chunk.choices[0].finish_reason or parts["finish"]
    streamed = {"reasoning": "".join(parts["reasoning"]) or None,
                "content": "".join(parts["content"]) or None,
                "calls": [(n, json.loads(a)) for n, a in parts["calls"].values()],
                "finish": parts["finish"]}
    return whole, streamed


async def test_reasoning_apart_from_the_answer(client, monkeypatch):
    model_says(monkeypatch, "<think>\nadd them</think>\n\nIt is 4.")
    whole, streamed = await both(client)
    assert whole == streamed == {"reasoning": "\nadd them", "content": "It is 4.", "calls": [],
                                 "finish": "stop"}


async def test_a_call_after_the_reasoning(client, monkeypatch):
    model_says(monkeypatch, '<think>use the tool; <tool_call> here is just a thought</think>\n'
                      '<tool_call>{"name": "calc", "arguments": {"x": "2+2"}}</tool_call>')
    whole, streamed = await both(client, tools=TOOLS)
    assert whole == streamed == {
        "reasoning": "use the tool; <tool_call> here is just a thought", "content": None,
        "calls": [("calc", {"x": "2+2"})], "finish": "tool_calls"}


async def test_a_template_that_opens_the_block(client, monkeypatch):
    """DeepSeek-R1's template ends the prompt inside the block: the output has no opening."""
    real = ByteTokenizer.apply_chat_template
    monkeypatch.setattr(ByteTokenizer, "apply_chat_template",
                        lambda self, *a: real(self, *a) + "<think>\n")
    model_says(monkeypatch, "add them</think>4")
    whole, streamed = await both(client)
    assert whole == streamed == {"reasoning": "add them", "content": "4", "calls": [],
                                 "finish": "stop"}


@pytest.mark.parametrize("config_overrides", [{}])
async def test_without_a_reasoning_parser_it_is_all_content(client, monkeypatch,
                                                             config_overrides):
    model_says(monkeypatch, "<think>x</think>4")
    whole, streamed = await both(client)
    assert whole == streamed == {"reasoning": None, "content": "<think>x</think>4",
                                 "calls": [], "finish": "stop"}


async def usage_both(client) -> tuple[dict, dict]:
    """``usage`` of the whole answer and of the stream's last chunk."""
    body = {"model": "evinfra-fake", "messages": MSG, "max_tokens": 200}
    r = await client.post("/v1/chat/completions", json=body)
    whole = (await r.json())["usage"]
    r = await client.post("/v1/chat/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}})
    lines = [ln for ln in (await r.text()).splitlines() if ln.startswith("data: {")]
    return whole, json.loads(lines[-1][6:])["usage"]


async def test_usage_counts_the_reasoning_tokens(client, monkeypatch):
    model_says(monkeypatch, "<think>abc</think>hi")
    for usage in await usage_both(client):
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}  # bytes a, b, c
        assert usage["completion_tokens"] == len("<think>abc</think>hi".encode())


@pytest.mark.parametrize("config_overrides", [{}])
async def test_no_reasoning_count_without_a_parser(client, monkeypatch, config_overrides):
    model_says(monkeypatch, "<think>abc</think>hi")
    for usage in await usage_both(client):
        assert "completion_tokens_details" not in usage
