"""``echo``, ``best_of`` and batches of prompts on ``/v1/completions``, read by the official
client: the prompt's text before each choice's (whole and streamed, from text or token ids),
and its tokens' log-probabilities before the output's (what an evaluation harness scores);
``best_of`` candidates ranked by log-probability per token, the best ``n`` returned and every
candidate billed; a batch's prompts each a request with its choices in prompt order; the
combinations that cannot be served are 400s naming the field."""

import math

import numpy as np
import pytest

from evinfra.drivers.fake.outputs import OutputPlanner
from tests.api.conftest import (body, model_says, openai_client, spy_prefill_orders,
                                spy_submissions)

PROMPT = "Once upon a time"


async def test_echo_whole_from_text_and_from_token_ids(client, monkeypatch):
    model_says(monkeypatch, ", a fake engine")
    api = openai_client(client)
    r = await api.completions.create(model="evinfra-fake", prompt=PROMPT, max_tokens=20,
                                     echo=True, n=2)
    assert [c.text for c in r.choices] == [PROMPT + ", a fake engine"] * 2
    assert r.usage.prompt_tokens == len(PROMPT)
    ids = list(PROMPT.encode())  # the byte tokenizer's ids
    r = await api.completions.create(model="evinfra-fake", prompt=ids, max_tokens=20,
                                     echo=True)
    assert r.choices[0].text == PROMPT + ", a fake engine"
    r = await api.completions.create(model="evinfra-fake", prompt=PROMPT, max_tokens=20)
    assert r.choices[0].text == ", a fake engine"  # no echo asked


async def test_echo_streamed_comes_first(client, monkeypatch):
    model_says(monkeypatch, ", a fake engine")
    stream = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=PROMPT, max_tokens=20, echo=True, stream=True)
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT + ", a fake engine"



def made_up(ids: list[int]) -> list[float]:
    """The log-probabilities the fake engines report for these tokens (a function of each
    token id)."""
    return OutputPlanner(0, (0, 256)).logprobs(np.array(ids), 0).sampled


def prompt_logprobs(text: str) -> list[float]:
    """What the fake engines report for a prompt's tokens but the first (byte tokens)."""
    return made_up(list(text.encode())[1:])


async def test_echo_with_logprobs_scores_the_prompt(client, service, monkeypatch):
    """An evaluation harness's loglikelihood request: the prompt's tokens and their
    log-probabilities (none for the first), then the output's, offsets running through
    both. Only the first choice asks the engine; the others read its answer."""
    model_says(monkeypatch, ", a fake engine")
    submitted = spy_submissions(service)
    r = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=PROMPT, max_tokens=20, echo=True, logprobs=1, n=2)
    assert [s.sampling.prompt_logprobs for s in submitted] == [True, False]
    for c in r.choices:
        lp = c.logprobs
        assert c.text == PROMPT + ", a fake engine"
        assert lp.tokens == list(c.text)  # the byte tokenizer's tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(PROMPT)] == pytest.approx(prompt_logprobs(PROMPT))
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert lp.text_offset == list(range(len(c.text)))
    r = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=PROMPT, max_tokens=20, logprobs=1)
    assert r.choices[0].logprobs.tokens == list(", a fake engine")  # no echo: output only
    assert submitted[-1].sampling.prompt_logprobs is False


async def test_the_prompts_logprobs_take_its_whole_computation(client, service):
    """The engine computes every prompt token for them (SGLang reuses no cached prefix
    then): the router counts no cached prefix and plans no fetch, and none is reported."""
    kw = dict(model="evinfra-fake", prompt="x" * 3000, max_tokens=2,
              extra_headers={"X-Evinfra-Branch-Id": "eval-1"})
    orders = spy_prefill_orders(service)
    api = openai_client(client)
    await api.completions.create(**kw)
    r = await api.completions.create(**kw)
    assert r.usage.prompt_tokens_details.cached_tokens >= 3000 - 64  # the prompt's KV is there
    r = await api.completions.create(echo=True, logprobs=0, **kw)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert orders[1].cached_tokens >= 3000 - 64
    assert orders[2].cached_tokens == 0 and orders[2].fetch == []


