"""``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming (SSE) and not.

The handler validates the body, applies the chat template and tokenizes, reads the agent
hints, submits to the service and relays the output. Output text comes from an incremental
detokenizer (only the last few tokens are decoded again per step); ``stop`` strings are
matched on the text and end the request early (none of a matched one is sent). A chat output
may be read further: a thinking model's reasoning apart (``reasoning.py``) and, with
``tools``, the model's tool calls (``tool_calls.py``). ``usage`` reports
``prompt_tokens_details.cached_tokens``: the input tokens whose KV the request reused.
``n`` choices are ``n`` requests at the service: choice 0 and forks of its branch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Callable, Sequence

import msgspec
import numpy as np
from aiohttp import web

from evinfra.api.markers import partial_marker
from evinfra.api.reasoning import PARSERS as REASONING_PARSERS
from evinfra.api.reasoning import ThinkSplit
from evinfra.api.schemas import (UNSERVED_MESSAGES, AgentHints, ChatCompletionRequest,
                                 CompletionRequest, decode_body)
from evinfra.api.tokenizer import Tokenizer
from evinfra.api.tool_calls import PARSERS as TOOL_PARSERS
from evinfra.api.tool_calls import TaggedCalls, ToolCall
from evinfra.core.events import RequestDone
from evinfra.drivers.base import Sampling
from evinfra.errors import EvinfraError, RequestError
from evinfra.service import Service, Submission

__all__ = ["OpenAIRoutes"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


class _Channel:
    """A request's output as an asyncio queue (the service's RequestSink)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def tokens(self, tokens) -> None:
        self.queue.put_nowait([int(t) for t in tokens])

    def done(self, record: RequestDone, error: EvinfraError | None) -> None:
        self.queue.put_nowait((record, error))


class _Detokenizer:
    """Incremental detokenization (the offsets scheme of vLLM and SGLang): decode only the
    tokens since the last emitted character, and hold back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read])
        new_text = self.tok.decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""


def _hints(request: web.Request, body: AgentHints | None) -> AgentHints:
    h = request.headers
    branch = h.get("X-Evinfra-Branch-Id") or h.get("X-Dynamo-Session-ID")
    parent = h.get("X-Evinfra-Parent-Branch-Id") or h.get("X-Dynamo-Parent-Session-ID")
    name = "X-Evinfra-Branch-Final" if "X-Evinfra-Branch-Final" in h else "X-Dynamo-Session-Final"
    final = h.get(name, "").strip().lower()
    if final not in _TRUE and final not in _FALSE:
        # A typo must not read as "false": the branch's counts would outlive it.
        raise RequestError(f"{name} must be true or false, not {h[name]!r}", param=name)
    if body is not None:
        return AgentHints(body.branch_id or branch, body.parent_branch_id or parent,
                          body.final or final in _TRUE)
    return AgentHints(branch, parent, final in _TRUE)


def _token_ids(ids: list) -> np.ndarray:
    if not all(type(i) is int for i in ids):
        raise RequestError("prompt must be a string, a list of token ids, or a list of one "
                           "of either", param="prompt")
    arr = np.asarray(ids, dtype=np.int64)
    if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
        raise RequestError("token ids must be in [0, 2^32)", param="prompt")
    return arr.astype(np.uint32)


def _prompt_tokens(body: CompletionRequest, tok: Tokenizer) -> np.ndarray:
    p = body.prompt
    if isinstance(p, str):
        return tok.encode(p)
    if not p:
        raise RequestError("prompt must not be empty", param="prompt")
    if type(p[0]) is int:
        return _token_ids(p)
    if len(p) != 1:
        raise RequestError("batched prompts are not supported: send one prompt per request",
                           param="prompt")
    (one,) = p
    return tok.encode(one) if isinstance(one, str) else _token_ids(one)


def _chat_prompt(body: ChatCompletionRequest, tools: list[dict] | None, tok: Tokenizer) -> str:
    if not body.messages:
        raise RequestError("messages must not be empty", param="messages")
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # (a list is not hashable)
            raise RequestError(f"messages[{i}].role must be one of {sorted(_ROLES)}",
                               param=f"messages[{i}].role")
    return tok.apply_chat_template(body.messages, tools, body.chat_template_kwargs)


def _refuse_unserved(body: ChatCompletionRequest | CompletionRequest) -> None:
    unserved = body.unserved()
    if unserved:
        field = unserved[0]
        raise RequestError(UNSERVED_MESSAGES.get(field, f"{field} is not supported by this server"),
                           param=field)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _ChatOutput:
    """A chat output read as the model's reasoning, its answer and the tool calls in the
    answer (each part only when the config names its parser)."""

    def __init__(self, think: ThinkSplit | None, calls: TaggedCalls | None) -> None:
        self.think = think
        self.parser = calls

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    def feed(self, delta: str) -> tuple[str, str, list[ToolCall]]:
        """The reasoning, the content and the calls this delta lets out."""
        reasoning, content = self.think.feed(delta) if self.think is not None else ("", delta)
        if self.parser is not None and content:
            return (reasoning, *self.parser.feed(content))
        return reasoning, content, []

    def end(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.think.end() if self.think is not None else ("", "")
        if self.parser is None:
            return reasoning, content, []
        content, calls = self.parser.feed(content) if content else ("", [])
        return reasoning, content + self.parser.end(), calls

    def finish(self, reason: str) -> str:
        """The request's finish as OpenAI names it: a stop after calls is ``tool_calls``."""
        return "tool_calls" if self.calls and reason == "stop" else reason


