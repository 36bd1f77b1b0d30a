"""The replay client's backend: each runner request as one streaming OpenAI-compatible call.

Two layers, after httpx's transports. The sans-I/O core turns bytes into an
:class:`~evinfra.workloads.backend.Outcome` with the time passed in: :class:`SSEDecoder`
(server-sent events framing) and :class:`StreamReply` (the chunks of one completion: text,
token ids, usage, errors). :class:`HttpBackend` is the thin async shell: one task per request
on one shared ``aiohttp.ClientSession``, errors of every kind mapped to an outcome.

What is sent (``--api completions``, the default): ``prompt`` as the token-id list, so the
prefix structure the workload defines reaches the target exactly; ``max_tokens`` plus
``ignore_eos`` to force the output length; ``stream`` with ``stream_options.include_usage`` for
TTFT and ``usage.prompt_tokens_details.cached_tokens``; ``return_token_ids`` (vLLM >= 0.10.2,
recent SGLang, evinfra) so the next prompt carries the exact output ids; ``temperature`` 0.
Branch hints go as ``X-Evinfra-Branch-Id``, ``X-Evinfra-Parent-Branch-Id`` (a branch's first
request) and ``X-Evinfra-Branch-Final: true``, with ``X-Request-Id`` (``hints=False``: only
``X-Request-Id``, as from a harness that sends none); targets that do not know them ignore
headers. A target that rejects an optional field (a 400/422 naming
``ignore_eos``, ``return_token_ids`` or ``stream_options``) gets the request again without it,
and no later request carries it.

**Output ids.** With ``token_ids`` in the chunks, the outcome carries them. A target that
returns only text gets a deterministic stand-in: ``synth(("replay-output", request_id), n)``,
``n`` the reported ``completion_tokens`` (else the number of text chunks). The next prompt is
then the same on every replay, but it carries ids the target never produced, so the target
can reuse the KV of the prompt it was sent but never that of its own output: ``h`` loses the
visible-output share of ``h*`` (reported as lost KV reuse).

**Chat** (``--api chat``). The target's vocabulary is not known here, so token ids cannot be
decoded into the text the target would tokenize back. Each id is rendered as a fixed
pseudo-word (:func:`render_words`: base-100 syllables, ``" "``-joined) and the whole prompt is
one ``user`` message. Equal id prefixes give equal text prefixes, and the target's tokenizer
splits at the spaces, so prompt prefixes stay shared up to the message's end; but the
template closes the message, and outputs come back as text of the target's vocabulary that the
next prompt carries as pseudo-words of its ids: the KV of outputs is never reused in chat
mode, and prompt lengths differ from the workload's (several target tokens per id). The
target's ``cached_tokens`` is scaled by ``input_tokens / usage.prompt_tokens`` so ``h`` stays a
share of the prompt; the raw numbers are kept in ``requests.jsonl``.

Error mapping (never raised to the runner)::

    HTTP status >= 400            "HTTP 503: <the target's message>"
    an error chunk mid-stream     "stream error: <message>"
    undecodable chunk             "malformed stream: <what>"
    EOF before [DONE]/finish      "incomplete stream: ..."
    connection reset / refused    "connection: <aiohttp exception>"
    no answer in --timeout        "timeout after <s> s" (from the send, retries included)
    anything else raised here     "client: <exception>"
"""

from __future__ import annotations

import asyncio
from typing import Callable, Literal

import aiohttp
import msgspec
import numpy as np
import structlog

from evinfra.core.clock import Clock
from evinfra.workloads.backend import AgentRequest, Outcome
from evinfra.workloads.tokens import DEFAULT_SPACE, EMPTY, TokenSpace, synth

__all__ = [
    "Api", "HttpBackend", "OPTIONAL_FIELDS", "RequestInfo", "SSEDecoder", "StreamReply",
    "render_words",
]

Api = Literal["completions", "chat"]
OPTIONAL_FIELDS = ("ignore_eos", "return_token_ids", "stream_options")
_ERROR_CHARS = 300

log = structlog.get_logger("evinfra.replay")


# ---- sans-I/O: framing and chunks ----------------------------------------------------------

