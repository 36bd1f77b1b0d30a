"""``evinfra serve`` (the command line, a separate process) in front of a real SGLang PD pair:
the ``openai`` client's chat, completion and responses requests and the ``anthropic``
client's messages, streaming and not, go through the prefill engine and the decode engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import sglang_config, toml_text
from engines import SERVED_NAME, free_port

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def serve(engines, model_dir, tmp_path_factory):
    port = free_port()
    cfg = tmp_path_factory.mktemp("serve") / "sglang.toml"
    cfg.write_text(toml_text(sglang_config(engines, model_dir, port)))
    log = open(cfg.parent / "evinfra.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "evinfra.cli", "serve", "--config", str(cfg),
         "--log-format", "json"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError("evinfra serve exited:\n"
                                   + (cfg.parent / "evinfra.log").read_text()[-3000:])
            try:
                if _get(url + "/ready")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("evinfra serve not ready in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def client(serve):
    from openai import OpenAI

    return OpenAI(base_url=serve + "/v1", api_key="none", max_retries=0, timeout=60)


def _nodes(serve: str) -> dict:
    return _get(serve + "/v1/evinfra/status")[1]["nodes"]


def test_chat_completion(client, serve):
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Plan the change, then edit."}],
        max_tokens=12, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1
    assert r.usage.prompt_tokens > 8
    status = _get(serve + "/v1/evinfra/status")[1]
    assert status["split"]["prefill"] == ["a"] and status["split"]["decode"] == ["b"]
    assert status["counters"]["ok"] >= 1


def test_chat_completion_stream(client):
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Stream a short answer."}],
        max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})
    finishes, usage = [], None
    for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].finish_reason:
                finishes.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert finishes and finishes[-1] in ("stop", "length")
    assert usage is not None and usage.completion_tokens >= 1


def test_completion_exact_length(client):
    """``ignore_eos`` makes the decode engine produce exactly ``max_tokens``."""
    r = client.completions.create(model=SERVED_NAME, prompt="The router sends each request",
                                  max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16


def test_completion_stream_token_ids(client):
    prompt = list(range(3, 3 + 23))
    chunks = list(client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    # Both engines load identical dummy weights: the same prompt gives the same text again.
    again = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == text


def test_n_choices(client):
    """Choice 1 is a fork sent once choice 0 has prefilled (the engines' ids and streams
    carry both)."""
    r = client.completions.create(model=SERVED_NAME, prompt=list(range(3, 3 + 200)), n=2,
                                  max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [(c.index, c.finish_reason) for c in r.choices] == [(0, "length"), (1, "length")]
    assert r.usage.completion_tokens == 8
    assert r.choices[0].text == r.choices[1].text  # identical dummy weights, temperature 0


def test_best_of_echo_and_a_batch(client):
    """A batch of two prompts, two candidates each, ranked by the log-probabilities the
    engines report for them (not asked for by the client, so not returned); each prompt's
    best one after the prompt's text; all four billed."""
    prompts = ["Count to five.", "Name a color."]
    r = client.completions.create(model=SERVED_NAME, prompt=prompts, best_of=2, echo=True,
                                  max_tokens=4, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text[:len(p)] for c, p in zip(r.choices, prompts)] == prompts
    assert all(c.logprobs is None and c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 16


def test_echo_with_logprobs_scores_the_prompt(client):
    """An evaluation harness's loglikelihood request: the prefill engine reports the
    prompt's log-probabilities (none for the first token), the decode engine the output's;
    whole and streamed alike, and a second choice reads the first's prompt entries."""
    prompt = "Count to five. One, two, three"
    kw = dict(model=SERVED_NAME, prompt=prompt, max_tokens=2, temperature=0, echo=True,
              logprobs=2, extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(n=2, **kw)
    for c in r.choices:
        lp, n_out = c.logprobs, len(c.model_extra["token_ids"])
        assert c.text.startswith(prompt) and n_out == 2
        n_in = len(lp.tokens) - n_out
        assert n_in == r.usage.prompt_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        # (two alternatives may read alike, as U+FFFD: a text keys one of them)
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
        assert "".join(lp.tokens[:n_in]) == prompt
        assert lp.text_offset[n_in] == len(prompt)
    assert r.choices[0].logprobs.token_logprobs[:n_in] == \
        pytest.approx(r.choices[1].logprobs.token_logprobs[:n_in], abs=1e-4)
    first = next(c.choices[0] for c in client.completions.create(stream=True, **kw)
                 if c.choices)
    assert first.text == prompt and len(first.logprobs.tokens) == n_in
    assert first.logprobs.token_logprobs[1:] == \
        pytest.approx(r.choices[0].logprobs.token_logprobs[1:n_in], abs=1e-3)


def test_logprobs(client):
    """The decode engine's log-probabilities, one per output token, whole and streamed; at
    temperature 0 the sampled token is the most likely one."""
    kw = dict(model=SERVED_NAME, messages=[{"role": "user", "content": "Count to five."}],
              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    c = client.chat.completions.create(**kw).choices[0]
    entries = c.logprobs.content
    assert len(entries) == len(c.model_extra["token_ids"]) == 6
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kw)
                if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries],
                                                          abs=1e-4)


