"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API.

Coding harnesses built on it (Claude Code, with ``ANTHROPIC_BASE_URL`` set to this server)
send the agent traffic the paper serves. As SGLang's own Anthropic route does, a request is
read into the chat route's terms and served by the same path (``serving.py``): the system
prompt, text blocks, an assistant's ``tool_use`` blocks (its ``tool_calls``) and a user's
``tool_result`` blocks (``tool`` messages) go through the model's chat template with the
tools' ``input_schema`` as their parameters; ``thinking`` turns the template's
``enable_thinking`` on or off. The answer comes back as content blocks (``thinking`` from the
reasoning parser, ``text``, ``tool_use`` from the tool-call parser), whole or as Anthropic's
stream of events. ``usage`` splits the prompt as Anthropic does: ``cache_read_input_tokens``
reused from KV, ``input_tokens`` computed. A final ``assistant`` message is a prefilled
answer, as Anthropic reads it: the model goes on writing it (the template's end of that turn
is cut off) and the answer is what follows.

A forced ``tool_choice`` (``any``, ``tool``) holds the output to the calls' JSON schema
(``constraints.py``), on engines that can.

Not served, refused with a 400: images (the model reads text), other block types, Anthropic's
own tool types (``bash_...``, ``web_search_...``: their schemas are Anthropic's).
"""

from __future__ import annotations

import json
import uuid
from functools import partial
from typing import Annotated, Literal

import msgspec
from aiohttp import web

from evinfra.api.constraints import check_served, tools_schema
from evinfra.api.schemas import AgentHints, TopP, decode_body
from evinfra.api.serving import (NO_IMAGES, Sample, chat_reader, check_model, joined_text,
                                 max_tokens_for, output_ready, stop_strings, submit_one, whole)
from evinfra.api.sse import EventStream, sse_event
from evinfra.api.tokenizer import Tokenizer, continue_final
from evinfra.api.tool_calls import ToolCall
from evinfra.core.contracts import Sampling
from evinfra.errors import EvinfraError, RequestError
from evinfra.control import Service

__all__ = ["AnthropicRoutes", "CountTokensRequest", "MessagesRequest"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class Tool(msgspec.Struct, frozen=True):
    name: str
    input_schema: dict[str, object]
    description: str | None = None
    type: str | None = None
    """Absent or ``custom``; Anthropic's own tool types are refused."""


class ToolChoice(msgspec.Struct, frozen=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, frozen=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    """Accepted, not enforced: ``max_tokens`` caps the whole output."""


class TextBlock(msgspec.Struct, frozen=True, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(msgspec.Struct, frozen=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, object] = {}


class ImageBlock(msgspec.Struct, frozen=True, tag="image", tag_field="type"):
    """Refused: the model reads text. (Typed, so the refusal can say so.)"""

    source: object = None


class ToolResultBlock(msgspec.Struct, frozen=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, frozen=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""


Block = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock


class Message(msgspec.Struct, frozen=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CountTokensRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest, frozen=True, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    evinfra: AgentHints | None = None


def _prefill(messages: list[dict[str, object]], param: str) -> str | None:
    """The text of a final assistant message, which the answer goes on with, as Anthropic
    continues a prefilled response (None: the last message is the user's). One with no text
    asks for a new turn: it is dropped."""
    last = messages[-1]
    if last["role"] != "assistant":
        return None
    if last.get("tool_calls"):
        raise RequestError("a final assistant message with tool_use blocks cannot be "
                           "continued: its calls wait for their tool_result", param=param)
    text = str(last["content"])
    if not text.strip():
        messages.pop()
        return None
    if text != text.rstrip():
        raise RequestError("final assistant content cannot end with trailing whitespace",
                           param=param)
    return text


def _chat_messages(body: CountTokensRequest) -> list[dict[str, object]]:
    """The request as the chat template's messages: an assistant's tool uses are its
    ``tool_calls``, a user's tool results ``tool`` messages before the user's text."""
    if not body.messages:
        raise RequestError("messages must not be empty", param="messages")
    out: list[dict[str, object]] = []
    if body.system:
        out.append({"role": "system", "content": joined_text(body.system, "system", "\n")})
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, thinking, results = [], [], [], 0
        for j, b in enumerate(m.content):
            if type(b) is TextBlock:
                text.append(b.text)
            elif type(b) is ToolUseBlock and m.role == "assistant":
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": b.input}})
            elif type(b) is ToolResultBlock and m.role == "user":
                content = joined_text(b.content, f"messages[{i}].content[{j}].content", "\n")
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
                results += 1
            elif type(b) is ThinkingBlock and m.role == "assistant":
                thinking.append(b.thinking)
            elif type(b) is ImageBlock:
                raise RequestError(NO_IMAGES, param=f"messages[{i}].content[{j}]")
            else:
                raise RequestError(f"a {m.role} message cannot hold a "
                                   f"{b.__struct_config__.tag!r} block (tool_use and thinking "
                                   "are the assistant's, tool_result the user's)",
                                   param=f"messages[{i}].content[{j}]")
        if text or calls or not results:
            msg: dict[str, object] = {"role": m.role, "content": "\n".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "\n".join(thinking)
            out.append(msg)
    return out


def _tools(body: CountTokensRequest) -> list[dict] | None:
    """The tools as the chat template gets them (None: none, or ``tool_choice`` ``none``)."""
    choice = body.tool_choice
    if not body.tools or (choice is not None and choice.type == "none"):
        return None
    for i, t in enumerate(body.tools):
        if t.type not in (None, "custom"):
            raise RequestError(f"{t.type!r} is one of Anthropic's own tool types: describe the "
                               "tool with a name and an input_schema", param=f"tools[{i}].type")
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in body.tools]


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name,
            "input": json.loads(call.arguments)}


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class _Blocks:
    """The content blocks of a streamed answer: a thinking or text block stays open while
    its kind goes on; a tool use is a block of its own (its input in one delta)."""

    def __init__(self) -> None:
        self.index = 0
        self.open: str | None = None

    def add(self, reasoning: str, text: str, calls: list[ToolCall]) -> list[bytes]:
        out = []
        for kind, piece in (("thinking", reasoning), ("text", text)):
            if piece:
                if self.open != kind:
                    out += self.close()
                    start = {"type": "thinking", "thinking": "", "signature": ""} \
                        if kind == "thinking" else {"type": "text", "text": ""}
                    out.append(self._start(start))
                    self.open = kind
                delta = {"type": "thinking_delta", "thinking": piece} if kind == "thinking" \
                    else {"type": "text_delta", "text": piece}
                out.append(sse_event({"type": "content_block_delta", "index": self.index,
                                      "delta": delta}))
        for c in calls:
            out += self.close()
            out.append(self._start({"type": "tool_use", "id": c.id, "name": c.name,
                                    "input": {}}))
            out.append(sse_event({"type": "content_block_delta", "index": self.index,
                                  "delta": {"type": "input_json_delta",
                                            "partial_json": c.arguments}}))
            self.open = "tool_use"
            out += self.close()
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [sse_event({"type": "content_block_stop", "index": self.index - 1})]

    def _start(self, block: dict) -> bytes:
        return sse_event({"type": "content_block_start", "index": self.index,
                          "content_block": block})


class AnthropicRoutes:
    def __init__(self, service: Service, tokenizer: Tokenizer) -> None:
        self.service = service
        self.tok = tokenizer
        self.model = service.config.model

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)

    def _prompt(self, body: CountTokensRequest) -> tuple[str, list[dict] | None, str | None]:
        """The rendered prompt, the tools, and the text of a final assistant message that the
        answer goes on with (None: the answer is a new turn)."""
        check_model(self.model, body.model)
        tools = _tools(body)
        extra = None if body.thinking is None else \
            {"enable_thinking": body.thinking.type != "disabled"}
        messages = _chat_messages(body)
        prefill = _prefill(messages, f"messages[{len(body.messages) - 1}]")
        if prefill is None:
            return self.tok.apply_chat_template(messages, tools, extra), tools, None
        rendered = self.tok.apply_chat_template(messages, tools, extra,
                                                add_generation_prompt=False)
        return continue_final(rendered, messages), tools, prefill

    async def count_tokens(self, request: web.Request) -> web.Response:
        prompt, _, _ = self._prompt(decode_body(await request.read(), CountTokensRequest))
        return web.json_response({"input_tokens": int(self.tok.encode(prompt).size)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), MessagesRequest)
        prompt, tools, prefill = self._prompt(body)
        choice = body.tool_choice
        parallel = choice is None or not choice.disable_parallel_tool_use
        schema = None
        forced = bool(tools) and choice is not None and choice.type in ("any", "tool")
        if forced:
            if choice.type == "tool" and not choice.name:
                raise RequestError("a tool_choice of type tool needs the tool's name",
                                   param="tool_choice.name")
            check_served(self.service.constrains_output(), "a forced tool_choice",
                         "tool_choice")
            schema = tools_schema(tools, choice.name if choice.type == "tool" else None,
                                  parallel, "tool_choice")
        reader = chat_reader(self.model, prompt, tools if schema is None else None, parallel,
                             _tool_use_id, forced, prefill)
        tokens = self.tok.encode(prompt)
        sampling = Sampling(max_tokens_for(self.model, tokens, body.max_tokens),
                            body.temperature, body.top_p,
                            stop_token_ids=list(self.tok.eos_token_ids),
                            top_k=body.top_k or -1, json_schema=schema)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        sample, stream = submit_one(self.service, self.tok, request, body.evinfra, tokens,
                                    sampling, mid, reader, stop_strings(body.stop_sequences))
        try:
            if body.stream:
                return await self._stream(request, sample, stream, int(tokens.size))
            return await self._whole(sample, stream, int(tokens.size))
        finally:
            self.service.abort(mid)  # if the client went away (a finished request is gone)

    def _message(self, sample: Sample, content: list[dict], stop_reason: str | None,
                 usage: dict) -> dict:
        return {"id": sample.rid, "type": "message", "role": "assistant",
                "model": self.model.name, "content": content, "stop_reason": stop_reason,
                "stop_sequence": sample.stop, "usage": usage}

    @staticmethod
    def _stop_reason(sample: Sample, finish: str) -> str:
        if sample.stop is not None:
            return "stop_sequence"
        if sample.out is not None and sample.out.calls and finish == "stop":
            return "tool_use"
        return _STOP_REASONS.get(finish, "end_turn")

    @staticmethod
    def _usage(sample: Sample, prompt: int) -> dict:
        cached = sample.record.cached_tokens if sample.record is not None else 0
        return {"input_tokens": prompt - cached, "output_tokens": len(sample.ids),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    async def _whole(self, sample: Sample, stream, prompt: int) -> web.Response:
        reasoning, content, finish = await whole(sample, stream)
        calls = sample.out.calls if sample.out is not None else []
        blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning \
            else []
        if content or not calls:
            blocks.append({"type": "text", "text": content})
        blocks += [_tool_use(c) for c in calls]
        return web.json_response(self._message(sample, blocks, self._stop_reason(sample, finish),
                                               self._usage(sample, prompt)))

    async def _stream(self, request: web.Request, sample: Sample, stream, prompt: int
                      ) -> web.StreamResponse:
        # An error before the first output leaves as an ordinary error response.
        first = await stream.__anext__()
        resp = EventStream(partial(output_ready, [sample]))
        out, blocks = sample.out, _Blocks()

        # The prompt's prefill is over at the first output: its reuse is known, on the
        # request in flight (or its record, if it is already over).
        record, flight = sample.channel.record, self.service.ledger.get(sample.rid)
        cached = record.cached_tokens if record is not None else \
            flight.cached if flight is not None else 0

        async def events():
            yield sse_event({"type": "message_start", "message": self._message(
                sample, [], None, {"input_tokens": prompt - cached, "output_tokens": 0,
                                   "cache_read_input_tokens": cached,
                                   "cache_creation_input_tokens": 0})})
            item = first
            try:
                while item[0] == "text":
                    for data in blocks.add(*out.feed(item[1])) if out is not None \
                            else blocks.add("", item[1], []):
                        yield data
                    item = await stream.__anext__()
                if out is not None:
                    for data in blocks.add(*out.end()):
                        yield data
                for data in blocks.close():
                    yield data
                yield sse_event({"type": "message_delta",
                                 "delta": {"stop_reason": self._stop_reason(sample, item[1]),
                                           "stop_sequence": sample.stop},
                                 "usage": self._usage(sample, prompt)})
                yield sse_event({"type": "message_stop"})
            except EvinfraError as exc:
                # Headers are out: report the error in the stream, as Anthropic does.
                yield sse_event({"type": "error", "error": {"type": "api_error",
                                                            "message": exc.message}})

        await resp.prepare(request)
        try:
            async for data in events():
                await resp.send(data)
            await resp.end()
        except ConnectionResetError:
            pass  # the client went away: no traceback; messages() stops the request
        return resp
