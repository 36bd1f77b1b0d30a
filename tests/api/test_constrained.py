"""Constrained output: a JSON ``response_format`` and a forced ``tool_choice`` reach the engines
as the JSON schema their grammar holds the output to, and a forced choice's output (the array
of calls) comes back as tool calls, whole and streamed. Engines without a grammar (the fake
ones, unless a test says otherwise) get no such request: it is refused."""

import json

import pytest

from evinfra.drivers.fake.driver import FakeDriver
from tests.api.conftest import body, model_says, openai_client, spy_submissions

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "read a.py"}]
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "ls"}}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture
def grammar(monkeypatch, service):
    """The engines hold outputs to grammars (as SGLang with xgrammar does); the submissions
    the service gets."""
    monkeypatch.setattr(FakeDriver, "constrains_output", True)
    return spy_submissions(service)


def schemas(submitted: list) -> list:
    return [s.sampling.json_schema for s in submitted]


async def test_refused_by_engines_without_a_grammar(client):
    for fields, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice")):
        r = await client.post(CHAT, data=body(model="evinfra-fake", messages=MESSAGES,
                                              max_tokens=4, **fields))
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["param"] == param and "constrained decoding" in err["message"]


async def test_json_response_formats(client, grammar, monkeypatch):
    model_says(monkeypatch, '{"ok": true}')
    oa = openai_client(client)
    r = await oa.chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=20,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert json.loads(r.choices[0].message.content) == {"ok": True}
    await oa.chat.completions.create(model="evinfra-fake", messages=MESSAGES, max_tokens=20,
                                     response_format={"type": "json_object"})
    await oa.chat.completions.create(model="evinfra-fake", messages=MESSAGES, max_tokens=20)
    assert [json.loads(s) if s else s for s in schemas(grammar)] == \
        [SCHEMA, {"type": "object"}, None]


async def test_a_named_tool_choice_comes_back_as_its_call(client, grammar, monkeypatch):
    model_says(monkeypatch, '[{"name": "read_file", "parameters": {"path": "a.py"}}]')
    oa = openai_client(client)
    kw = dict(model="evinfra-fake", messages=MESSAGES, max_tokens=80, tools=TOOLS,
              tool_choice={"type": "function", "function": {"name": "read_file"}})
    r = await oa.chat.completions.create(**kw)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and m.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.message.tool_calls] \
        == [("read_file", {"path": "a.py"})]
    calls, text, finish = [], "", None
    async for chunk in await oa.chat.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        calls += c.delta.tool_calls or []
        text += c.delta.content or ""
        finish = c.finish_reason or finish
    assert [(c.index, c.function.name) for c in calls] == [(0, "read_file")]
    assert text == "" and finish == "tool_calls"
    # The schema: an array of calls of that tool, its parameters as the request gave them.
    schema = json.loads(schemas(grammar)[0])
    assert schema["type"] == "array" and schema["minItems"] == 1
    item = schema["items"]["properties"]
    assert item["name"] == {"type": "string", "enum": ["read_file"]}
    assert item["parameters"] == TOOLS[0]["function"]["parameters"]


async def test_required_is_any_tool_and_one_without_parallel_calls(client, grammar,
                                                                   monkeypatch):
    model_says(monkeypatch, '[{"name": "ls", "parameters": {}}]')
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=80, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["ls"]
    schema = json.loads(schemas(grammar)[0])
    assert schema["maxItems"] == 1
    assert [a["properties"]["name"]["enum"] for a in schema["items"]["anyOf"]] == \
        [["read_file"], ["ls"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}


async def test_an_output_cut_short_is_text(client, grammar, monkeypatch):
    model_says(monkeypatch, '[{"name": "read_file", "param')
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=80, tools=TOOLS,
        tool_choice="required")
    m = r.choices[0].message
    assert m.tool_calls is None and m.content == '[{"name": "read_file", "param'


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
async def test_bad_constraints_are_400s(client, grammar, fields, param):
    r = await client.post(CHAT, data=body(model="evinfra-fake", messages=MESSAGES, max_tokens=4,
                                          **fields))
    assert r.status == 400, await r.text()
    assert (await r.json())["error"]["param"] == param


