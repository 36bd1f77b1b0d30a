"""Bad input gets a 4xx with an OpenAI-style error, never a 5xx, and nothing accepted is lost."""

import gzip
import json

import pytest

from tests.api.conftest import body

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


async def expect(client, path, data, status, param=None, headers=None):
    r = await client.post(path, data=data, headers=headers or {"Content-Type": "application/json"})
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    return err


async def test_malformed_json(client):
    await expect(client, CHAT, b"{not json", 400)


async def test_missing_fields(client):
    await expect(client, CHAT, body(model="evinfra-fake"), 400, param="messages")
    await expect(client, "/v1/completions", body(model="evinfra-fake"), 400, param="prompt")


async def test_wrong_types(client):
    await expect(client, CHAT, body(model="evinfra-fake", messages="hi"), 400, param="messages")
    await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, max_tokens="ten"), 400,
                 param="max_tokens")
    await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, temperature=9), 400,
                 param="temperature")
    await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, seed=2**64), 400,
                 param="seed")
    for field, value in (("frequency_penalty", 2.5), ("presence_penalty", -3),
                         ("repetition_penalty", 0), ("repetition_penalty", 2.1),
                         ("min_p", 1.5), ("top_k", 0), ("top_k", -2), ("top_k", 1.5)):
        await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, **{field: value}),
                     400, param=field)
    await expect(client, "/v1/completions", body(model="evinfra-fake", prompt=[1, -2, 3]), 400,
                 param="prompt")
    await expect(client, CHAT, body(model="evinfra-fake", messages=[{"role": "robot", "content": "x"}]),
                 400, param="messages[0].role")
    await expect(client, CHAT, body(model="evinfra-fake", messages=[{"role": ["user"]}]), 400,
                 param="messages[0].role")  # (was a 500: a list is not hashable)
    await expect(client, CHAT, body(model="evinfra-fake", messages=MSG,
                                    evinfra={"branch": "typo"}), 400)


@pytest.mark.parametrize("n", [0, -5])
async def test_max_tokens_must_be_positive(client, n):
    await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, max_tokens=n), 400,
                 param="max_tokens")


async def test_context_too_long(client):
    await expect(client, "/v1/completions",
                 body(model="evinfra-fake", prompt=[1] * 10, max_tokens=10**9), 400,
                 param="max_tokens")


async def test_unknown_model(client):
    err = await expect(client, CHAT, body(model="gpt-9", messages=MSG), 404, param="model")
    assert err["code"] == "model_not_found"
    r = await client.get("/v1/models/gpt-9")
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    r = await client.get("/v1/models/evinfra-fake")
    assert r.status == 200 and (await r.json())["id"] == "evinfra-fake"
    listed = (await (await client.get("/v1/models")).json())["data"]
    assert listed == [await r.json()] and listed[0]["max_model_len"] == 262_144


async def test_an_empty_stop_string_stops_nothing(client):
    r = await client.post(CHAT, json={"model": "evinfra-fake", "messages": MSG, "max_tokens": 6,
                                      "ignore_eos": True, "stop": ["", "\u0000never"]})
    assert r.status == 200, await r.text()
    out = await r.json()
    assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"


async def test_oversized_body(client):
    await expect(client, CHAT, body(model="evinfra-fake",
                                    messages=[{"role": "user", "content": "x" * 300_000}]), 413)


async def test_unknown_branch_end_and_routes(client):
    await expect(client, "/v1/branches/nope/end", b"", 404)
    r = await client.get("/v1/nothing-here")
    assert r.status == 404 and (await r.json())["error"]["type"]


async def test_empty_prompts_bad_token_ids_and_n_out_of_range_are_refused(client):
    for prompt in ([], [[]], ["a", []], [[1, 2], "b", [-1]], [2 ** 32], [[2 ** 63 + 1]],
                   [2 ** 64 - 1]):  # (past 2^63: numpy cannot hold them)
        await expect(client, "/v1/completions", body(model="evinfra-fake", prompt=prompt), 400,
                     param="prompt")
    for n in (0, 129):  # OpenAI's range is 1-128
        await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, n=n), 400, param="n")


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "response_format", {"type": "json_schema",
                               "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    (CHAT, "tool_choice", "required")])
async def test_options_this_server_does_not_serve_are_refused(client, path, field, value):
    """An answer without the JSON (or the forced call) it was asked for, from engines that
    cannot hold an output to it, would read as one that has it: refused, where unknown fields
    are ignored (``test_completion_options.py``: completions' ``echo`` with ``logprobs``)."""
    what = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    if field == "tool_choice":
        what["tools"] = [{"type": "function", "function": {"name": "f"}}]
    err = await expect(client, path, body(model="evinfra-fake", max_tokens=2, **what,
                                          **{field: value}), 400, param=field)
    assert "not supported" in err["message"] or "constrained decoding" in err["message"]
    neutral = {"logprobs": False, "response_format": {"type": "text"}} if path == CHAT else \
        {"logprobs": None, "echo": False, "best_of": 1}
    r = await client.post(path, json={"model": "evinfra-fake", "max_tokens": 2, **what,
                                      "user": "u", **neutral})
    assert r.status == 200, await r.text()


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "guided_json", {"type": "object"}), (CHAT, "guided_regex", "a+"),
    ("/v1/completions", "guided_choice", ["a"]), (CHAT, "guided_grammar", 'root ::= "a"'),
    (CHAT, "stop_regex", "\\d"), ("/v1/completions", "prompt_logprobs", 1),
    (CHAT, "skip_special_tokens", False), (CHAT, "functions", [{"name": "f"}]),
    (CHAT, "function_call", "auto"), (CHAT, "audio", {"voice": "x"}),
    (CHAT, "web_search_options", {}), ("/v1/completions", "suffix", "}")])