class SSEDecoder:
    """Server-sent events framing (WHATWG ``text/event-stream``): feed bytes, get the ``data``
    of each complete event. Comments and other fields are skipped; ``\\r\\n`` is accepted."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        buf = self._buf + chunk if self._buf else chunk
        out: list[str] = []
        pos = 0
        while (end := buf.find(b"\n", pos)) >= 0:
            line = buf[pos:end]
            pos = end + 1
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data).decode("utf-8", "replace"))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        self._buf = buf[pos:]
        return out

    def close(self) -> list[str]:
        """The last event, if the stream ended without its blank line."""
        out = self.feed(b"\n\n") if self._buf or self._data else []
        self._buf, self._data = b"", []
        return out


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None  # vLLM / SGLang reasoning parsers
    reasoning: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None  # completions
    delta: _Message | None = None  # chat chunks
    message: _Message | None = None  # chat, not streamed
    token_ids: list[int] | None = None
    finish_reason: str | None = None


class _ErrorBody(msgspec.Struct):
    message: str = ""


class _Chunk(msgspec.Struct):
    """One streamed chunk, a whole response, or an error body: OpenAI, vLLM and SGLang send
    ``{"error": {"message": ...}}``; older vLLM ``{"object": "error", "message": ...}``."""

    id: str | None = None
    object: str | None = None
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _ErrorBody | str | None = None
    message: str | None = None
    detail: str | None = None  # FastAPI's HTTPException body


_CHUNK = msgspec.json.Decoder(_Chunk)


def error_message(body: bytes | str) -> str:
    """The target's message from an error body (JSON of any usual shape, or plain text)."""
    raw = body.encode() if isinstance(body, str) else body
    try:
        chunk = _CHUNK.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _short(raw.decode("utf-8", "replace").strip() or "(empty body)")
    err = chunk.error
    text = err if isinstance(err, str) else err.message if err is not None else None
    return _short(text or chunk.message or chunk.detail or raw.decode("utf-8", "replace"))


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "..."


class StreamReply:
    """The chunks of one completion as they arrive; ``now`` is passed in, nothing is awaited.

    Feed each event's data (:meth:`feed`) or a whole non-streamed body (:meth:`whole`), then
    :meth:`outcome`. The first output is the first chunk carrying text, reasoning or token
    ids (a chat stream's opening role chunk carries none).
    """

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.first: float | None = None
        self.token_ids: list[int] | None = None
        self.text_chunks = 0
        self.usage: _Usage | None = None
        self.finish_reason: str | None = None
        self.response_id: str | None = None
        self.error: str | None = None
        self.done = False  # [DONE] seen

    @property
    def over(self) -> bool:
        """Nothing more to read: an error, or the stream's end marker."""
        return self.error is not None or self.done

    def feed(self, data: str, now: float) -> None:
        if self.over:
            return
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            chunk = _CHUNK.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.error = f"malformed stream: {_short(str(exc))}: {_short(data)[:80]!r}"
            return
        self._take(chunk, now)

    def whole(self, body: bytes, now: float) -> None:
        """A non-streamed response (a target that ignored ``stream``): no TTFT is known."""
        try:
            chunk = _CHUNK.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.error = f"malformed response: {_short(str(exc))}"
            return
        self._take(chunk, now)
        self.first = None
        self.done = self.error is None

    def _take(self, chunk: _Chunk, now: float) -> None:
        if chunk.error is not None or chunk.object == "error":
            err = chunk.error
            text = (err if isinstance(err, str) else err.message if err is not None
                    else chunk.message) or "(no message)"
            self.error = f"stream error: {_short(text)}"
            return
        if chunk.id and self.response_id is None:
            self.response_id = chunk.id
        if chunk.usage is not None:
            self.usage = chunk.usage
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            part = choice.delta or choice.message
            text = choice.text if part is None else (
                (part.content or "") + (part.reasoning_content or part.reasoning or ""))
            got = bool(text)
            if text:
                self.text_chunks += 1
            if choice.token_ids is not None:
                self.token_ids = (self.token_ids or []) + choice.token_ids
                got = got or bool(choice.token_ids)
            if got and self.first is None:
                self.first = now
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason

    def outcome(self, request: AgentRequest, api: Api, space: TokenSpace = DEFAULT_SPACE,
                ) -> tuple[Outcome, "RequestInfo"]:
        """The runner's outcome and what ``requests.jsonl`` adds (see the module docstring)."""
        usage = self.usage or _Usage()
        details = usage.prompt_tokens_details
        raw_cached = details.cached_tokens if details is not None else None
        info = RequestInfo(http_status=200, finish_reason=self.finish_reason,
                           response_id=self.response_id, target_prompt_tokens=usage.prompt_tokens,
                           target_cached_tokens=raw_cached)
        error = self.error
        if error is None and not self.done and self.finish_reason is None:
            error = "incomplete stream: the target closed it before [DONE]"
        ttft = None if self.first is None else self.first - self.sent
        if error is not None:
            info.error_kind = error.split(":", 1)[0]
            return Outcome(error=error, ttft=ttft), info
        if self.token_ids is not None:
            tokens = np.asarray(self.token_ids, dtype=np.uint32)
            info.output_ids = "target"
        else:
            n = usage.completion_tokens if usage.completion_tokens is not None else self.text_chunks
            tokens = synth(("replay-output", request.request_id), n, space) if n > 0 else EMPTY
            info.output_ids = "synth"
        cached = raw_cached
        if cached is not None and api == "chat" and usage.prompt_tokens:
            size = int(request.tokens.size)
            cached = min(size, round(cached * size / usage.prompt_tokens))
        return Outcome(tokens, ttft=ttft, cached_tokens=cached), info