async def test_responses_forced_call_and_json_format(client, grammar, monkeypatch):
    oa = openai_client(client)
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]
    model_says(monkeypatch, '[{"name": "read_file", "parameters": {"path": "a.py"}}]')
    r = await oa.responses.create(model="evinfra-fake", input="read a.py", tools=tools,
                                  tool_choice={"type": "function", "name": "read_file"})
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == \
        [("function_call", "read_file", {"path": "a.py"})]
    model_says(monkeypatch, '{"ok": false}')
    r = await oa.responses.create(model="evinfra-fake", input="ok?", text={"format": {
        "type": "json_schema", "name": "a", "schema": SCHEMA, "strict": True}})
    assert json.loads(r.output_text) == {"ok": False}
    assert json.loads(schemas(grammar)[1]) == SCHEMA
    called = json.loads(schemas(grammar)[0])["items"]["properties"]["name"]
    assert called["enum"] == ["read_file"]
    bad = await client.post("/v1/responses", data=body(
        model="evinfra-fake", input="x", tools=tools, tool_choice={"type": "mcp"}))
    assert bad.status == 400 and (await bad.json())["error"]["param"] == "tool_choice"


async def test_anthropic_forced_tool_use(client, grammar, monkeypatch):
    from tests.api.test_anthropic import anthropic_client

    a = anthropic_client(client)
    tools = [{"name": "read_file", "input_schema": {"type": "object"}},
             {"name": "ls", "input_schema": {"type": "object"}}]
    model_says(monkeypatch, '[{"name": "ls", "parameters": {}}]')
    m = await a.messages.create(model="evinfra-fake", max_tokens=60, tools=tools,
                                tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "look"}])
    assert m.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "ls", {})]
    assert len(json.loads(schemas(grammar)[0])["items"]["anyOf"]) == 2
    r = await client.post("/v1/messages", data=body(
        model="evinfra-fake", max_tokens=4, tools=tools, tool_choice={"type": "tool"},
        messages=[{"role": "user", "content": "look"}]))
    assert r.status == 400 and "needs the tool's name" in (await r.json())["error"]["message"]


