"""A prefilled answer: the final message, an assistant's, is continued rather than answered
(vLLM's ``continue_final_message`` on the chat route and ``/tokenize``; Anthropic's final
``assistant`` message). The prompt stops right after that message's text, and the answer is
what the model writes after it, read from where the text left off (inside its reasoning block
or in its answer)."""

import anthropic
import pytest

from evinfra.api.tokenizer import ByteTokenizer, continue_final
from evinfra.errors import RequestError
from tests.api.conftest import body, model_says, openai_client, spy_submissions
from tests.api.test_hf_chat_template import TEMPLATE, hf

CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "The sum is"}]
THINKING = {"model": {"reasoning_parser": "think"}}


def test_the_rendered_conversation_stops_after_the_final_text(tmp_path):
    tok = hf(tmp_path, TEMPLATE)
    closed = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nThe sum is<|im_end|>")
    assert continue_final(closed, CHAT) == closed[:-len("<|im_end|>")]
    # Found stripped, as templates strip it; the last occurrence, not an earlier one.
    echo = [{"role": "user", "content": "The sum is"},
            {"role": "assistant", "content": "  The sum is \n"}]
    closed = tok.apply_chat_template(echo, add_generation_prompt=False)
    assert continue_final(closed, echo).endswith("<|im_start|>assistant\n  The sum is")
    with pytest.raises(RequestError, match="only an assistant's final message"):
        continue_final(closed, CHAT[:1])
    with pytest.raises(RequestError, match="no text to continue"):
        continue_final(closed, [CHAT[0], {"role": "assistant", "content": " "}])
    silent = hf(tmp_path, "{% for m in messages %}<|{{ m.role }}|>{% endfor %}")
    with pytest.raises(RequestError, match="does not render the final assistant message"):
        continue_final(silent.apply_chat_template(CHAT, add_generation_prompt=False), CHAT)


@pytest.mark.parametrize("config_overrides", [THINKING])
async def test_a_chat_goes_on_with_the_final_assistant_message(client, service, monkeypatch,
                                                               config_overrides):
    model_says(monkeypatch, " 4.")
    submitted = spy_submissions(service)
    oa = openai_client(client)
    r = await oa.chat.completions.create(model="evinfra-fake", messages=CHAT, max_tokens=9,
                                         extra_body={"continue_final_message": True,
                                                     "add_generation_prompt": False})
    prompt = ByteTokenizer().apply_chat_template(CHAT, add_generation_prompt=False)
    assert bytes(submitted[0].tokens.tolist()).decode() == prompt[:-1]  # its "\n" cut
    # The answer goes on from the text: no reasoning block opens, its leading space stays.
    m = r.choices[0].message
    assert m.content == " 4." and getattr(m, "reasoning_content", None) is None
    tokens = (await (await client.post("/tokenize", data=body(
        messages=CHAT, continue_final_message=True))).json())["tokens"]
    assert tokens == submitted[0].tokens.tolist()  # add_generation_prompt left out: not opened


@pytest.mark.parametrize("config_overrides", [THINKING])
async def test_a_final_message_in_its_reasoning_goes_on_reasoning(client, monkeypatch,
                                                                  config_overrides):
    model_says(monkeypatch, " so 4.</think>It is 4.")
    msgs = [CHAT[0], {"role": "assistant", "content": "<think>2 and 2"}]
    for stream in (False, True):
        r = await openai_client(client).chat.completions.create(
            model="evinfra-fake", messages=msgs, max_tokens=40, stream=stream,
            extra_body={"continue_final_message": True})
        if stream:
            parts = [c.choices[0].delta async for c in r]
            reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in parts)
            content = "".join(d.content or "" for d in parts)
        else:
            m = r.choices[0].message
            reasoning, content = m.reasoning_content, m.content
        assert (reasoning, content) == (" so 4.", "It is 4.")


async def test_what_cannot_be_continued_is_a_400(client):
    for extra, param in (({"continue_final_message": True, "add_generation_prompt": True},
                          "add_generation_prompt"),
                         ({"continue_final_message": True}, "messages")):
        messages = CHAT if "add_generation_prompt" in extra else CHAT[:1]
        for path in ("/v1/chat/completions", "/tokenize"):
            r = await client.post(path, data=body(model="evinfra-fake", messages=messages,
                                                  max_tokens=2, **extra))
            assert r.status == 400, await r.text()
            assert (await r.json())["error"]["param"] == param


def anthropic_client(client) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="none",
                                    max_retries=0)


async def test_anthropic_continues_a_prefilled_answer(client, service, monkeypatch):
    model_says(monkeypatch, " 4.")
    submitted = spy_submissions(service)
    a = anthropic_client(client)
    m = await a.messages.create(model="evinfra-fake", max_tokens=9, messages=CHAT)
    assert [(b.type, b.text) for b in m.content] == [("text", " 4.")]
    prompt = ByteTokenizer().apply_chat_template(CHAT, add_generation_prompt=False)
    assert bytes(submitted[0].tokens.tolist()).decode() == prompt[:-1]
    counted = await a.messages.count_tokens(model="evinfra-fake", messages=CHAT)
    assert counted.input_tokens == submitted[0].tokens.size
    # A final assistant message with no text asks for a new turn, as if it were not there.
    await a.messages.create(model="evinfra-fake", max_tokens=9,
                            messages=[CHAT[0], {"role": "assistant", "content": ""}])
    await a.messages.create(model="evinfra-fake", max_tokens=9, messages=CHAT[:1])
    assert submitted[1].tokens.tolist() == submitted[2].tokens.tolist()


async def test_anthropic_refuses_what_it_cannot_continue(client):
    a = anthropic_client(client)
    call = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.py"}}]}
    tools = [{"name": "read_file", "input_schema": {"type": "object"}}]
    for messages, says in (([CHAT[0], {"role": "assistant", "content": "The sum is "}],
                            "trailing whitespace"),
                           ([CHAT[0], call], "tool_result")):
        with pytest.raises(anthropic.BadRequestError, match=says):
            await a.messages.create(model="evinfra-fake", max_tokens=9, messages=messages,
                                    tools=tools)
