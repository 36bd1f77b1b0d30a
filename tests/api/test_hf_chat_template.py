"""A model's own chat template (Jinja, from ``tokenizer_config.json``) sees the request's tools
and the call history the way transformers, SGLang and vLLM give them to it."""

import json

import pytest
from tokenizers import Tokenizer, models

from evinfra.api.tokenizer import ByteTokenizer, HFTokenizer
from evinfra.errors import RequestError

# The tool parts of Qwen2.5's template, shortened.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content }}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": "
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{%- endif %}")


def hf(path, template: str) -> HFTokenizer:
    Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).save(
        str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return HFTokenizer(path)


@pytest.fixture
def tok(tmp_path):
    return hf(tmp_path, TEMPLATE)


def test_tools_and_the_call_history_are_rendered(tok):
    tools = [{"type": "function", "function": {"name": "read_file"}}]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "print(1)"}]
    text = tok.apply_chat_template(history, tools)
    assert '<tools>{"type": "function", "function": {"name": "read_file"}}</tools>' in text
    # The arguments, a JSON string on the wire, reach the template as an object.
    assert '{"name": "read_file", "arguments": {"path": "a.py"}}' in text
    assert "<|im_start|>tool\nprint(1)<|im_end|>" in text
    assert "<tools>" not in tok.apply_chat_template(history[:1])


def test_arguments_that_are_not_a_json_object_are_refused(tok):
    for args in ("{oops", "[1]"):
        bad = [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]
        with pytest.raises(RequestError) as e:
            tok.apply_chat_template(bad)
        assert e.value.param == "messages[0].tool_calls"


def test_chat_template_kwargs_reach_the_template_and_replace_nothing(tok):
    hi = [{"role": "user", "content": "hi"}]
    base = tok.apply_chat_template(hi)
    assert tok.apply_chat_template(hi, extra={"enable_thinking": False}) == \
        base + "<think>\n\n</think>"
    assert tok.apply_chat_template(hi, extra={"enable_thinking": True}) == base
    forged = tok.apply_chat_template(hi, extra={"messages": [], "add_generation_prompt": False})
    assert forged == tok.apply_chat_template(hi)


@pytest.fixture
def template_kwargs_seen(monkeypatch) -> list:
    """The variables each render of the built-in template is handed, from now on."""
    seen = []
    real = ByteTokenizer.apply_chat_template

    def spy(self, messages, tools=None, extra=None, add_generation_prompt=True):
        seen.append(extra)
        return real(self, messages, tools, extra, add_generation_prompt)

    monkeypatch.setattr(ByteTokenizer, "apply_chat_template", spy)
    return seen


async def test_the_chat_route_hands_the_template_its_kwargs(client, template_kwargs_seen):
    seen = template_kwargs_seen
    r = await client.post("/v1/chat/completions", json={
        "model": "evinfra-fake", "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status == 200, await r.text()
    assert seen == [{"enable_thinking": False}]


@pytest.mark.parametrize("extra", [{"budget": "ten"}, {"budget": {}}, {"budget": None}])
def test_a_template_that_trips_on_the_requests_values_is_a_400(tmp_path, extra):
    tok = hf(tmp_path, "{{ messages[0].content }}{{ budget + 1 }}{{ budget.x.y }}")
    with pytest.raises(RequestError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], extra=extra)
    assert e.value.message.startswith("chat template:")


async def test_reasoning_effort_reaches_the_template(client, template_kwargs_seen):
    """Chat's ``reasoning_effort`` and the Responses API's ``reasoning.effort`` are the
    template's ``reasoning_effort`` (gpt-oss's template reads it); a ``chat_template_kwargs``
    value wins; an effort OpenAI does not name is a 400."""
    seen = template_kwargs_seen
    chat = {"model": "evinfra-fake", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    for extra in ({"reasoning_effort": "low"},
                  {"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "x",
                                                                        "a": 1}},
                  {"chat_template_kwargs": {"a": 1}}):
        r = await client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status == 200, await r.text()
    r = await client.post("/v1/responses", json={"model": "evinfra-fake", "input": "hi",
                                                  "reasoning": {"effort": "medium",
                                                                "summary": "auto"}})
    assert r.status == 200, await r.text()
    assert seen == [{"reasoning_effort": "low"}, {"reasoning_effort": "x", "a": 1}, {"a": 1},
                    {"reasoning_effort": "medium"}]
    r = await client.post("/v1/chat/completions", json={**chat, "reasoning_effort": "max"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "reasoning_effort"


def test_gpt_oss_style_template_reads_the_effort(tmp_path):
    tok = hf(tmp_path, "Reasoning: {{ reasoning_effort | default('medium') }}\n"
                       "{{ messages[0].content }}")
    hi = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(hi).startswith("Reasoning: medium")
    assert tok.apply_chat_template(hi, extra={"reasoning_effort": "low"}).startswith(
        "Reasoning: low")
