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


MIN_CASES = [  # (output, stop, min_tokens) -> text sent (each character is a token)
    (("ENDabcEND", "END", 3), ""),  # a stop ending in the min_tokens-th token counts
    (("ENDabcEND", "END", 4), "ENDabc"),
    (("ENDabcEND", "END", 9), "ENDabc"),
    (("abENDx", "END", 6), "abENDx"),
    (("abENDx", "END", 0), "ab"),
]


@pytest.mark.parametrize("case", MIN_CASES, ids=[f"{c[0][0]}-{c[0][2]}" for c in MIN_CASES])
async def test_no_stop_string_ends_an_output_before_min_tokens(client, monkeypatch, case):
    (output, stop, least), sent = case
    model_says(monkeypatch, output)
    oa = openai_client(client)
    kw = dict(model="evinfra-fake", prompt="x", max_tokens=50, stop=[stop],
              extra_body={"min_tokens": least})
    assert (await oa.completions.create(**kw)).choices[0].text == sent
    parts = [c.choices[0].text async for c in await oa.completions.create(stream=True, **kw)]
    assert "".join(parts) == sent


@pytest.mark.parametrize("split", [None, 1, 3, 4, 5])
async def test_min_tokens_however_the_output_arrives(split):
    """The floor falls inside an engine's batch of tokens or between two: the same text."""
    from evinfra.api.serving import Sample, Stops, outputs
    from evinfra.api.tokenizer import ByteTokenizer

    class Service:
        def abort(self, rid):
            pass

    ids = list(b"ENDabcEND")
    sample = Sample(0, "r", None)
    for part in ([ids] if split is None else [ids[:split], ids[split:]]):
        sample.channel.tokens(part, None)
    sample.channel.done(None, None)
    got = [item async for item in outputs(Service(), ByteTokenizer(), sample,
                                          Stops(["END"], 5))]
    assert "".join(i[1] for i in got if i[0] == "text") == "ENDabc"
    assert got[-1][:2] == ("done", "stop") and sample.stop == "END"


async def test_a_kept_stop_string_stays_in_the_output(client, monkeypatch):
    """vLLM's include_stop_str_in_output and SGLang's no_stop_trim, whole and streamed."""
    model_says(monkeypatch, "abc</ans>more")
    oa = openai_client(client)
    for keep in ({"include_stop_str_in_output": True}, {"no_stop_trim": True}, {}):
        kw = dict(model="evinfra-fake", prompt="x", max_tokens=50, stop=["</ans>"],
                  extra_body=keep)
        sent = "abc</ans>" if keep else "abc"
        r = await oa.completions.create(**kw)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (sent, "stop")
        parts = [c.choices[0].text async for c in await oa.completions.create(stream=True,
                                                                              **kw)]
        assert "".join(parts) == sent
    r = await oa.chat.completions.create(model="evinfra-fake", max_tokens=50, stop="</ans>",
                                         messages=[{"role": "user", "content": "x"}],
                                         extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "abc</ans>"
