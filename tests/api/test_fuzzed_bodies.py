"""Whatever a body holds, the answer is a 200 or a 4xx, never a 5xx (bad input is the
client's error, and the server keeps serving): hypothesis-made bodies, seeded. The engines
claim a grammar, so constrained outputs (JSON answers, forced calls) get past the refusal
to the schemas and the reading of the (random) output."""

import asyncio
import json
import threading

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evinfra.api import build_app
from evinfra.api.tokenizer import ByteTokenizer
from evinfra.config import parse_config
from evinfra.core.clock import WallClock
from evinfra.drivers.fake.driver import FakeDriver
from evinfra.control import Service
from tests.api.conftest import BASE, merged

WORDS = ["auto", "none", "required", "function", "text", "json_object", "user", "assistant",
         "tool", "system", "<tool_call>", "<think>"]
FIELDS = ["type", "function", "name", "arguments", "parameters", "content", "role",
          "tool_calls", "id", "text", "properties", "json_schema", "include_usage", "branch_id",
          "final"]
KEYS = ["model", "messages", "prompt", "max_tokens", "stream", "stream_options", "temperature",
        "top_p", "n", "stop", "seed", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "top_k", "min_p", "logit_bias", "ignore_eos", "evinfra",
        "return_token_ids", "tools", "tool_choice", "parallel_tool_calls", "response_format",
        "chat_template_kwargs", "max_completion_tokens", "logprobs", "top_logprobs", "echo",
        "best_of", "regex", "ebnf", "json_schema", "structured_outputs", "min_tokens",
        "include_stop_str_in_output", "no_stop_trim", "reasoning_effort"]
leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
                 st.sampled_from(WORDS))
value = st.recursive(leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)),
    max_leaves=10)
function = st.one_of(value, st.fixed_dictionaries(
    {"name": st.one_of(st.text(max_size=5), value)},
    optional={"arguments": st.one_of(st.just('{"a": 1}'), st.just("{oops"), value),
              "parameters": value}))
call = st.one_of(value, st.fixed_dictionaries({"function": function},
                                              optional={"id": value, "type": value}))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
    optional={"content": st.one_of(st.text(max_size=5), st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"])}, optional={"text": value}),
        max_size=2), value), "tool_calls": st.one_of(st.lists(call, max_size=2), value)})
tools = st.one_of(value, st.lists(st.fixed_dictionaries(
    {"function": function}, optional={"type": st.sampled_from(["function", "other"])}),
    max_size=2))
short_name = st.one_of(st.text(max_size=5), st.integers())
anything = st.dictionaries(st.sampled_from(KEYS), value, max_size=8)
"""Bodies that mostly fail the schema."""
plausible = st.fixed_dictionaries(
    {"model": st.just("evinfra-fake"), "max_tokens": st.integers(-1, 6),
     "messages": st.one_of(value, st.lists(message, min_size=1, max_size=3))},
    optional={"tools": tools, "stream": st.booleans(),
              "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), value,
                                       st.just({"type": "function", "function": {"name": "f"}})),
              "response_format": st.one_of(value, st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                  optional={"json_schema": st.one_of(value, st.fixed_dictionaries(
                      {"name": short_name}, optional={"schema": value}))})),
              "logprobs": st.one_of(st.booleans(), value), "top_logprobs": st.integers(-2, 25),
              "parallel_tool_calls": st.booleans(), "n": st.integers(0, 3),
              "stop": st.lists(st.sampled_from(["a", "<", "</think>"]), max_size=2),
              "chat_template_kwargs": st.dictionaries(st.text(max_size=5), value, max_size=2),
              "structured_outputs": st.one_of(value, st.fixed_dictionaries({}, optional={
                  "regex": st.one_of(st.text(max_size=3), value),
                  "choice": st.one_of(st.lists(st.text(max_size=3), max_size=2), value),
                  "json": st.one_of(st.just('{"type": "object"}'), st.just("{x"), value),
                  "grammar": value, "json_object": value})),
              "regex": st.one_of(st.text(max_size=3), value), "min_tokens": st.integers(-1, 8),
              "include_stop_str_in_output": st.booleans(),
              "reasoning_effort": st.one_of(st.sampled_from(["low", "high"]), value)})
"""Chat bodies that get past the schema more often than not, to reach the later checks."""
token_ids = st.lists(st.integers(-1, 300), max_size=4)
plausible_completion = st.fixed_dictionaries(
    {"model": st.just("evinfra-fake"), "max_tokens": st.integers(-1, 6),
     "prompt": st.one_of(st.text(max_size=5), token_ids, value,
                         st.lists(st.one_of(st.text(max_size=3), token_ids), max_size=3))},
    optional={"stream": st.booleans(), "echo": st.booleans(), "n": st.integers(0, 3),
              "best_of": st.one_of(st.none(), st.integers(0, 4)),
              "logprobs": st.one_of(st.none(), st.integers(-1, 3)),
              "stop": st.lists(st.sampled_from(["a", "!", ""]), max_size=2),
              "stream_options": st.just({"include_usage": True}),
              "json_schema": st.one_of(st.just('{"type": "object"}'), st.text(max_size=4)),
              "ebnf": st.one_of(st.text(max_size=4), value), "min_tokens": st.integers(-1, 8),
              "no_stop_trim": st.booleans(),
              "evinfra": st.one_of(value, st.just({"branch_id": "b"}))})
