"""Stored responses: ``previous_response_id`` continues a stored conversation (instructions not
carried over), a chain of responses is one agent branch (a continuation of an earlier response
forks), responses can be read back and deleted, and the store is bounded."""

import pytest

from evinfra.api.tokenizer import ByteTokenizer
from tests.api.conftest import model_says, openai_client, spy_submissions
from tests.api.test_responses import SAYS_CALL, TOOLS


@pytest.fixture
def submitted(service):
    return spy_submissions(service)


async def respond(oa, **kw):
    """A short answer (the fake engines draw an answer's length up to its maximum)."""
    return await oa.responses.create(model="evinfra-fake", max_output_tokens=8, **kw)


def prompt_of(sub) -> str:
    return ByteTokenizer().decode(sub.tokens.tolist())


async def test_a_chain_continues_its_conversation_on_one_branch(client, service, submitted,
                                                                monkeypatch):
    oa = openai_client(client)
    model_says(monkeypatch, "first answer")
    r1 = await oa.responses.create(model="evinfra-fake", instructions="Be terse.",
                                   input="x" * 300)
    model_says(monkeypatch, "second answer")
    r2 = await oa.responses.create(model="evinfra-fake", previous_response_id=r1.id,
                                   instructions="Be terse.", input="go on")
    assert r2.previous_response_id == r1.id
    p2 = prompt_of(submitted[1])
    assert "x" * 300 in p2 and "first answer" in p2 and "go on" in p2
    assert r2.usage.input_tokens_details.cached_tokens >= 256  # r1's prompt KV, reused
    r3 = await oa.responses.create(model="evinfra-fake", previous_response_id=r2.id,
                                   input="and on")
    assert "Be terse." not in prompt_of(submitted[2])  # instructions are not carried over
    fork = await oa.responses.create(model="evinfra-fake", previous_response_id=r2.id,
                                     input="or else")
    # r1 starts the chain (a branch of one); r2 starts its branch, r3 continues it; the
    # second continuation of r2 forks from it.
    b = [(s.branch, s.parent) for s in submitted]
    assert b[0] == (None, None)
    assert b[1][0].startswith("chain-") and b[1][1] is None
    assert b[2] == (b[1][0], None)
    assert b[3][0] not in (None, b[1][0]) and b[3][1] == b[1][0]
    assert "second answer" in prompt_of(submitted[3]) and "and on" not in prompt_of(
        submitted[3])
    assert {b[1][0], b[3][0]} <= set(service.directory.branches.branches())
    assert r3.status == fork.status == "completed"


async def test_a_function_call_chain(client, submitted, monkeypatch):
    oa = openai_client(client)
    model_says(monkeypatch, SAYS_CALL)
    r1 = await respond(oa, input="read a.py", tools=TOOLS)
    call = next(i for i in r1.output if i.type == "function_call")
    model_says(monkeypatch, "It prints hi.")
    r2 = await oa.responses.create(
        model="evinfra-fake", previous_response_id=r1.id, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "print('hi')"}])
    assert r2.output_text == "It prints hi."
    p2 = prompt_of(submitted[1])
    assert '"name": "read_file"' in p2 and "print('hi')" in p2 and "Let me read it." in p2


async def test_read_back_delete_and_not_stored(client):
    oa = openai_client(client)
    r = await respond(oa, input="hi")
    assert (await oa.responses.retrieve(r.id)).output_text == r.output_text
    deleted = await client.delete(f"/v1/responses/{r.id}")
    assert deleted.status == 200 and (await deleted.json())["deleted"] is True
    assert (await client.get(f"/v1/responses/{r.id}")).status == 404
    gone = await client.post("/v1/responses", json={
        "model": "evinfra-fake", "input": "more", "previous_response_id": r.id,
        "max_output_tokens": 8})
    assert gone.status == 400
    err = (await gone.json())["error"]
    assert err["code"] == "previous_response_not_found" and err["param"] == "previous_response_id"
    unstored = await respond(oa, input="hi", store=False)
    assert unstored.store is False
    assert (await client.get(f"/v1/responses/{unstored.id}")).status == 404


@pytest.mark.parametrize("config_overrides", [{"limits": {"stored_responses": 2}}])
async def test_the_store_keeps_the_latest(client, config_overrides):
    oa = openai_client(client)
    ids = [(await respond(oa, input=f"q{i}")).id for i in range(3)]
    assert (await client.get(f"/v1/responses/{ids[0]}")).status == 404
    assert [(await client.get(f"/v1/responses/{i}")).status for i in ids[1:]] == [200, 200]


async def test_explicit_hints_win(client, submitted):
    oa = openai_client(client)
    r1 = await respond(oa, input="hi")
    await respond(oa, input="on", previous_response_id=r1.id,
                  extra_headers={"X-Evinfra-Branch-Id": "codex-7"})
    assert submitted[1].branch == "codex-7"


async def test_a_streamed_response_is_stored_and_continued(client, submitted, monkeypatch):
    oa = openai_client(client)
    model_says(monkeypatch, "streamed answer")
    async with oa.responses.stream(model="evinfra-fake", input="hi") as s:
        r1 = await s.get_final_response()
    assert (await oa.responses.retrieve(r1.id)).output_text == "streamed answer"
    async with oa.responses.stream(model="evinfra-fake", input="on",
                                   previous_response_id=r1.id) as s:
        await s.get_final_response()
    assert "streamed answer" in prompt_of(submitted[1])
    assert submitted[1].branch.startswith("chain-")


async def test_a_continuation_refused_leaves_the_chain_as_it_was(client, service, submitted):
    from evinfra.errors import NoNodeError

    oa = openai_client(client)
    r1 = await respond(oa, input="hi")
    r2 = await respond(oa, input="on", previous_response_id=r1.id)
    spy = service.submit

    def refuse(sub, sink):
        raise NoNodeError("prefill", "a test")
    service.submit = refuse
    r = await client.post("/v1/responses", json={
        "model": "evinfra-fake", "input": "more", "max_output_tokens": 8,
        "previous_response_id": r2.id})
    assert r.status == 503
    service.submit = spy
    await respond(oa, input="more", previous_response_id=r2.id)
    assert submitted[2].branch == submitted[1].branch  # the retry continues r2's branch
