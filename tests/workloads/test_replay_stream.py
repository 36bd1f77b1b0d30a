"""The replay client's sans-I/O core: SSE framing, completion and chat chunks, token ids,
usage, errors mid-stream, and the chat rendering of token ids."""

from __future__ import annotations

import json

import numpy as np
import pytest

from evinfra.workloads import AgentRequest, synth
from evinfra.workloads.http_backend import SSEDecoder, StreamReply, error_message, render_words


def request(rid: str = "cc-0:0#2", n: int = 10) -> AgentRequest:
    return AgentRequest(rid, "cc-0", "cc", "cc-0:0", None, False,
                        np.arange(1000, 1000 + n, dtype=np.uint32), 4)


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode())
                    + b"\n\n" for e in events)


def comp(text: str, ids: list[int] | None = None, finish: str | None = None) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


def chat(content: str | None, ids: list[int] | None = None, finish: str | None = None,
         role: bool = False) -> dict:
    delta = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


def usage(prompt: int, completion: int, cached: int | None) -> dict:
    u = {"prompt_tokens": prompt, "completion_tokens": completion,
         "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "cmpl-1", "choices": [], "usage": u}


def play(raw: bytes | list[bytes], sent: float = 10.0, step: float = 0.01,
         split: int | None = None) -> StreamReply:
    """Feed ``raw`` (a list: piece by piece; else in pieces of ``split`` bytes, one if None),
    the time advancing by ``step`` per piece."""
    reply, dec = StreamReply(sent), SSEDecoder()
    if isinstance(raw, list):
        pieces = raw
    else:
        pieces = [raw] if split is None else [raw[i:i + split] for i in range(0, len(raw), split)]
    now = sent
    for piece in pieces:
        now += step
        for data in dec.feed(piece):
            reply.feed(data, now)
    for data in dec.close():
        reply.feed(data, now)
    return reply


COMPLETION = sse(comp("a", [7]), comp("bc", [8, 9]), comp("", [10], "length"),
                 usage(10, 4, 8), b"[DONE]")


# ---- framing -------------------------------------------------------------------------------

def test_sse_framing_is_independent_of_how_the_bytes_arrive():
    whole = SSEDecoder().feed(COMPLETION)
    assert len(whole) == 5 and whole[-1] == "[DONE]"
    for size in (1, 2, 3, 7, 64):
        dec = SSEDecoder()
        got = [d for i in range(0, len(COMPLETION), size) for d in dec.feed(COMPLETION[i:i + size])]
        assert got == whole, size


def test_sse_crlf_comments_multiline_data_and_a_last_event_without_blank_line():
    dec = SSEDecoder()
    raw = b": keep-alive\r\n\r\nevent: x\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\ndata:[DONE]"
    assert dec.feed(raw) == ['{"a":\n1}']
    assert dec.close() == ["[DONE]"]
    assert dec.close() == []


# ---- completions ---------------------------------------------------------------------------

def test_completion_stream_gives_the_target_ids_usage_and_ttft():
    reply = play(COMPLETION, sent=10.0, step=0.25, split=len(sse(comp("a", [7]))) + 3)
    outcome, info = reply.outcome(request(), "completions")
    assert outcome.ok and outcome.tokens.tolist() == [7, 8, 9, 10]
    assert outcome.tokens.dtype == np.uint32
    assert outcome.ttft == pytest.approx(0.25)  # the first piece carried the first token
    assert outcome.cached_tokens == 8
    assert info.output_ids == "target" and info.finish_reason == "length"
    assert info.target_prompt_tokens == 10 and info.response_id == "cmpl-1"


def test_text_only_target_gets_deterministic_stand_in_ids_of_the_reported_length():
    raw = sse(comp("ab"), comp("c"), comp("", finish="length"), usage(10, 5, None), b"[DONE]")
    outcome, info = play(raw).outcome(request("r#1"), "completions")
    assert outcome.ok and info.output_ids == "synth"
    assert outcome.tokens.tolist() == synth(("replay-output", "r#1"), 5).tolist()
    assert outcome.cached_tokens is None  # not reported: h counts it as unknown
    again, _ = play(raw).outcome(request("r#1"), "completions")
    assert again.tokens.tolist() == outcome.tokens.tolist()
    # Without usage: one token per text chunk.
    bare = sse(comp("ab"), comp("c"), comp("", finish="length"), b"[DONE]")
    assert play(bare).outcome(request("r#1"), "completions")[0].tokens.size == 2


def test_a_finish_reason_without_done_is_a_complete_stream():
    raw = sse(comp("a", [5]), comp("", [6], "length"))
    outcome, _ = play(raw).outcome(request(), "completions")
    assert outcome.ok and outcome.tokens.tolist() == [5, 6]


# ---- chat ----------------------------------------------------------------------------------

def test_chat_stream_role_chunk_is_not_the_first_token_and_cached_is_scaled():
    raw = [sse(chat("", role=True)), sse(chat("Hel", [1, 2])),
           sse(chat("lo", [3]), chat(None, [], "length"), usage(40, 3, 20), b"[DONE]")]
    reply = play(raw, sent=0.0, step=0.1)
    outcome, info = reply.outcome(request(n=10), "chat")
    assert outcome.tokens.tolist() == [1, 2, 3]
    assert outcome.ttft == pytest.approx(0.2)  # the second piece: the role chunk carries none
    assert outcome.cached_tokens == 5  # 20 of the target's 40 = half of our 10, rounded
    assert info.target_cached_tokens == 20 and info.target_prompt_tokens == 40


def test_chat_reasoning_counts_as_output():
    raw = sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
              chat("ok", finish="stop"), b"[DONE]")
    reply = play(raw, sent=0.0, step=0.1, split=1)
    outcome, _ = reply.outcome(request(), "chat")
    assert outcome.ok and outcome.tokens.size == 2 and outcome.ttft is not None