"""Completion bodies (echo, best_of, batches of prompts) that mostly get past the schema."""


@pytest.fixture(scope="module")
def post():
    """A service and its app on a loop of their own (hypothesis drives a sync test)."""
    grammar = pytest.MonkeyPatch()
    grammar.setattr(FakeDriver, "constrains_output", True)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(60)

    async def start():
        config = parse_config(merged(BASE, {"model": {"reasoning_parser": "think"}}))
        svc = Service.from_config(config, WallClock())
        await svc.start()
        client = TestClient(TestServer(build_app(svc, ByteTokenizer())))
        await client.start_server()
        return svc, client

    svc, client = run(start())

    async def send(path, body):
        r = await client.post(path, data=json.dumps(body))
        return r.status, await r.text()

    yield lambda path, body: run(send(path, body))

    async def stop():
        await client.close()
        await svc.stop()

    run(stop())
    loop.call_soon_threadsafe(loop.stop)
    grammar.undo()


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.one_of(st.tuples(anything, st.booleans()), st.tuples(plausible, st.just(True)),
                     st.tuples(plausible_completion, st.just(False))))
def test_no_body_gets_a_server_error(post, case):
    body, chat = case
    status, text = post("/v1/chat/completions" if chat else "/v1/completions", body)
    assert status < 500, (body, text[:500])


short = st.one_of(st.text(max_size=5), value)
"""A string, as a field is meant to be, or anything."""
block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])},
    optional={"text": short, "name": st.one_of(st.just("f"), value), "input": value,
              "id": short, "tool_use_id": short, "thinking": short,
              "content": st.one_of(st.text(max_size=5), st.lists(value, max_size=2), value)})
anthropic_body = st.fixed_dictionaries(
    {"model": st.just("evinfra-fake"), "max_tokens": st.integers(-1, 6),
     "messages": st.one_of(value, st.lists(st.fixed_dictionaries(
         {"role": st.sampled_from(["user", "assistant", "user", "assistant", "system"]),
          "content": st.one_of(st.text(max_size=5), st.lists(block, max_size=3), value)}),
         min_size=1, max_size=3))},
    optional={"system": st.one_of(st.text(max_size=5), st.lists(block, max_size=2), value),
              "tools": st.one_of(value, st.lists(st.fixed_dictionaries(
                  {"name": st.one_of(st.just("f"), value), "input_schema": value},
                  optional={"type": st.sampled_from(["custom", "bash_20250124"])}),
                  max_size=2)),
              "tool_choice": st.one_of(value, st.fixed_dictionaries(
                  {"type": st.sampled_from(["auto", "any", "none", "tool"])},
                  optional={"name": st.one_of(st.just("f"), value),
                            "disable_parallel_tool_use": st.booleans()})),
              "thinking": st.one_of(value, st.fixed_dictionaries(
                  {"type": st.sampled_from(["enabled", "disabled"])})),
              "stop_sequences": st.one_of(value, st.lists(st.sampled_from(["a", "<"]),
                                                           max_size=2)),
              "stream": st.booleans()})
"""Anthropic Messages bodies, mostly of the right shape."""


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=anthropic_body, count=st.booleans())
def test_no_anthropic_body_gets_a_server_error(post, body, count):
    status, text = post("/v1/messages/count_tokens" if count else "/v1/messages", body)
    assert status < 500, (body, text[:500])


item = st.one_of(value, st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                              "local_shell_call"])},
    optional={"role": st.sampled_from(["user", "assistant", "developer", "tool"]),
              "content": st.one_of(short, st.lists(st.fixed_dictionaries(
                  {"type": st.sampled_from(["input_text", "output_text", "input_image"])},
                  optional={"text": short}), max_size=2)),
              "call_id": short, "name": short, "output": short,
              "arguments": st.one_of(st.just('{"a": 1}'), st.just("[1]"), short)}))
responses_body = st.fixed_dictionaries(
    {"model": st.just("evinfra-fake"), "max_output_tokens": st.integers(-1, 6),
     "input": st.one_of(short, st.lists(item, max_size=4))},
    optional={"instructions": short,
              "tools": st.one_of(value, st.lists(st.fixed_dictionaries(
                  {"type": st.sampled_from(["function", "web_search"])},
                  optional={"name": short, "parameters": value}), max_size=2)),
              "tool_choice": st.one_of(value, st.sampled_from(["auto", "none", "required"]),
                                       st.just({"type": "function", "name": "f"})),
              "text": st.one_of(value, st.fixed_dictionaries({"format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                  optional={"schema": value, "name": short})})),
              "top_logprobs": st.integers(-2, 25),
              "include": st.one_of(value, st.just(["message.output_text.logprobs"])),
              "previous_response_id": st.one_of(st.none(), short), "store": st.booleans(),
              "stream": st.booleans()})
"""Responses API bodies, mostly of the right shape."""


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=responses_body)
def test_no_responses_body_gets_a_server_error(post, body):
    status, text = post("/v1/responses", body)
    assert status < 500, (body, text[:500])