async def test_an_evaluation_harness_scores_continuations(client):
    """lm-evaluation-harness's ``local-completions`` loglikelihood call, as it sends it: a
    batch of token-id prompts (context + continuation), one output token; it reads each
    choice's prompt entries past the context and checks each is its position's best."""
    ctx, conts = list(b"Question: 2+2=? Answer:"), [list(b" 4"), list(b" five")]
    r = await client.post("/v1/completions", data=body(
        model="evinfra-fake", prompt=[ctx + c for c in conts], temperature=0, max_tokens=1,
        logprobs=1, seed=1234, echo=True))
    assert r.status == 200, await r.text()
    choices = sorted((await r.json())["choices"], key=lambda c: c["index"])
    for choice, cont in zip(choices, conts):
        lp = choice["logprobs"]
        scored = lp["token_logprobs"][len(ctx):-1]  # the continuation (not the output token)
        assert scored == pytest.approx(made_up(cont))
        tops = lp["top_logprobs"][len(ctx):-1]
        assert all(t == max(top.values()) for t, top in zip(scored, tops))  # greedy

async def test_echo_with_logprobs_streamed_and_in_a_batch(client, monkeypatch):
    model_says(monkeypatch, "!")
    stream = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=["ab", list(b"xyz")], max_tokens=4, echo=True,
        logprobs=0, stream=True)
    chunks: dict[int, list] = {0: [], 1: []}
    async for chunk in stream:
        for c in chunk.choices:
            chunks[c.index].append(c)
    for i, prompt in enumerate(["ab", "xyz"]):
        first = chunks[i][0]
        assert first.text == prompt and first.logprobs.tokens == list(prompt)
        assert first.logprobs.token_logprobs[1:] == pytest.approx(prompt_logprobs(prompt))
        offsets = [o for c in chunks[i] if c.logprobs for o in c.logprobs.text_offset]
        assert offsets == list(range(len(prompt) + 1))  # the prompt's, then "!"'s


CANDIDATES = ["the first", "second, longer answer", "3", "and a fourth one"]


def candidates_say(monkeypatch) -> list[str]:
    """The fake engines' output for choice ``i`` (request id ``...-i``; 0 has no suffix):
    ``CANDIDATES[i % 4]`` (a batch's second prompt's four candidates say them again). Returns
    them ranked by log-probability per token, best first."""
    def plan(self, request, sampling):
        tail = request.rsplit("-", 1)[1]
        text = CANDIDATES[int(tail) % len(CANDIDATES) if len(tail) < 4 else 0]
        return np.frombuffer(text.encode(), np.uint8).astype(np.uint32), "stop"
    monkeypatch.setattr(OutputPlanner, "plan", plan)
    planner = OutputPlanner(0, (0, 256))

    def per_token(text: str) -> float:
        lps = planner.logprobs(np.frombuffer(text.encode(), np.uint8), 0).sampled
        return math.fsum(lps) / len(lps)
    ranked = sorted(CANDIDATES, key=per_token, reverse=True)
    assert len({per_token(t) for t in CANDIDATES}) == 4 and ranked != CANDIDATES  # a real rank
    return ranked


@pytest.mark.parametrize("logprobs", [0, None])
async def test_best_of_returns_the_best_n_candidates(client, service, monkeypatch, logprobs):
    ranked = candidates_say(monkeypatch)
    submitted = spy_submissions(service)
    r = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=PROMPT, max_tokens=30, n=2, best_of=4, logprobs=logprobs)
    assert len(submitted) == 4  # four candidates: the request and three forks of it
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == ranked[:2]
    if logprobs is None:  # read for the rank, not returned
        assert all(c.logprobs is None for c in r.choices)
    else:
        assert ["".join(c.logprobs.tokens) for c in r.choices] == ranked[:2]
    # Every candidate's tokens were generated, so all are billed.
    assert r.usage.completion_tokens == sum(map(len, CANDIDATES))
    assert service.in_flight() == 0


async def test_best_of_equal_to_n_streams(client):
    stream = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=PROMPT, max_tokens=4, n=2, best_of=2, stream=True)
    indexes = {c.choices[0].index async for c in stream if c.choices}
    assert indexes == {0, 1}