async def test_fields_other_servers_take_for_another_answer_are_refused(client, path, field,
                                                                          value):
    """Ignored, each would get an answer other than the one asked for, without a word: a 400
    that names the field and says what to use instead."""
    what = {"messages": MSG} if path == CHAT else {"prompt": "hi"}
    err = await expect(client, path, body(model="evinfra-fake", max_tokens=2, **what,
                                          **{field: value}), 400, param=field)
    assert err["message"].startswith(f"{field}: ")
    r = await client.post(path, json={"model": "evinfra-fake", "max_tokens": 2, **what,
                                      field: None, "skip_special_tokens": True})
    assert r.status == 200, await r.text()


async def test_bad_split_requests(client):
    await expect(client, "/v1/evinfra/split", body(prefill=["n0", "zz"]), 400, param="prefill")
    await expect(client, "/v1/evinfra/split", body(prefill=["n0", "n1", "n2", "n3"]), 400)
    await expect(client, "/v1/evinfra/split", body(prefil=["n0"]), 400)


@pytest.mark.parametrize("header", ["X-Evinfra-Branch-Final", "X-Dynamo-Session-Final"])
async def test_a_branch_final_flag_must_say_true_or_false(client, service, header):
    """A typo in the final flag is refused, not read as "false" (which would keep the
    branch's counts after its end); nothing is submitted."""
    before = service.router.in_flight()
    headers = {"Content-Type": "application/json", "X-Evinfra-Branch-Id": "agent-x",
               header: "ture"}
    err = await expect(client, CHAT, body(model="evinfra-fake", messages=MSG, max_tokens=2), 400,
                       param=header, headers=headers)
    assert "'ture'" in err["message"]
    assert service.router.in_flight() == before and "agent-x" not in service.directory.branches
    for value in ("TRUE", "1", "no", ""):
        r = await client.post(CHAT, json={"model": "evinfra-fake", "messages": MSG,
                                          "max_tokens": 2}, headers={**headers, header: value})
        assert r.status == 200, await r.text()


async def test_the_server_still_serves_after_all_that(client):
    await test_malformed_json(client)
    await test_oversized_body(client)
    r = await client.post(CHAT, json={"model": "evinfra-fake", "messages": MSG, "max_tokens": 5})
    assert r.status == 200, await r.text()
    assert (await r.json())["usage"]["completion_tokens"] <= 5


@pytest.mark.parametrize("config_overrides", [{"server": {"api_key": "k1", "admin_key": "k2"}}])
async def test_keys_guard_inference_and_admin_routes(client):
    r = await client.post(CHAT, json={"model": "evinfra-fake", "messages": MSG, "max_tokens": 3})
    assert r.status == 401
    r = await client.post(CHAT, json={"model": "evinfra-fake", "messages": MSG, "max_tokens": 3},
                          headers={"Authorization": "Bearer k1"})
    assert r.status == 200
    r = await client.post("/v1/evinfra/split", json={"prefill": ["n0"]},
                          headers={"Authorization": "Bearer k1"})
    assert r.status == 401
    assert (await client.get("/health")).status == 200


async def test_return_token_ids_streaming_and_not(client):
    r = await client.post("/v1/completions", json={"model": "evinfra-fake", "prompt": [65, 66, 67],
                                                   "max_tokens": 6, "ignore_eos": True,
                                                   "return_token_ids": True})
    choice = (await r.json())["choices"][0]
    assert len(choice["token_ids"]) == 6 and bytes(choice["token_ids"]).decode() == choice["text"]
    r = await client.post("/v1/completions", json={"model": "evinfra-fake", "prompt": [65, 66, 67],
                                                   "max_tokens": 6, "ignore_eos": True,
                                                   "return_token_ids": True, "stream": True})
    ids = []
    async for line in r.content:
        if line.startswith(b"data: {"):
            ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
    assert len(ids) == 6


async def test_a_body_that_does_not_decompress_is_a_400(client):
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    # The server drops a connection whose body it could not read: the next request opens
    # its own.
    err = await expect(client, CHAT, b"not gzip at all", 400,
                       headers={**headers, "Connection": "close"})
    assert "request body" in err["message"]
    good = gzip.compress(body(model="evinfra-fake", messages=MSG, max_tokens=2))
    r = await client.post(CHAT, data=good, headers=headers)
    assert r.status == 200, await r.text()