class RequestInfo(msgspec.Struct):
    """What a request's line in ``requests.jsonl`` adds to its record: the HTTP status, the
    finish reason, where the output ids came from (``target`` or ``synth``), the target's own
    prompt and cached token counts, its response id, and the error's kind."""

    http_status: int | None = None
    finish_reason: str | None = None
    output_ids: str | None = None
    target_prompt_tokens: int | None = None
    target_cached_tokens: int | None = None
    response_id: str | None = None
    error_kind: str | None = None
    attempts: int = 1


# ---- chat rendering ------------------------------------------------------------------------

_SYLLABLES = [c + v for c in "bcdfghjklmnpqrstvwxz" for v in "aeiou"]  # 100
_words: list[str] = []  # grown on demand up to the largest id seen below _TABLE
_TABLE = 1 << 20


def _word(i: int) -> str:
    parts = []
    while True:
        i, d = divmod(i, 100)
        parts.append(_SYLLABLES[d])
        if not i:
            return "".join(parts)


def render_words(tokens: np.ndarray) -> str:
    """Token ids as text, one pseudo-word per id joined by spaces (chat mode; see the module
    docstring). Injective, and a prefix of ids renders to a prefix of the text."""
    if not tokens.size:
        return ""
    top = int(tokens.max())
    if top >= _TABLE:
        return " ".join([_word(t) for t in tokens.tolist()])
    if top >= len(_words):
        _words.extend(_word(i) for i in range(len(_words), top + 1))
    words = _words
    return " ".join([words[t] for t in tokens.tolist()])


# ---- the async shell -----------------------------------------------------------------------

