"""``POST /v1/responses``: OpenAI's Responses API (Codex CLI's wire API).

As SGLang and vLLM serve it, a request is read into the chat route's terms and served by the
same path (``serving.py``): ``instructions`` and ``system``/``developer`` messages are the
system prompt, message items the conversation, ``function_call`` items the assistant's
``tool_calls`` and ``function_call_output`` items ``tool`` messages; ``reasoning`` items are
left out (harnesses leave thinking out of the next context). Function tools go through the
chat template. The answer is output items (``reasoning``, a ``message`` with its
``output_text``, ``function_call``), whole or as the API's stream of events, with ``usage``'s
``input_tokens_details.cached_tokens`` the prompt tokens whose KV was reused.

Log-probabilities (``include: ["message.output_text.logprobs"]`` or ``top_logprobs``) come
with the message's text: each text delta carries the entries of the tokens read since the
last one, and the tokens whose text went to reasoning or a function call have none.

A forced ``tool_choice`` and a JSON ``text.format`` hold the output to a JSON schema
(``constraints.py``), on engines that can.

Answers are stored in memory (``response_store.py``, unless ``store: false``; read back with
``GET /v1/responses/{id}``, ``DELETE`` to forget one): ``previous_response_id`` continues a
stored conversation, and a chain of responses is one agent branch with no hint from the client.
``reasoning.effort`` reaches the chat template as ``reasoning_effort``; the other settings
that do not change the answer are accepted and ignored.
Refused with a 400: images, tool types other than ``function``.
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Annotated, Awaitable, Callable, Literal

import msgspec
from aiohttp import web

from evinfra.api.constraints import check_served, output_schema
from evinfra.api.logprobs import top_logprobs
from evinfra.api.schemas import (AgentHints, Effort, Temperature, TopP, decode_body,
                                 template_kwargs)
from evinfra.api.response_store import ResponseStore, Stored
from evinfra.api.serving import (Sample, Stops, chat_reader, check_model, joined_text,
                                 max_tokens_for, output_ready, read_hints, reasoning_tokens,
                                 submit_one)
from evinfra.api.sse import EventStream, sse_event
from evinfra.api.tokenizer import Tokenizer, call_arguments
from evinfra.api.tool_calls import ToolCall
from evinfra.core.contracts import Sampling
from evinfra.errors import EvinfraError, RequestError
from evinfra.control import Service

__all__ = ["ResponsesRequest", "ResponsesRoutes"]

LOGPROBS = "message.output_text.logprobs"

class InputText(msgspec.Struct, frozen=True, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, frozen=True, tag="output_text", tag_field="type"):
    text: str


class InputImage(msgspec.Struct, frozen=True, tag="input_image", tag_field="type"):
    """Refused (typed, so the refusal can say so)."""


Part = InputText | OutputText | InputImage


class MessageItem(msgspec.Struct, frozen=True, tag="message", tag_field="type"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class FunctionCallItem(msgspec.Struct, frozen=True, tag="function_call", tag_field="type"):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(msgspec.Struct, frozen=True, tag="function_call_output",
                             tag_field="type"):
    call_id: str
    output: str | list[Part]


class ReasoningItem(msgspec.Struct, frozen=True, tag="reasoning", tag_field="type"):
    """Left out of the prompt."""


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(msgspec.Struct, frozen=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, frozen=True):
    type: str = "text"
    """``text``, ``json_object`` or ``json_schema`` (with ``schema``)."""
    name: str | None = None
    schema: dict[str, object] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, frozen=True):
    format: TextFormat = TextFormat()


class Reasoning(msgspec.Struct, frozen=True):
    effort: Effort | None = None
    """The chat template's ``reasoning_effort``; ``summary`` is not written (ignored)."""


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input: str | list[object]
    """Text, or items (checked one by one, so an error names the item)."""
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, object] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: TextConfig | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    evinfra: AgentHints | None = None

    def logprobs(self) -> int | None:
        """``Sampling.logprobs``: alternatives per token, if the text's logprobs are
        asked for."""
        k = top_logprobs(self.top_logprobs, "top_logprobs")
        if k or LOGPROBS in (self.include or ()):
            return k or 0
        return None


def _item(i: int, raw: object) -> Item:
    """An input item, checked (a message may leave out its ``type``)."""
    if isinstance(raw, dict) and "type" not in raw and "role" in raw:
        raw = {**raw, "type": "message"}
    try:
        return msgspec.convert(raw, Item)
    except msgspec.ValidationError as exc:
        msg, _, where = str(exc).partition(" - at `$")
        raise RequestError(f"invalid input item: {msg}", param=f"input[{i}]{where.rstrip('`')}")


