"""Output log-probabilities through the OpenAI routes, read by the official client: one entry
per output token, whole and streamed, lined up with the token ids; ``top_logprobs``
alternatives most likely first; the completions shape; bad values are 400s."""

import math

import pytest

from tests.api.conftest import body, openai_client

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def check_entry(entry, token_id: int, k: int) -> None:
    """An entry of the fake engines (``OutputPlanner.logprobs``): the sampled token leads its
    alternatives, which fall by half each, and all of them sum below 1."""
    assert entry.token == chr(token_id) and entry.bytes == list(chr(token_id).encode())
    assert math.log(0.4) <= entry.logprob < 0
    top = entry.top_logprobs
    assert len(top) == k
    if k:
        assert top[0].token == entry.token and top[0].logprob == entry.logprob
        assert len({t.token for t in top}) == k
        assert all(a.logprob > b.logprob for a, b in zip(top, top[1:]))
        assert sum(math.exp(t.logprob) for t in top) < 1


@pytest.mark.parametrize("k", [None, 0, 3])
async def test_chat_logprobs_whole(client, k):
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=12, logprobs=True,
        top_logprobs=k, extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    entries = choice.logprobs.content
    assert len(ids) == len(entries) == 12
    assert "".join(e.token for e in entries) == choice.message.content
    for entry, token in zip(entries, ids):
        check_entry(entry, token, k or 0)


async def test_chat_logprobs_streamed_line_up_with_the_tokens(client):
    stream = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=20, logprobs=True, top_logprobs=2,
        stream=True, extra_body={"return_token_ids": True, "ignore_eos": True})
    ids, entries, text = [], [], ""
    async for chunk in stream:
        c = chunk.choices[0]
        ids += c.model_extra.get("token_ids") or []
        if c.logprobs is not None:
            entries += c.logprobs.content
        text += c.delta.content or ""
    assert len(ids) == len(entries) == 20
    assert "".join(e.token for e in entries) == text
    for entry, token in zip(entries, ids):
        check_entry(entry, token, 2)


async def test_chat_without_logprobs_has_none(client):
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=5)
    assert r.choices[0].logprobs is None


async def test_every_choice_has_its_own(client):
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=8, n=3, logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert [e.token for e in c.logprobs.content] == [chr(t) for t in ids]


async def test_completion_logprobs(client):
    for stream in (False, True):
        kw = dict(model="evinfra-fake", prompt="hello", max_tokens=10, logprobs=2,
                  extra_body={"ignore_eos": True})
        if stream:
            tokens, sampled, top, offsets, text = [], [], [], [], ""
            async for chunk in await openai_client(client).completions.create(stream=True,
                                                                               **kw):
                c = chunk.choices[0]
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    sampled += c.logprobs.token_logprobs
                    top += c.logprobs.top_logprobs
                    offsets += c.logprobs.text_offset
        else:
            c = (await openai_client(client).completions.create(**kw)).choices[0]
            text, lp = c.text, c.logprobs
            tokens, sampled, top, offsets = (lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                             lp.text_offset)
        assert "".join(tokens) == text and len(tokens) == 10
        assert offsets == list(range(10))  # one character per byte token
        for token, lp, alts in zip(tokens, sampled, top):
            assert len(alts) == 2 and alts[token] == lp and max(alts.values()) == lp


async def test_logprobs_stop_with_the_text_at_a_stop_string(client, monkeypatch):
    from tests.api.conftest import model_says
    model_says(monkeypatch, "one two END three")
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=30, logprobs=True, stop=["END"],
        extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.message.content == "one two "
    # The tokens read up to the stop, as the token ids say.
    assert [e.token for e in c.logprobs.content] == [chr(t) for t in c.model_extra["token_ids"]]


@pytest.mark.parametrize("path,fields,param", [
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
])
async def test_bad_logprobs_are_400s(client, path, fields, param):
    base = {"model": "evinfra-fake", "max_tokens": 4}
    base.update({"messages": MESSAGES} if path == CHAT else {"prompt": "hi"})
    resp = await client.post(path, data=body(**base, **fields))
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param


async def responses_both(client, **kw):
    oa = openai_client(client)
    whole = await oa.responses.create(model="evinfra-fake", max_output_tokens=200, **kw)
    async with oa.responses.stream(model="evinfra-fake", max_output_tokens=200, **kw) as s:
        deltas = [e.logprobs async for e in s if e.type == "response.output_text.delta"]
        streamed = await s.get_final_response()
    return whole, streamed, [lp for d in deltas for lp in d]


async def test_responses_text_logprobs(client, monkeypatch):
    from tests.api.conftest import model_says
    model_says(monkeypatch, "Hello there")
    whole, streamed, deltas = await responses_both(
        client, input="hi", top_logprobs=2, include=["message.output_text.logprobs"])
    for r in (whole, streamed):
        entries = r.output[0].content[0].logprobs
        assert "".join(e.token for e in entries) == "Hello there"
        for e in entries:
            assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob
    assert [e.token for e in deltas] == list("Hello there")  # the deltas' add up
    plain = await openai_client(client).responses.create(model="evinfra-fake", input="hi")
    assert plain.output[0].content[0].logprobs == []  # not asked for


async def test_responses_a_calls_tokens_have_no_logprobs(client, monkeypatch):
    from tests.api.conftest import model_says
    from tests.api.test_responses import SAYS_CALL, TOOLS
    model_says(monkeypatch, SAYS_CALL)
    for r in (await responses_both(client, input="read a.py", tools=TOOLS,
                                   include=["message.output_text.logprobs"]))[:2]:
        assert [i.type for i in r.output] == ["message", "function_call"]
        text = "".join(e.token for e in r.output[0].content[0].logprobs)
        # The text's tokens (and those read with them, up to where the parser could tell a
        # call had begun), not the call's.
        assert text.startswith("Let me read it.") and len(text) < len(SAYS_CALL) // 2