@pytest.mark.parametrize("fields,param", [
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 129}, "best_of"),
])
async def test_what_cannot_be_served_is_refused(client, service, fields, param):
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt=PROMPT,
                                                       max_tokens=4, **fields))
    assert r.status == 400, await r.text()
    err = (await r.json())["error"]
    assert err["param"] == param and err["message"]
    assert service.in_flight() == 0


async def test_a_batch_of_prompts_each_with_its_choices(client, service, monkeypatch):
    """Prompt ``p``'s ``n`` choices are ``p * n`` to ``p * n + n - 1`` (the echo says whose
    they are); each prompt is a request of its own, its choices forks of it."""
    model_says(monkeypatch, "!")
    submitted = spy_submissions(service)
    prompts = ["first prompt", list(b"second"), "third"]
    r = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=prompts, n=2, max_tokens=4, echo=True, seed=1)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t + "!" for t in ("first prompt", "second",
                                                             "third") for _ in range(2)]
    assert r.usage.prompt_tokens == len("first prompt") + len("second") + len("third")
    assert r.usage.completion_tokens == 6
    # Three requests, each a branch of one (the batch has no hint), and a fork of each with
    # the seed its prompt alone would give it.
    assert len(submitted) == 6
    heads = [s for s in submitted if s.parent is None and not s.final]
    assert [bytes(s.tokens.astype("u1")) for s in heads] == [b"first prompt", b"second",
                                                             b"third"]
    assert sorted(s.sampling.seed for s in submitted) == [1, 1, 1, 2, 2, 2]
    assert service.in_flight() == 0


async def test_a_batch_streamed(client, monkeypatch):
    model_says(monkeypatch, "!")
    stream = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=["a", "bb", "ccc"], max_tokens=4, echo=True, stream=True,
        stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {0: "a!", 1: "bb!", 2: "ccc!"}
    assert usage.prompt_tokens == 6 and usage.completion_tokens == 3


async def test_a_batch_ranks_each_prompts_candidates(client, monkeypatch):
    ranked = candidates_say(monkeypatch)
    r = await openai_client(client).completions.create(
        model="evinfra-fake", prompt=["A: ", "B: "], max_tokens=30, n=2, best_of=4, echo=True)
    assert [c.text for c in r.choices] == ["A: " + t for t in ranked[:2]] + \
        ["B: " + t for t in ranked[:2]]


async def test_a_batch_with_branch_hints_or_too_many_requests_is_refused(client, service):
    r = await client.post("/v1/completions", headers={"X-Evinfra-Branch-Id": "agent-1"},
                          data=body(model="evinfra-fake", prompt=["a", "b"], max_tokens=2))
    assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt=["a"] * 17,
                                                       n=128, max_tokens=2))
    assert r.status == 400 and "at most 2048" in (await r.json())["error"]["message"]
    assert service.in_flight() == 0
    r = await client.post("/v1/completions", headers={"X-Evinfra-Branch-Id": "agent-1"},
                          data=body(model="evinfra-fake", prompt=["a"], max_tokens=2))
    assert r.status == 200  # a batch of one is a request like any other


async def test_continuous_usage_stats(client, monkeypatch):
    """vLLM's and SGLang's ``continuous_usage_stats``: each chunk has the usage so far."""
    model_says(monkeypatch, "abcdefgh")
    oa = openai_client(client)
    for chat in (False, True):
        kw = dict(model="evinfra-fake", max_tokens=20, stream=True, stream_options={
            "include_usage": True, "continuous_usage_stats": True})
        stream = await (oa.chat.completions.create(messages=[{"role": "user", "content": "x"}],
                                                   **kw) if chat else
                        oa.completions.create(prompt="xyz", **kw))
        seen, text = [], ""
        async for chunk in stream:
            seen.append(chunk.usage.completion_tokens)
            for c in chunk.choices:
                text += (c.delta.content or "") if chat else c.text
                assert chunk.usage.completion_tokens >= len(text)
        assert text == "abcdefgh" and seen == sorted(seen) and seen[-1] == 8
        assert len(seen) > 2
    stream = await oa.completions.create(model="evinfra-fake", prompt="xyz", max_tokens=20,
                                         stream=True)
    assert {chunk.usage async for chunk in stream} == {None}