@pytest.mark.parametrize("config_overrides", [{"model": {"reasoning_parser": "think"}}])
async def test_a_thinking_model_may_reason_before_the_grammar_holds_it(
        client, grammar, monkeypatch, config_overrides):
    """An engine that lets the model reason before its grammar applies (SGLang with
    --reasoning-parser) writes the block first: it comes back apart, the JSON or the calls
    after it as the answer, whole and streamed; an output with no block is all answer."""
    oa = openai_client(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    for says, reasoning in (('<think>is it?</think>{"ok": true}', "is it?"),
                            ('{"ok": true}', None)):
        model_says(monkeypatch, says)
        r = await oa.chat.completions.create(model="evinfra-fake", messages=MESSAGES,
                                             max_tokens=40, response_format=fmt)
        m = r.choices[0].message
        assert (getattr(m, "reasoning_content", None), json.loads(m.content)) == \
            (reasoning, {"ok": True})
    model_says(monkeypatch, '<think>read it</think>[{"name": "ls", "parameters": {}}]')
    kw = dict(model="evinfra-fake", messages=MESSAGES, max_tokens=80, tools=TOOLS,
              tool_choice="required")
    m = (await oa.chat.completions.create(**kw)).choices[0].message
    assert (m.reasoning_content, [c.function.name for c in m.tool_calls]) == ("read it", ["ls"])
    reasoning, calls = "", []
    async for chunk in await oa.chat.completions.create(stream=True, **kw):
        reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
        calls += chunk.choices[0].delta.tool_calls or []
    assert reasoning == "read it" and [c.function.name for c in calls] == ["ls"]


def grammars(submitted: list) -> list:
    """Each submission's constraint as SGLang's sampling parameters name it."""
    out = []
    for s in submitted:
        given = {k: getattr(s.sampling, k) for k in ("json_schema", "regex", "ebnf")
                 if getattr(s.sampling, k) is not None}
        out.append(given)
    return out


async def test_regex_choice_and_grammar_constraints(client, grammar, monkeypatch):
    """SGLang's ``regex`` and ``ebnf`` and vLLM's ``structured_outputs`` reach the engines as
    their grammar's parameters; a choice is an EBNF alternation of its strings (quotes and
    backslashes escaped). The output is the answer, tools or not."""
    oa = openai_client(client)
    model_says(monkeypatch, "2026-12-01")
    kw = dict(model="evinfra-fake", messages=MESSAGES, max_tokens=20)
    r = await oa.chat.completions.create(**kw, extra_body={"regex": r"\d{4}-\d\d-\d\d"})
    assert r.choices[0].message.content == "2026-12-01"
    # With tools the template shows, a grammar's output is still all answer.
    model_says(monkeypatch, '<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    r = await oa.chat.completions.create(**kw, tools=TOOLS,
                                         extra_body={"ebnf": 'root ::= "<tool_call>" [^<]*'})
    m = r.choices[0].message
    assert m.tool_calls is None and m.content.startswith("<tool_call>")
    for so in ({"choice": ["yes", 'say "no"', "a\\b"]}, {"regex": "[a-z]+"},
               {"grammar": 'root ::= "x"'}, {"json": SCHEMA}, {"json": json.dumps(SCHEMA)},
               {"json_object": True}):
        await oa.chat.completions.create(**kw, extra_body={"structured_outputs": so})
    # Completions take them too, and SGLang's json_schema text.
    await oa.completions.create(model="evinfra-fake", prompt="Date:", max_tokens=12,
                                extra_body={"regex": r"\d+"})
    await oa.completions.create(model="evinfra-fake", prompt="Is it?", max_tokens=4,
                                extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    await oa.completions.create(model="evinfra-fake", prompt="{", max_tokens=12,
                                extra_body={"json_schema": json.dumps(SCHEMA)})
    assert grammars(grammar) == [
        {"regex": r"\d{4}-\d\d-\d\d"}, {"ebnf": 'root ::= "<tool_call>" [^<]*'},
        {"ebnf": 'root ::= "yes" | "say \\"no\\"" | "a\\\\b"'}, {"regex": "[a-z]+"},
        {"ebnf": 'root ::= "x"'}, {"json_schema": json.dumps(SCHEMA)},
        {"json_schema": json.dumps(SCHEMA)}, {"json_schema": '{"type": "object"}'},
        {"regex": r"\d+"}, {"ebnf": 'root ::= "yes" | "no"'},
        {"json_schema": json.dumps(SCHEMA)}]


@pytest.mark.parametrize("config_overrides", [{"model": {"reasoning_parser": "think"}}])
async def test_a_regex_answer_after_reasoning(client, grammar, monkeypatch, config_overrides):
    model_says(monkeypatch, "<think>count</think>42")
    r = await openai_client(client).chat.completions.create(
        model="evinfra-fake", messages=MESSAGES, max_tokens=20, extra_body={"regex": r"\d+"})
    m = r.choices[0].message
    assert (m.reasoning_content, m.content) == ("count", "42")


@pytest.mark.parametrize("path,fields,param", [
    (CHAT, {"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),
    (CHAT, {"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
    (CHAT, {"tools": TOOLS, "tool_choice": "required",
            "structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice"),
    (CHAT, {"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}},
     "structured_outputs.grammar"),
    (CHAT, {"regex": ""}, "regex"),
    (CHAT, {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (CHAT, {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    (CHAT, {"structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    ("/v1/completions", {"json_schema": "[1, 2"}, "json_schema"),
    ("/v1/completions", {"json_schema": "{}", "regex": "a"}, "regex"),
])
async def test_two_constraints_or_a_bad_one_are_400s(client, grammar, path, fields, param):
    prompt = {"messages": MESSAGES} if path == CHAT else {"prompt": "x"}
    r = await client.post(path, data=body(model="evinfra-fake", max_tokens=4, **prompt,
                                          **fields))
    assert r.status == 400, await r.text()
    assert (await r.json())["error"]["param"] == param
    assert not grammar


async def test_engine_constraints_refused_by_engines_without_a_grammar(client):
    for path, prompt, fields, param in (
            (CHAT, {"messages": MESSAGES}, {"regex": "a"}, "regex"),
            ("/v1/completions", {"prompt": "x"}, {"structured_outputs": {"choice": ["a"]}},
             "structured_outputs.choice")):
        r = await client.post(path, data=body(model="evinfra-fake", max_tokens=4, **prompt,
                                              **fields))
        assert r.status == 400
        err = (await r.json())["error"]
        assert err["param"] == param and "constrained decoding" in err["message"]