def test_constrained_output(client):
    """The engines' grammar (xgrammar) holds even the dummy weights to the schema: a JSON
    answer and a forced call come back valid."""
    sizes = {"type": "string", "enum": ["small", "large"]}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": sizes},
              "required": ["ok", "size"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Pick a size."}]
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=msgs, max_tokens=40, temperature=1.0, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"ok", "size"} and isinstance(out["ok"], bool)
    assert out["size"] in sizes["enum"]
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"size": sizes}, "required": ["size"],
        "additionalProperties": False}}}]
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=msgs, max_tokens=120, temperature=1.0, seed=3, tools=tools,
        tool_choice={"type": "function", "function": {"name": "pick"}},
        parallel_tool_calls=False, extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", (c.message.content, c.model_extra)
    assert len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name == "pick"
    assert json.loads(c.message.tool_calls[0].function.arguments)["size"] in sizes["enum"]
    # A schema the grammar cannot compile: the engines refuse the request, a 400.
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(
            model=SERVED_NAME, messages=msgs, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": {
                    "type": "object", "properties": {"a": {"type": "nonsense"}}}}})
    assert "refused the request" in str(e.value) and "nonsense" in str(e.value)


def test_regex_choice_and_grammar(client):
    """SGLang's regex and EBNF and vLLM's choice hold even the dummy weights' output; a regex
    the grammar cannot compile is the engines' refusal, a 400."""
    import re

    from openai import BadRequestError

    msgs = [{"role": "user", "content": "When?"}]
    kw = dict(model=SERVED_NAME, messages=msgs, max_tokens=16, temperature=1.0, seed=5)
    r = client.chat.completions.create(**kw, extra_body={"regex": r"20[0-9]{2}-[01][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]", r.choices[0].message.content)
    choices = ["yes", 'say "no"']
    r = client.chat.completions.create(**kw, extra_body={
        "structured_outputs": {"choice": choices}})
    assert r.choices[0].message.content in choices
    r = client.completions.create(model=SERVED_NAME, prompt="Pick:", max_tokens=16, seed=5,
                                  extra_body={"ebnf": 'root ::= ("ab" | "cd") ("!" | "?")'})
    assert re.fullmatch(r"(ab|cd)[!?]", r.choices[0].text)
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(**kw, extra_body={"regex": "(unclosed"})
    assert "refused the request" in str(e.value)


def test_logit_bias(client):
    """A bias of 100 on one token makes it every output token (the engines apply it)."""
    r = client.completions.create(model=SERVED_NAME, prompt="The router", max_tokens=5,
                                  temperature=0, logit_bias={"65": 100},
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == [65] * 5


def test_min_tokens(client):
    """A bias of 100 on EOS (id 2) ends an output at once; with min_tokens the engines hold
    EOS back until then (SGLang's min_new_tokens)."""
    kw = dict(model=SERVED_NAME, prompt="The router", max_tokens=12, temperature=0,
              logit_bias={"2": 100})
    assert client.completions.create(**kw).usage.completion_tokens <= 1
    r = client.completions.create(**kw, extra_body={"min_tokens": 6, "return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].finish_reason == "stop" and 6 <= len(ids) <= 7 and 2 not in ids[:6]


def test_anthropic_messages(serve):
    import anthropic

    a = anthropic.Anthropic(base_url=serve, api_key="none", max_retries=0, timeout=60)
    kw = dict(model=SERVED_NAME, max_tokens=8, system="Be brief.", extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Plan the change, then edit."}])
    m = a.messages.create(**kw)
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    with a.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["text"]
    assert streamed.content[0].text == m.content[0].text
    # The second request's prompt is the first's: its KV is reused.
    assert streamed.usage.cache_read_input_tokens > 0
    assert a.messages.count_tokens(model=SERVED_NAME, system="Be brief.",
                                   messages=kw["messages"]).input_tokens == \
        m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_responses(client):
    kw = dict(model=SERVED_NAME, max_output_tokens=8, temperature=0,
              instructions="Be brief.", input="Plan the change, then edit.")
    r = client.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens >= 1
    with client.responses.stream(**kw) as s:  # (the client checks the events' order)
        ends = [e.response for e in s if e.type in ("response.completed",
                                                      "response.incomplete")]
    assert len(ends) == 1 and ends[0].output_text == r.output_text
    assert ends[0].usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    # A continuation of the stored response: its conversation, whose prompt's KV is reused.
    on = client.responses.create(previous_response_id=r.id, **{**kw, "input": "Go on."})
    assert on.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    assert on.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens // 2


def test_requests_without_hints_chain_into_one_branch(client, serve):
    """An agent loop with no branch hints, through the model's own chat template and
    tokenizer: from its second turn it is one inferred branch."""
    before = _get(serve + "/v1/evinfra/status")[1]["counters"]
    messages = [{"role": "system", "content": "You are a careful coding agent. " * 12},
                {"role": "user", "content": "Find the failing test."}]
    for i in range(3):
        r = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                           max_tokens=6, temperature=0)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"Tool output {i}: 3 passed, 1 failed."}]
    status = _get(serve + "/v1/evinfra/status")[1]
    after = status["counters"]
    assert after["requests_chained"] - before["requests_chained"] == 2
    assert after["branches_inferred"] - before["branches_inferred"] == 1
    assert status["inferred_branches"] >= 1
    assert r.usage.prompt_tokens_details.cached_tokens > 0


def test_a_sub_agents_report_taken_in_by_its_parent_ends_it(client, serve):
    """Without hints, through the real engines and tokenizer: the sub-agent's last answer,
    streamed by the decode engine and sent back as text in the parent's next prompt, is
    recognised there, and the sub-agent's inferred branch ends."""
    def turn(messages: list[dict], max_tokens: int) -> list[dict]:
        r = client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                           max_tokens=max_tokens, temperature=0)
        return messages + [{"role": "assistant", "content": r.choices[0].message.content}]

    before = _get(serve + "/v1/evinfra/status")[1]["counters"]
    parent = turn(turn([{"role": "system", "content": "You plan the change. " * 12},
                        {"role": "user", "content": "Plan it."}], 6), 6)
    sub = [{"role": "system", "content": "You search the code and report. " * 12},
           {"role": "user", "content": "Find the loader."}]
    sub = turn(turn(sub, 6) + [{"role": "user", "content": "grep: config.py"}], 120)
    turn(parent + [{"role": "user", "content": f"Task result: {sub[-1]['content']}"}], 6)
    after = _get(serve + "/v1/evinfra/status")[1]["counters"]
    assert after["branches_joined"] - before["branches_joined"] == 1


def test_bad_request_is_a_clear_400(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
