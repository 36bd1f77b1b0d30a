"""``echo`` and ``best_of`` on ``/v1/completions``, read by the official client: the prompt's
text before each choice's (whole and streamed, from text or token ids); ``best_of``
candidates ranked by log-probability per token, the best ``n`` returned and every candidate
billed; the combinations that cannot be served are 400s naming the field."""

import math

import numpy as np
import pytest

from evinfra.drivers.fake.outputs import OutputPlanner
from tests.api.conftest import body, model_says, openai_client, spy_submissions

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


CANDIDATES = ["the first", "second, longer answer", "3", "and a fourth one"]


def candidates_say(monkeypatch) -> list[str]:
    """The fake engines' output for choice ``i`` (request id ``...-i``; 0 has no suffix):
    ``CANDIDATES[i]``. Returns them ranked by log-probability per token, best first."""
    def plan(self, request, sampling):
        tail = request.rsplit("-", 1)[1]
        text = CANDIDATES[int(tail) if len(tail) < 4 else 0]
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
    ({"echo": True, "logprobs": 0}, "echo"),
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
