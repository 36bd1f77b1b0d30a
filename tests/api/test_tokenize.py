"""``/tokenize`` and ``/detokenize`` (vLLM's and SGLang's routes): the tokens this server
prefills for a completion's prompt or a chat's messages and tools, which a harness counts
against ``max_model_len`` before it sends or compacts; bad bodies are 4xx naming the field."""

import pytest

from tests.api.conftest import body, openai_client, spy_submissions

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


async def test_a_prompt_and_messages_count_what_is_prefilled(client, service):
    r = await client.post("/tokenize", data=body(model="evinfra-fake", prompt="héllo"))
    assert r.status == 200
    assert await r.json() == {"count": 6, "tokens": list("héllo".encode()),
                              "max_model_len": service.config.model.max_context_tokens}
    submitted = spy_submissions(service)
    await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, tools=TOOLS, max_tokens=2)
    r = await client.post("/tokenize", data=body(messages=MESSAGES, tools=TOOLS))
    got = await r.json()
    assert got["tokens"] == submitted[0].tokens.tolist() and got["count"] == len(got["tokens"])
    r = await client.post("/tokenize", data=body(messages=MESSAGES))
    assert (await r.json())["count"] < got["count"]  # the tools are part of the prompt


async def test_detokenize_reads_tokens_back(client):
    r = await client.post("/tokenize", data=body(prompt="round trip ✓"))
    tokens = (await r.json())["tokens"]
    r = await client.post("/detokenize", data=body(model="evinfra-fake", tokens=tokens))
    assert await r.json() == {"prompt": "round trip ✓"}
    r = await client.post("/detokenize", data=body(tokens=[]))
    assert await r.json() == {"prompt": ""}


@pytest.mark.parametrize("route,fields,status,param", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"prompt": 7}, 400, "prompt"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2 ** 40]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2 ** 64 - 1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
async def test_bad_bodies_name_the_field(client, route, fields, status, param):
    r = await client.post(route, data=body(**fields))
    assert r.status == status, await r.text()
    err = (await r.json())["error"]
    assert err["param"] == param and err["message"]
