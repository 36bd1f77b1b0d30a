"""Stop strings end the output, and none of a matched one is sent, even when it spans tokens
(the byte tokenizer makes every character a token)."""

import pytest

from tests.api.conftest import model_says, openai_client

CASES = [  # (output, stops) -> text sent
    (("abcEND more", ["END"]), "abc"),
    (("ENDabc", ["END"]), ""),
    (("a</ans>b<x", ["</ans>", "<x"]), "a"),  # the earliest of two
    (("a<x b</ans>", ["</ans>", "<x"]), "a"),
    (("abEN", ["END"]), "abEN"),  # a stop's beginning that never completes is text
    (("abENENDx", ["END"]), "abEN"),
    (("no stop here", ["END"]), "no stop here"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0][0] for c in CASES])
async def test_stop_strings_whole_and_streamed(client, monkeypatch, case):
    (output, stops), sent = case
    model_says(monkeypatch, output)
    oa = openai_client(client)
    r = await oa.completions.create(model="evinfra-fake", prompt="x", max_tokens=50, stop=stops)
    finish = "stop"
    assert (r.choices[0].text, r.choices[0].finish_reason) == (sent, finish)
    parts, last = [], None
    async for chunk in await oa.completions.create(model="evinfra-fake", prompt="x",
                                                   max_tokens=50, stop=stops, stream=True):
        parts.append(chunk.choices[0].text)
        last = chunk.choices[0].finish_reason or last
    assert ("".join(parts), last) == (sent, finish)
    r = await oa.chat.completions.create(model="evinfra-fake", max_tokens=50, stop=stops,
                                         messages=[{"role": "user", "content": "x"}])
    assert r.choices[0].message.content == sent