class HttpBackend:
    """A :class:`~evinfra.workloads.backend.Backend` over HTTP (see the module docstring).

    ``session`` is shared by every request (its connector bounds the connections); ``clock``
    is the runner's. ``info`` holds each answered request's :class:`RequestInfo` until the
    caller pops it. A task cancelled by :meth:`cancel` never calls ``done``: its record stays
    pending (counted unfinished). An exception raised by ``done`` itself (a runner bug) is
    kept in ``failure`` and ends nothing else.
    """

    def __init__(self, session: aiohttp.ClientSession, clock: Clock, *, base_url: str,
                 model: str, api: Api = "completions", api_key: str | None = None,
                 timeout: float = 600.0, space: TokenSpace = DEFAULT_SPACE,
                 hints: bool = True) -> None:
        self.session = session
        self.clock = clock
        self.url = base_url.rstrip("/") + ("/v1/chat/completions" if api == "chat"
                                           else "/v1/completions")
        self.model = model
        self.api: Api = api
        self.timeout = timeout
        self.space = space
        self.hints = hints
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.optional = set(OPTIONAL_FIELDS)
        self.dropped: list[str] = []
        self.info: dict[str, RequestInfo] = {}
        self.failure: BaseException | None = None
        self.synthesized = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def send(self, request: AgentRequest, done: Callable[[Outcome], None]) -> None:
        task = asyncio.get_running_loop().create_task(self._run(request, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel(self) -> int:
        """Cut every request in flight (their ``done`` is never called); how many were cut."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    async def _run(self, request: AgentRequest, done: Callable[[Outcome], None]) -> None:
        try:
            outcome, info = await self.call(request)
        except Exception as exc:  # noqa: BLE001 - a client bug fails this request, not the run
            outcome = Outcome(error=f"client: {type(exc).__name__}: {_short(str(exc))}")
            info = RequestInfo(error_kind="client")
        if info.output_ids == "synth":
            self.synthesized += 1
        self.info[request.request_id] = info
        try:
            done(outcome)
        except Exception as exc:  # noqa: BLE001 - reported by the caller, not lost in a task
            if self.failure is None:
                self.failure = exc

    def body(self, request: AgentRequest) -> dict:
        body: dict = {"model": self.model, "max_tokens": request.max_tokens, "stream": True,
                      "temperature": 0.0}
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": render_words(request.tokens)}]
        else:
            body["prompt"] = request.tokens.tolist()
        if "ignore_eos" in self.optional:
            body["ignore_eos"] = True
        if "return_token_ids" in self.optional:
            body["return_token_ids"] = True
        if "stream_options" in self.optional:
            body["stream_options"] = {"include_usage": True}
        return body

    def request_headers(self, request: AgentRequest) -> dict[str, str]:
        headers = dict(self.headers)
        headers["X-Request-Id"] = request.request_id
        if not self.hints:
            return headers
        headers["X-Evinfra-Branch-Id"] = request.branch_id
        if request.parent_branch_id is not None:
            headers["X-Evinfra-Parent-Branch-Id"] = request.parent_branch_id
        if request.final:
            headers["X-Evinfra-Branch-Final"] = "true"
        return headers

    def _drop_rejected(self, status: int, message: str) -> bool:
        """Stop sending optional fields the target named in a 400/422; whether any was."""
        if status not in (400, 422):
            return False
        named = [f for f in OPTIONAL_FIELDS if f in self.optional and f in message]
        for f in named:
            self.optional.discard(f)
            self.dropped.append(f)
            log.warning("target_rejected_field", field=f, status=status, message=message)
        return bool(named)

    async def call(self, request: AgentRequest) -> tuple[Outcome, RequestInfo]:
        """One request, retried only without a rejected optional field; never raises but
        ``CancelledError``."""
        sent = self.clock.now()
        headers = self.request_headers(request)
        attempts = 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    attempts += 1
                    optional = set(self.optional)
                    payload = msgspec.json.encode(self.body(request))
                    async with self.session.post(self.url, data=payload,
                                                 headers=headers) as resp:
                        if resp.status >= 400:
                            message = error_message(await resp.read())
                            # Another request may have dropped the field meanwhile.
                            if (optional != self.optional
                                    or self._drop_rejected(resp.status, message)):
                                continue
                            return (Outcome(error=f"HTTP {resp.status}: {message}"),
                                    RequestInfo(http_status=resp.status, error_kind="HTTP",
                                                attempts=attempts))
                        reply = StreamReply(sent)
                        if "text/event-stream" in resp.headers.get("Content-Type", ""):
                            await self._read_stream(resp, reply)
                        else:
                            reply.whole(await resp.read(), self.clock.now())
                        outcome, info = reply.outcome(request, self.api, self.space)
                        info.http_status = resp.status
                        info.attempts = attempts
                        return outcome, info
        except TimeoutError:
            error, kind = f"timeout after {self.timeout:g} s", "timeout"
        except (aiohttp.ClientError, OSError) as exc:
            error, kind = f"connection: {type(exc).__name__}: {_short(str(exc))}", "connection"
        return Outcome(error=error), RequestInfo(error_kind=kind, attempts=attempts)

    async def _read_stream(self, resp: aiohttp.ClientResponse, reply: StreamReply) -> None:
        decoder = SSEDecoder()
        async for chunk in resp.content.iter_any():
            now = self.clock.now()
            for data in decoder.feed(chunk):
                reply.feed(data, now)
            if reply.error is not None:
                return  # leaving the block closes the connection
        for data in decoder.close():
            reply.feed(data, self.clock.now())