def _input_messages(body: ResponsesRequest) -> list[dict[str, object]]:
    """The request's input as chat messages: consecutive function calls are one assistant
    turn's ``tool_calls``."""
    out: list[dict[str, object]] = []
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
        return out
    if not body.input:
        raise RequestError("input must not be empty", param="input")
    for i, raw in enumerate(body.input):
        it = _item(i, raw)
        if type(it) is MessageItem:
            out.append({"role": "system" if it.role == "developer" else it.role,
                        "content": joined_text(it.content, f"input[{i}].content", "")})
        elif type(it) is FunctionCallItem:
            _add_call(out, it.call_id, it.name,
                      call_arguments({"arguments": it.arguments}, f"input[{i}].arguments"))
        elif type(it) is FunctionCallOutputItem:
            out.append({"role": "tool", "tool_call_id": it.call_id,
                        "content": joined_text(it.output, f"input[{i}].output", "")})
    return out


def _output_messages(output: list[dict]) -> list[dict[str, object]]:
    """An answer's output items as the chat messages its continuation starts with (the
    reasoning left out, as harnesses leave it out of the next context)."""
    out: list[dict[str, object]] = []
    for it in output:
        if it["type"] == "message":
            out.append({"role": "assistant",
                        "content": "".join(p["text"] for p in it["content"])})
        elif it["type"] == "function_call":
            _add_call(out, it["call_id"], it["name"], it["arguments"])
    return out


def _add_call(out: list[dict[str, object]], call_id: str, name: str,
              arguments: str | dict) -> None:
    """A function call as a chat message's tool call: consecutive calls are one assistant
    turn's ``tool_calls``."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)  # type: ignore[union-attr]
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _tools(body: ResponsesRequest) -> list[dict] | None:
    choice = body.tool_choice
    for i, t in enumerate(body.tools or ()):
        if t.type != "function" or not t.name:
            raise RequestError(f"tool type {t.type!r} is not served: describe the tool as a "
                               "function with a name and parameters", param=f"tools[{i}]")
    if not body.tools or choice == "none":
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.parameters or {}}}
            for t in body.tools]


def _constraint(body: ResponsesRequest, tools: list[dict] | None) -> tuple[str | None, bool]:
    """:func:`~evinfra.api.constraints.output_schema` of a request; a forced choice is
    ``required`` or ``{"type": "function", "name": ...}``."""
    choice, fmt = body.tool_choice, body.text.format if body.text is not None else None
    name = None
    if tools and isinstance(choice, dict):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("tool_choice must be auto, none, required or "
                               '{"type": "function", "name": ...}', param="tool_choice")
    return output_schema(tools, choice not in (None, "auto", "none"), name,
                         body.parallel_tool_calls, fmt.type if fmt is not None else None,
                         fmt.schema if fmt is not None else None, "text.format",
                         "text.format.schema")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _call_id() -> str:
    return _new_id("call")


class _Items:
    """Output items as they come: a reasoning or message item stays open while its kind goes
    on; a function call is an item of its own. ``events`` are the stream's, numbered."""

    def __init__(self) -> None:
        self.done: list[dict] = []
        self.events: list[dict] = []
        self.seq = 0
        self.open: dict | None = None
        self.parts: list[str] = []  # the open item's text (joined once: a += per delta is
        # quadratic on a long answer)
        self.logprobs: list[dict] = []  # the open message's

    def emit(self, event: dict) -> None:
        event["sequence_number"] = self.seq
        self.seq += 1
        self.events.append(event)

    def add(self, reasoning: str, text: str, calls: list[ToolCall],
            logprobs: list[dict] | None = None) -> None:
        """Output pieces in order; ``logprobs`` are the entries of ``text``'s tokens."""
        for kind, piece in (("reasoning", reasoning), ("message", text)):
            if piece:
                if self.open is None or self.open["type"] != kind:
                    self.close()
                    self._start(kind)
                self.parts.append(piece)
                event = {"type": "response.reasoning_text.delta" if kind == "reasoning"
                         else "response.output_text.delta", "item_id": self.open["id"],
                         "output_index": len(self.done), "content_index": 0, "delta": piece}
                if kind == "message":
                    event["logprobs"] = logprobs or []
                    self.logprobs += logprobs or []
                self.emit(event)
        for c in calls:
            self.close()
            item = {"type": "function_call", "id": _new_id("fc"), "call_id": c.id,
                    "name": c.name, "arguments": "", "status": "in_progress"}
            at = {"item_id": item["id"], "output_index": len(self.done)}
            self.emit({"type": "response.output_item.added", "output_index": len(self.done),
                       "item": item})
            self.emit({"type": "response.function_call_arguments.delta", **at,
                       "delta": c.arguments})
            self.emit({"type": "response.function_call_arguments.done", **at,
                       "arguments": c.arguments})
            item = {**item, "arguments": c.arguments, "status": "completed"}
            self.emit({"type": "response.output_item.done", "output_index": len(self.done),
                       "item": item})
            self.done.append(item)

    def finish(self) -> list[dict]:
        """Close the open item; the output items (an empty answer is an empty message)."""
        self.close()
        if not self.done:
            self._start("message")
            self.close()
        return self.done

    def _start(self, kind: str) -> None:
        self.open = {"type": kind, "id": _new_id("rs" if kind == "reasoning" else "msg")}
        self.parts = []
        self.logprobs = []
        part = _part(kind, "", [])
        self.emit({"type": "response.output_item.added", "output_index": len(self.done),
                   "item": _item_of(self.open, None, "in_progress")})
        self.emit({"type": "response.content_part.added", "item_id": self.open["id"],
                   "output_index": len(self.done), "content_index": 0, "part": part})

    def close(self) -> None:
        if self.open is None:
            return
        kind, text, lp = self.open["type"], "".join(self.parts), self.logprobs
        at = {"item_id": self.open["id"], "output_index": len(self.done), "content_index": 0}
        if kind == "reasoning":
            self.emit({"type": "response.reasoning_text.done", **at, "text": text})
        else:
            self.emit({"type": "response.output_text.done", **at, "text": text, "logprobs": lp})
        self.emit({"type": "response.content_part.done", **at, "part": _part(kind, text, lp)})
        item = _item_of(self.open, text, "completed", lp)
        self.emit({"type": "response.output_item.done", "output_index": len(self.done),
                   "item": item})
        self.done.append(item)
        self.open = None