def test_non_streamed_json_body_is_read_without_a_ttft():
    body = json.dumps({"id": "x", "choices": [{"index": 0, "message": {"content": "hi"},
                                               "token_ids": [4, 5], "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()
    reply = StreamReply(0.0)
    reply.whole(body, 1.0)
    outcome, _ = reply.outcome(request(), "chat")
    assert outcome.ok and outcome.tokens.tolist() == [4, 5] and outcome.ttft is None


# ---- errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("event,expected", [
    ({"error": {"message": "engine died", "type": "EngineError", "code": None}},
     "stream error: engine died"),
    ({"object": "error", "message": "old vLLM", "code": 500}, "stream error: old vLLM"),
    ({"error": "plain"}, "stream error: plain"),
])
def test_error_chunk_mid_stream_fails_the_request(event, expected):
    raw = sse(comp("a", [1]), event, comp("b", [2], "length"), b"[DONE]")
    outcome, info = play(raw).outcome(request(), "completions")
    assert outcome.error == expected and outcome.tokens.size == 0
    assert outcome.ttft is not None  # the first token did arrive
    assert info.error_kind == "stream error"


def test_malformed_chunk_fails_the_request():
    outcome, info = play(sse(comp("a", [1])) + b"data: {not json\n\n" + sse(b"[DONE]")).outcome(
        request(), "completions")
    assert outcome.error.startswith("malformed stream") and info.error_kind == "malformed stream"
    bad_type = sse({"choices": [{"index": 0, "token_ids": "x"}]})
    assert play(bad_type).outcome(request(), "completions")[0].error.startswith("malformed")


def test_stream_cut_before_its_end_fails_the_request():
    outcome, _ = play(sse(comp("a", [1]), comp("b", [2]))).outcome(request(), "completions")
    assert outcome.error.startswith("incomplete stream")
    assert play(b"").outcome(request(), "completions")[0].error.startswith("incomplete")


def test_error_bodies_of_the_usual_shapes():
    assert error_message(b'{"error": {"message": "bad model", "type": "x"}}') == "bad model"
    assert error_message(b'{"object": "error", "message": "too long", "code": 400}') == "too long"
    assert error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert error_message(b"<html>502 Bad Gateway</html>\n") == "<html>502 Bad Gateway</html>"
    assert error_message(b"") == "(empty body)"
    assert len(error_message(b"x" * 5000)) == 300


# ---- chat rendering ------------------------------------------------------------------------

def test_render_words_keeps_prefixes_and_tells_ids_apart():
    ids = synth(("render",), 500)
    text = render_words(ids)
    assert render_words(ids[:300]) == text[:len(render_words(ids[:300]))]
    assert text.startswith(render_words(ids[:300]) + " ")
    words = text.split(" ")
    assert len(words) == 500
    assert len({w for w in words}) == len(set(ids.tolist()))
    assert render_words(np.array([0, 99, 100, 2**31], dtype=np.uint32)).split() == [
        "ba", "zu", "babe", render_words(np.array([2**31], dtype=np.uint32))]
    assert render_words(np.zeros(0, dtype=np.uint32)) == ""
