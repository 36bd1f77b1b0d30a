"""``/tokenize`` and ``/detokenize`` (vLLM's and SGLang's routes): the tokens this server
prefills for a completion's prompt or a chat's messages and tools, which a harness counts
against ``max_model_len`` before it sends or compacts, and vLLM's options; a completion's
text prompt gets the BOS the model's tokenizer adds, as SGLang and vLLM read it; bad bodies
are 4xx naming the field."""

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from evinfra.api import build_app
from evinfra.api.tokenizer import HFTokenizer
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


async def test_vllms_options_open_or_close_the_turn_and_spell_the_tokens(client):
    whole = await (await client.post("/tokenize", data=body(messages=MESSAGES))).json()
    r = await client.post("/tokenize", data=body(messages=MESSAGES, add_generation_prompt=False,
                                                 return_token_strs=True))
    got = await r.json()
    opened = list(b"<|assistant|>\n")
    assert got["tokens"] + opened == whole["tokens"] and "token_strs" not in whole
    assert got["token_strs"] == [chr(t) for t in got["tokens"]]


def bos_model(path) -> HFTokenizer:
    """A word-level model whose tokenizer adds ``<s>`` (id 1) to a text, as Llama's does."""
    vocab = {"<unk>": 0, "<s>": 1, "hello": 2, "world": 3, "<|user|>": 4, "<|assistant|>": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.add_special_tokens(["<s>"])
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": (
        "{{ bos_token }}{% for m in messages %} <|{{ m.role }}|> {{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %} <|assistant|>{% endif %}")}))
    return HFTokenizer(path)


async def test_a_text_prompt_gets_the_models_bos_and_a_chat_its_templates(service, tmp_path):
    async with TestClient(TestServer(build_app(service, bos_model(tmp_path)))) as c:
        async def tokenize(**fields):
            r = await c.post("/tokenize", data=body(**fields))
            assert r.status == 200, await r.text()
            return await r.json()

        assert (await tokenize(prompt="hello world"))["tokens"] == [1, 2, 3]
        got = await tokenize(prompt="hello world", add_special_tokens=False,
                             return_token_strs=True)
        assert got["tokens"] == [2, 3] and got["token_strs"] == ["hello", "world"]
        chat = [{"role": "user", "content": "hello world"}]
        assert (await tokenize(messages=chat))["tokens"] == [1, 4, 2, 3, 5]  # one BOS
        assert (await tokenize(messages=chat, add_special_tokens=True))["tokens"] == \
            [1, 1, 4, 2, 3, 5]  # asked for: the template's and the tokenizer's, as vLLM does
        assert (await tokenize(messages=chat, add_generation_prompt=False))["tokens"] == \
            [1, 4, 2, 3]
        submitted = spy_submissions(service)
        for prompt in ("hello world", [2, 3]):
            r = await c.post("/v1/completions", data=body(model="evinfra-fake", prompt=prompt,
                                                            max_tokens=1))
            assert r.status == 200, await r.text()
        assert [s.tokens.tolist() for s in submitted] == [[1, 2, 3], [2, 3]]  # ids as given


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