def _part(kind: str, text: str, logprobs: list[dict]) -> dict:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _item_of(head: dict, text: str | None, status: str, logprobs: list[dict] = ()) -> dict:
    """A reasoning or message item with its one part (none while it is being added)."""
    content = [] if text is None else [_part(head["type"], text, list(logprobs))]
    if head["type"] == "reasoning":
        return {"type": "reasoning", "id": head["id"], "summary": [], "content": content}
    return {"type": "message", "id": head["id"], "status": status, "role": "assistant",
            "content": content}


class ResponsesRoutes:
    def __init__(self, service: Service, tokenizer: Tokenizer) -> None:
        self.service = service
        self.tok = tokenizer
        self.model = service.config.model
        limits = service.config.limits
        self.store = ResponseStore(limits.stored_responses, limits.stored_response_bytes)

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)

    def _stored(self, rid: str, param: str | None = None) -> Stored:
        s = self.store.get(rid)
        if s is None:
            raise RequestError(f"no stored response {rid!r}: responses are kept in memory "
                               f"(the last {self.store.capacity}, in at most "
                               f"{self.store.max_bytes} bytes) and only with store: true",
                               status=400 if param else 404, param=param,
                               code="previous_response_not_found" if param else "not_found")
        return s

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self._stored(request.match_info["response_id"]).response)

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        self._stored(rid)
        self.store.delete(rid)
        return web.json_response({"id": rid, "object": "response", "deleted": True})

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), ResponsesRequest)
        check_model(self.model, body.model)
        previous = (self._stored(body.previous_response_id, "previous_response_id")
                    if body.previous_response_id is not None else None)
        tools = _tools(body)
        schema, forced = _constraint(body, tools)
        if schema is not None:
            check_served(self.service.constrains_output(),
                         "a forced tool_choice" if forced else "a JSON text.format",
                         "tool_choice" if forced else "text.format")
        conversation = (previous.conversation if previous is not None else []) + \
            _input_messages(body)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        effort = body.reasoning.effort if body.reasoning is not None else None
        prompt = self.tok.apply_chat_template(system + conversation, tools,
                                              template_kwargs(None, effort))
        reader = chat_reader(self.model, prompt, tools if schema is None else None,
                             body.parallel_tool_calls, _call_id, forced)
        tokens = self.tok.encode(prompt)
        sampling = Sampling(max_tokens_for(self.model, tokens, body.max_output_tokens),
                            body.temperature, body.top_p,
                            stop_token_ids=list(self.tok.eos_token_ids),
                            logprobs=body.logprobs(), json_schema=schema)
        rid = _new_id("resp")
        hints = body.evinfra
        explicit = read_hints(request, hints)
        chained = explicit.branch_id is None and explicit.parent_branch_id is None
        if chained:
            hints = self.store.hints(previous)  # the chain's branch (none to start)
        sample, stream = submit_one(self.service, self.tok, request, hints, tokens,
                                    sampling, rid, reader, Stops([]))
        if chained and hints.branch_id is not None:
            self.store.claim(hints.branch_id, rid)  # submitted: no await since hints()
        answer = _Answer(self, body, sample, int(tokens.size))
        try:
            if body.stream:
                return await answer.write_stream(request, stream)
            return await answer.write_whole(stream)
        finally:
            self.service.abort(rid)  # if the client went away (a finished request is gone)
            if body.store and answer.final is not None:
                self.store.put(answer.final, conversation + _output_messages(
                    answer.final["output"]), hints.branch_id if hints is not None else None)