class _Sample:
    """One of a request's ``n`` choices: its request at the service, the channel its output
    comes on and how it is read; once it is done, its record and output token ids."""

    __slots__ = ("index", "rid", "channel", "out", "record", "ids")

    def __init__(self, index: int, rid: str, out: _ChatOutput | None) -> None:
        self.index = index
        self.rid = rid
        self.channel = _Channel()
        self.out = out
        self.record: RequestDone | None = None
        self.ids: list[int] = []


class OpenAIRoutes:
    def __init__(self, service: Service, tokenizer: Tokenizer) -> None:
        self.service = service
        self.tok = tokenizer
        self.model = service.config.model

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_info)

    def _model(self) -> dict[str, object]:
        """OpenAI's fields, and the context window as vLLM and SGLang give it (harnesses read
        it to know when to compact)."""
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "evinfra",
                "max_model_len": self.model.max_context_tokens}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (the OpenAI client's ``models.retrieve``)."""
        self._check_model(request.match_info["model"])
        return web.json_response(self._model())

    def _check_model(self, name: str) -> None:
        if name != self.model.name:
            raise RequestError(f"the model {name!r} does not exist; this server serves "
                               f"{self.model.name!r}", status=404, param="model",
                               code="model_not_found")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), ChatCompletionRequest)
        _refuse_unserved(body)
        tools, read_calls = body.template_tools(), None
        if tools is not None:
            if self.model.tool_calls is None:
                raise RequestError("tools need the model's tool-call format: set "
                                   "model.tool_call_parser in the config (one of: "
                                   f"{', '.join(TOOL_PARSERS)})", param="tools")
            read_calls = TOOL_PARSERS[self.model.tool_calls]
        prompt = _chat_prompt(body, tools, self.tok)
        think = REASONING_PARSERS[self.model.reasoning_parser] \
            if self.model.reasoning_parser else None
        reader = None
        if think is not None or read_calls is not None:
            # The template may open the reasoning block itself (DeepSeek-R1's does).
            forced = prompt.rstrip().endswith(ThinkSplit.START)

            def reader() -> _ChatOutput:
                return _ChatOutput(think(forced) if think else None,
                                   TaggedCalls(read_calls, _call_id, tools,
                                               body.parallel_tool_calls)
                                   if read_calls else None)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._serve(request, body, self.tok.encode(prompt), max_tokens, chat=True,
                                 reader=reader)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), CompletionRequest)
        _refuse_unserved(body)
        tokens = _prompt_tokens(body, self.tok)
        return await self._serve(request, body, tokens, body.max_tokens, chat=False)

    def _check(self, body: ChatCompletionRequest | CompletionRequest, tokens: np.ndarray,
               max_tokens: int | None) -> Sampling:
        self._check_model(body.model)
        if body.top_k == 0 or body.top_k < -1:
            raise RequestError("top_k must be -1 (no limit) or at least 1", param="top_k")
        room = self.model.max_context_tokens - int(tokens.size)
        if max_tokens is None:
            max_tokens = min(room, 4096)
        if max_tokens <= 0:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        if tokens.size == 0:
            raise RequestError("the prompt is empty", param="prompt")
        if int(tokens.size) + max_tokens > self.model.max_context_tokens:
            raise RequestError(
                f"this model's maximum context length is {self.model.max_context_tokens} "
                f"tokens; the prompt has {tokens.size} and max_tokens asks for {max_tokens}",
                param="max_tokens", code="context_length_exceeded")
        stop_ids = list(self.tok.eos_token_ids)
        return Sampling(max_tokens, body.temperature, body.top_p, body.ignore_eos, stop_ids,
                        body.seed, body.top_k, body.min_p, body.frequency_penalty,
                        body.presence_penalty, body.repetition_penalty)

    async def _serve(self, request: web.Request, body, tokens: np.ndarray,
                     max_tokens: int | None, *, chat: bool,
                     reader: Callable[[], _ChatOutput] | None = None) -> web.StreamResponse:
        """``reader`` makes how a chat output is read (None: all content), one per choice.

        Choice 0 is the request on its branch. With ``n`` > 1 the others are forks of that
        branch, each a branch of one (the harness continues its branch with the choice it
        keeps), sent when choice 0's first token arrives: its prefill is done then, so the
        router finds the prompt's KV in the directory and the forks reuse it, where sending
        all at once would prefill the prompt ``n`` times."""
        sampling = self._check(body, tokens, max_tokens)
        hints = _hints(request, body.evinfra)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        samples = [_Sample(i, rid if i == 0 else f"{rid}-{i}", reader() if reader else None)
                   for i in range(body.n)]
        self.service.submit(Submission(tokens, sampling, hints.branch_id,
                                       hints.parent_branch_id, hints.final, rid),
                            samples[0].channel)

        def fork() -> None:
            for s in samples[1:]:
                seed = None if sampling.seed is None else sampling.seed + s.index
                self.service.submit(Submission(
                    tokens, msgspec.structs.replace(sampling, seed=seed), None,
                    hints.branch_id, True, s.rid), s.channel)

        # An empty stop string would match before any output: it asks for nothing.
        stops = [s for s in ([body.stop] if isinstance(body.stop, str) else body.stop or []) if s]
        outputs = [self._outputs(s, stops, fork if s.index == 0 and body.n > 1 else None)
                   for s in samples]
        try:
            prompt = int(tokens.size)
            if body.stream:
                return await self._stream(request, rid, body, samples, outputs, chat, prompt)
            return await self._whole(rid, body, samples, outputs, chat, prompt)
        except BaseException:
            # The client went away, or a choice failed: none of the others is wanted now.
            for s in samples:
                self.service.abort(s.rid)
            raise

    async def _outputs(self, sample: _Sample, stops: list[str],
                       started: Callable[[], None] | None):
        """Yields ``("text", delta, ids)`` then ``("done", finish, ids)``, ``ids`` the output
        token ids not yielded before; raises the request's error. At the end ``sample`` has
        the request's record and all its output ids. ``started`` is called when the first
        output arrives.

        Text that may begin a stop string is held back until the next delta says whether it
        does (a stop string often spans tokens): none of a matched stop string is sent."""
        rid, queue = sample.rid, sample.channel.queue
        detok = _Detokenizer(self.tok)
        sample.ids = detok.ids
        held = ""
        sent = 0

        def new_ids() -> list[int]:
            nonlocal sent
            ids, sent = detok.ids[sent:], len(detok.ids)
            return ids

        while True:
            item = await queue.get()
            if started is not None and (isinstance(item, list) or item[1] is None):
                started()
                started = None
            if isinstance(item, list):
                delta = detok.add(item)
                if stops and delta:
                    window = held + delta
                    hits = [i for i in (window.find(s) for s in stops) if i >= 0]
                    if hits:
                        cut = min(hits)
                        if cut > 0:
                            yield "text", window[:cut], new_ids()
                        self.service.abort(rid)  # its record arrives synchronously
                        while not queue.empty():
                            it = queue.get_nowait()
                            if isinstance(it, tuple):
                                sample.record = it[0]
                        yield "done", "stop", new_ids()
                        return
                    k = max(partial_marker(window, s) for s in stops)
                    delta, held = window[:len(window) - k], window[len(window) - k:]
                if delta:
                    yield "text", delta, new_ids()
                continue
            record, error = item
            if error is not None:
                raise error
            if held:
                yield "text", held, new_ids()
            sample.record = record
            yield "done", record.finish or "stop", new_ids()
            return

    def _usage(self, samples: list[_Sample], prompt: int) -> dict:
        """The prompt counts once (its KV is shared); the completions of every choice."""
        record = samples[0].record
        cached = record.cached_tokens if record is not None else 0
        completion = sum(len(s.ids) for s in samples)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _whole(self, rid: str, body, samples: list[_Sample], outputs: list, chat: bool,
                     prompt: int) -> web.Response:
        if len(samples) == 1:
            choices = [await self._whole_choice(body, samples[0], outputs[0], chat)]
        else:
            # Each choice is read as its output comes, so a stop string ends it at once.
            tasks = [asyncio.ensure_future(self._whole_choice(body, s, o, chat))
                     for s, o in zip(samples, outputs)]
            try:
                choices = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model.name, "choices": choices,
            "usage": self._usage(samples, prompt)})

    async def _whole_choice(self, body, sample: _Sample, outputs, chat: bool) -> dict:
        text: list[str] = []
        finish = "stop"
        async for item in outputs:
            if item[0] == "text":
                text.append(item[1])
            else:
                finish = item[1]
        content: str | None = "".join(text)
        message: dict = {"role": "assistant"}
        out = sample.out
        if out is not None:
            r1, c1, _ = out.feed(content)
            r2, c2, _ = out.end()
            content = c1 + c2
            if out.think is not None:
                message["reasoning_content"] = (r1 + r2) or None
            if out.calls:
                message["tool_calls"] = [c.wire() for c in out.calls]
                content = content or None
            finish = out.finish(finish)
        message["content"] = content
        i = sample.index
        choice = ({"index": i, "message": message, "finish_reason": finish,
                   "logprobs": None} if chat else
                  {"index": i, "text": content, "finish_reason": finish, "logprobs": None})
        if body.return_token_ids:
            choice["token_ids"] = sample.ids
        return choice

    async def _stream(self, request: web.Request, rid: str, body, samples: list[_Sample],
                      outputs: list, chat: bool, prompt: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        enc = msgspec.json.encode

        def sse(obj: dict) -> bytes:
            return b"data: " + enc(obj) + b"\n\n"

        def chunk(index: int, delta: str | None, finish: str | None, role: bool = False,
                  ids: list[int] | None = None, calls: list[dict] | None = None,
                  reasoning: str = "") -> bytes:
            if chat:
                d: dict = {}
                if role:
                    d["role"] = "assistant"
                if reasoning:
                    d["reasoning_content"] = reasoning
                if delta is not None:
                    d["content"] = delta
                if calls:
                    d["tool_calls"] = calls
                choice = {"index": index, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": index, "text": delta or "", "finish_reason": finish,
                          "logprobs": None}
            if body.return_token_ids and ids is not None:
                choice["token_ids"] = ids
            return sse({"id": rid, "object": obj, "created": created, "model": self.model.name,
                        "choices": [choice]})

        async def choice_events(sample: _Sample, outputs, item):
            """One choice's chunks, from its first output ``item`` to its finish."""
            i, out = sample.index, sample.out
            n_calls = 0

            def read(reasoning: str, delta: str, calls: list[ToolCall],
                     ids: list[int] | None = None) -> bytes:
                """A chunk of what the reader lets out (maybe only the token ids: the parsers
                hold a tag's text until they know what it is, a call's until it is whole)."""
                nonlocal n_calls
                wire = [c.wire(n_calls + k) for k, c in enumerate(calls)]
                n_calls += len(calls)
                if not (reasoning or delta or wire or (body.return_token_ids and ids)):
                    return b""
                return chunk(i, delta if delta or not (wire or reasoning) else None, None,
                             ids=ids, calls=wire, reasoning=reasoning)

            if chat:
                yield chunk(i, "", None, role=True)
            if item is None:
                item = await outputs.__anext__()
            while item[0] == "text":
                if out is None:
                    yield chunk(i, item[1], None, ids=item[2])
                else:
                    yield read(*out.feed(item[1]), item[2])
                item = await outputs.__anext__()
            _, finish, rest = item
            if out is not None:
                yield read(*out.end())
                finish = out.finish(finish)
            yield chunk(i, None if chat else "", finish, ids=rest)

        try:
            first = await outputs[0].__anext__()
        except EvinfraError:
            raise  # nothing sent yet: an ordinary error response

        async def events():
            """The stream after the headers: the choices' chunks, the usage, [DONE]."""
            try:
                if len(samples) == 1:
                    async for data in choice_events(samples[0], outputs[0], first):
                        yield data
                else:
                    async for data in _merged([choice_events(s, o, first if s.index == 0
                                                             else None)
                                               for s, o in zip(samples, outputs)]):
                        yield data
                opts = body.stream_options
                if opts is not None and opts.include_usage:
                    yield sse({"id": rid, "object": obj, "created": created,
                               "model": self.model.name, "choices": [],
                               "usage": self._usage(samples, prompt)})
            except EvinfraError as exc:
                # Headers are out: report the error in the stream, as OpenAI does.
                yield sse({"error": {"message": exc.message, "type": type(exc).__name__,
                                     "code": None}})
            yield b"data: [DONE]\n\n"

        await resp.prepare(request)
        try:
            async for data in events():
                if data:
                    await resp.write(data)
            await resp.write_eof()
        except ConnectionResetError:
            # The client went away mid-stream, an everyday event: stop the requests and end
            # the handler without raising (aiohttp would log a traceback per disconnect).
            for s in samples:
                self.service.abort(s.rid)
        return resp


_END = object()


async def _merged(streams: list) -> AsyncIterator:
    """The items of several async iterators as they come; the first error ends it."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
