"""Issue 41's findings an operator met, each reproduced: the admin routes open with only an
API key set, the 500 of a completions batch mixing texts and ids, and the smaller ones
(Anthropic's streamed usage, ``/tokenize``'s message, a chat message with no content, the
type of an unknown route's error, the ``Server`` header)."""

from __future__ import annotations

import json

import pytest

from evinfra.api.auth import ADMIN_OFF, exposure
from evinfra.config import ServerConfig
from evinfra.errors import EvinfraError
from tests.api.conftest import body

USER = [{"role": "user", "content": "hi"}]
ADMIN = [("post", "/v1/evinfra/split", {"prefill": ["n0"]}),
         ("post", "/v1/evinfra/nodes/n1/cordon", None),
         ("post", "/v1/evinfra/nodes/n1/uncordon", None),
         ("post", "/v1/branches/b1/end", None),
         ("get", "/v1/branches/b1", None)]


async def call(client, method: str, path: str, data, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await getattr(client, method)(path, data=None if data is None else json.dumps(data),
                                         headers=headers)


@pytest.mark.parametrize("config_overrides", [{"server": {"api_key": "sk-user"}}])
async def test_with_only_an_api_key_the_admin_routes_are_refused_to_everyone(client):
    chat = await client.post("/v1/chat/completions", data=body(
        model="evinfra-fake", messages=USER, max_tokens=2),
        headers={"Authorization": "Bearer sk-user"})
    assert chat.status == 200  # the user key serves the inference routes
    for method, path, data in ADMIN:
        for key in (None, "sk-user", "wrong"):
            r = await call(client, method, path, data, key)
            error = (await r.json())["error"]
            assert r.status == 403 and error["code"] == "admin_disabled", (path, key, error)
            assert "admin_key" in error["message"]


@pytest.mark.parametrize("config_overrides", [{"server": {"api_key": "sk-user",
                                                          "admin_key": "sk-admin"}}])
async def test_with_an_admin_key_it_alone_opens_the_admin_routes(client):
    r = await call(client, "post", "/v1/evinfra/nodes/n1/cordon", None, "sk-user")
    assert r.status == 401
    r = await call(client, "post", "/v1/evinfra/nodes/n1/cordon", None, "sk-admin")
    assert r.status == 200


async def test_with_no_keys_on_loopback_the_admin_routes_stay_open(client):
    r = await call(client, "post", "/v1/evinfra/nodes/n1/cordon", None)
    assert r.status == 200


def test_what_the_server_says_about_its_keys_at_start():
    assert exposure(ServerConfig()) is None  # loopback, no keys: the default
    assert exposure(ServerConfig(host="::1")) is None
    assert exposure(ServerConfig(api_key="k")) == ADMIN_OFF
    assert exposure(ServerConfig(host="0.0.0.0", api_key="k", admin_key="a")) is None
    for host in ("0.0.0.0", "10.1.2.3", "", "example.org"):
        with pytest.raises(EvinfraError, match="server.open_network"):
            exposure(ServerConfig(host=host))
    said = exposure(ServerConfig(host="0.0.0.0", open_network=True))
    assert said is not None and "open to whoever reaches" in said


@pytest.mark.parametrize("prompt,where", [(["abc", 5], "prompt[1]"), ([[1, 2], 3], "prompt[1]"),
                                          ([[1, 2], "abc", None], "prompt[2]")])
async def test_a_batch_mixing_texts_and_ids_is_a_400_not_a_500(client, prompt, where):
    r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt=prompt,
                                                       max_tokens=2))
    error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == where, error


async def test_a_batch_of_texts_or_of_ids_is_served(client):
    for prompt in (["abc", "de"], [[1, 2], [3]]):  # control: each kind alone is fine
        r = await client.post("/v1/completions", data=body(model="evinfra-fake", prompt=prompt,
                                                           max_tokens=2))
        assert r.status == 200 and len((await r.json())["choices"]) == 2


async def test_anthropic_message_start_counts_uncached_input_tokens(client):
    """Anthropic's ``input_tokens`` is the uncached count, streamed or not."""
    long = [{"role": "user", "content": "x" * 3000}]
    headers = {"X-Evinfra-Branch-Id": "cc-1", "x-api-key": "none",
               "anthropic-version": "2023-06-01"}
    req = {"model": "evinfra-fake", "max_tokens": 5, "messages": long}
    first = await (await client.post("/v1/messages", data=json.dumps(req),
                                     headers=headers)).json()
    nxt = long + [{"role": "assistant", "content": first["content"][0]["text"]},
                  {"role": "user", "content": "go on"}]
    r = await client.post("/v1/messages", data=json.dumps({**req, "messages": nxt,
                                                           "stream": True}), headers=headers)
    events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
              if line.startswith("data: ")]
    start = events[0]["message"]["usage"]
    final = [e for e in events if e["type"] == "message_delta"][-1]["usage"]
    assert final["cache_read_input_tokens"] >= 3000 - 64
    assert start["input_tokens"] == final["input_tokens"] < 100
    assert start["cache_read_input_tokens"] == final["cache_read_input_tokens"]


async def test_tokenize_with_neither_prompt_nor_messages_says_so(client):
    r = await client.post("/tokenize", data=body(model="evinfra-fake"))
    error = (await r.json())["error"]
    assert r.status == 400 and error["message"] == "give a prompt or messages"
    r = await client.post("/tokenize", data=body(prompt="a", messages=USER))
    assert r.status == 400 and "not both" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "assistant"}, {"role": "system"}])
async def test_a_chat_message_with_no_content_is_refused(client, message):
    r = await client.post("/v1/chat/completions", data=body(
        model="evinfra-fake", messages=[message, *USER], max_tokens=2))
    error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == "messages[0].content", error


async def test_an_assistant_message_with_tool_calls_may_have_no_content(client):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = await client.post("/v1/chat/completions", data=body(
        model="evinfra-fake", messages=messages, max_tokens=2))
    assert r.status == 200, await r.text()


async def test_an_unknown_route_is_not_found_and_no_version_is_advertised(client):
    r = await client.get("/v1/nothing-here")
    error = (await r.json())["error"]
    assert r.status == 404 and error["type"] == "not_found_error", error
    r = await client.post("/v1/messages/nothing")
    assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    for path in ("/health", "/v1/nothing-here"):
        server = (await client.get(path)).headers["Server"]
        assert server == "evinfra" and "aiohttp" not in server.lower()