class _Answer:
    """One response: its fixed fields, and how its output items are written."""

    def __init__(self, routes: ResponsesRoutes, body: ResponsesRequest, sample: Sample,
                 prompt: int) -> None:
        self.tok = routes.tok
        self.sample = sample
        self.prompt = prompt
        self.head = {
            "id": sample.rid, "object": "response", "created_at": int(time.time()),
            "model": routes.model.name, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": [msgspec.to_builtins(t) for t in body.tools or ()], "error": None,
            "previous_response_id": body.previous_response_id, "store": body.store}
        self.final: dict | None = None
        """The whole response, once it is (completed or incomplete)."""

    def response(self, status: str, output: list[dict], finish: str | None = None) -> dict:
        out = {**self.head, "status": status, "output": output, "incomplete_details": None}
        if finish is not None:
            if finish == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            out["usage"] = self.usage()
        return out

    def usage(self) -> dict:
        s = self.sample
        cached = s.record.cached_tokens if s.record is not None else 0
        reasoning = reasoning_tokens(self.tok, [s])
        return {"input_tokens": self.prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": len(s.ids),
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": self.prompt + len(s.ids)}

    async def _read(self, items: _Items, stream, item: tuple | None = None,
                    flush: Callable[[], Awaitable[None]] | None = None) -> str:
        """Read the output into ``items`` (from ``item``, the first, if read already;
        ``flush`` after each piece); return the finish. Log-probability entries wait for
        the text their tokens make: the parsers may hold a tag's text for a while."""
        out, lp = self.sample.out, self.sample.logprobs
        pending: list[dict] = []
        if item is None:
            item = await stream.__anext__()
        while True:
            kind, text, ids = item
            if lp is not None:
                pending += lp.entries(ids)
            done = kind == "done"
            reasoning, content, calls = ((out.end() if done else out.feed(text))
                                         if out is not None else ("", "" if done else text, []))
            if reasoning or content or calls:
                items.add(reasoning, content, calls, pending if content else None)
                pending = []  # a reasoning's or a call's tokens have no entries
            if done:
                return text
            if flush is not None:
                await flush()
            item = await stream.__anext__()

    async def write_whole(self, stream) -> web.Response:
        items = _Items()
        finish = await self._read(items, stream)
        self.final = self.response("completed", items.finish(), finish)
        return web.json_response(self.final)

    async def write_stream(self, request: web.Request, stream) -> web.StreamResponse:
        # An error before the first output leaves as an ordinary error response.
        first = await stream.__anext__()
        resp = EventStream(partial(output_ready, [self.sample]))
        items = _Items()
        items.emit({"type": "response.created", "response": self.response("in_progress", [])})
        items.emit({"type": "response.in_progress", "response": self.response("in_progress", [])})
        await resp.prepare(request)
        try:
            try:
                finish = await self._read(items, stream, first,
                                          lambda: self._flush(resp, items))
                final = self.response("completed", items.finish(), finish)
                items.emit({"type": f"response.{final['status']}", "response": final})
                self.final = final
            except EvinfraError as exc:
                # Headers are out: report the error in the stream, as OpenAI does.
                items.emit({"type": "error", "code": None, "message": exc.message,
                            "param": None})
            await self._flush(resp, items)
            await resp.end()
        except ConnectionResetError:
            pass  # the client went away: no traceback; responses() stops the request
        return resp

    @staticmethod
    async def _flush(resp: EventStream, items: _Items) -> None:
        if items.events:
            await resp.send(b"".join(map(sse_event, items.events)))
            items.events.clear()
