"""What the API's dialects (OpenAI's, Anthropic's and the Responses API's routes) share to serve
one request.

A request is read for its agent hints, checked against the model's context, submitted to the
service as one or more :class:`Sample` (one per choice), and each sample's output is read back
as text: an incremental detokenizer (only the last few tokens are decoded again per step) and
``stop`` strings matched on the text (none of a matched one is sent). A chat output may be read
further (:class:`ChatOutput`): a thinking model's reasoning apart (``reasoning.py``) and, with
tools, the model's calls (``tool_calls.py``).
"""

from __future__ import annotations

import asyncio
from typing import Callable, NamedTuple, Sequence

import msgspec
import numpy as np
from aiohttp import web

from evinfra.api.access import RECORDS
from evinfra.api.constraints import ForcedCalls
from evinfra.api.logprobs import LogprobReader
from evinfra.api.markers import partial_marker
from evinfra.api.reasoning import PARSERS as REASONING_PARSERS
from evinfra.api.reasoning import ThinkSplit
from evinfra.api.schemas import AgentHints
from evinfra.api.tokenizer import Tokenizer
from evinfra.api.tool_calls import PARSERS as TOOL_PARSERS
from evinfra.api.tool_calls import TaggedCalls, ToolCall
from evinfra.config import ModelConfig
from evinfra.control import Service, Submission
from evinfra.core.contracts import Sampling
from evinfra.core.events import RequestDone, TokenLogprobs
from evinfra.errors import EvinfraError, RequestError

__all__ = ["NO_IMAGES", "Channel", "ChatOutput", "Detokenizer", "Sample", "Stops",
           "chat_reader", "check_model", "joined_text", "max_tokens_for", "output_ready",
           "outputs", "read_hints", "reasoning_tokens", "stop_strings", "submit_one", "whole"]

NO_IMAGES = "images are not served: the model reads text"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class Tokens(msgspec.Struct, gc=False):
    """Output token ids, on a :class:`Channel`."""

    ids: list[int]


class Finished(msgspec.Struct, gc=False):
    """The request is over, on a :class:`Channel`: its record, and its error if it failed."""

    record: RequestDone
    error: EvinfraError | None


class Channel:
    """A request's output as an asyncio queue of :class:`Tokens` then one :class:`Finished`
    (the service's RequestSink); its log-probabilities go to ``logprobs`` (None: not asked
    for), its prompt's to ``prompt``. Its record is ``record`` as soon as the request is
    over, and goes to the access log of the HTTP request serving it (``access.RECORDS``)."""

    def __init__(self, logprobs: LogprobReader | None = None) -> None:
        self.queue: asyncio.Queue[Tokens | Finished] = asyncio.Queue()
        self.logprobs = logprobs
        self.prompt: TokenLogprobs | None = None
        self.record: RequestDone | None = None
        self._records = RECORDS.get()

    def prompt_logprobs(self, logprobs: TokenLogprobs) -> None:
        self.prompt = logprobs

    def tokens(self, tokens, logprobs: TokenLogprobs | None) -> None:
        # (a numpy array's own tolist: a Python int per id, some 10x faster than int(t))
        ids = tokens.tolist() if isinstance(tokens, np.ndarray) else [int(t) for t in tokens]
        self.queue.put_nowait(Tokens(ids))
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.add(logprobs)

    def done(self, record: RequestDone, error: EvinfraError | None) -> None:
        self.record = record
        if self._records is not None:
            self._records.append(record)
        self.queue.put_nowait(Finished(record, error))


class Detokenizer:
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


def read_hints(request: web.Request, body: AgentHints | None) -> AgentHints:
    """The agent hints of a request: the ``X-Evinfra-*`` headers (or Dynamo's), or the
    same in the body, which wins field by field."""
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


def check_model(model: ModelConfig, name: str) -> None:
    if name != model.name:
        raise RequestError(f"the model {name!r} does not exist; this server serves "
                           f"{model.name!r}", status=404, param="model", code="model_not_found")


def max_tokens_for(model: ModelConfig, tokens: np.ndarray, max_tokens: int | None) -> int:
    """``max_tokens`` checked against the model's context (None: what is left of it, at
    most 4,096)."""
    room = model.max_context_tokens - int(tokens.size)
    if max_tokens is None:
        max_tokens = min(room, 4096)
    if max_tokens <= 0:
        raise RequestError("max_tokens must be at least 1", param="max_tokens")
    if tokens.size == 0:
        raise RequestError("the prompt is empty", param="prompt")
    if int(tokens.size) + max_tokens > model.max_context_tokens:
        raise RequestError(
            f"this model's maximum context length is {model.max_context_tokens} "
            f"tokens; the prompt has {tokens.size} and max_tokens asks for {max_tokens}",
            param="max_tokens", code="context_length_exceeded")
    return max_tokens


def joined_text(content: str | Sequence[object], param: str, sep: str) -> str:
    """A message's content as one text: a string, or its text parts joined by ``sep``. A
    part without text (an image: the model reads text) is refused."""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if not isinstance(getattr(part, "text", None), str):
            raise RequestError(NO_IMAGES, param=f"{param}[{j}]")
    return sep.join(part.text for part in content)  # type: ignore[attr-defined]


class Stops(NamedTuple):
    """What ends an output here, besides the engine: its ``strings`` (none empty), from the
    ``min_tokens``-th token on (as in SGLang and vLLM, nothing stops an output before: the
    engine holds back stop tokens until then); with ``keep`` a matched string stays in the
    output (vLLM's ``include_stop_str_in_output``, SGLang's ``no_stop_trim``)."""

    strings: list[str]
    min_tokens: int = 0
    keep: bool = False


def stop_strings(stop: str | list[str] | None, min_tokens: int = 0, keep: bool = False
                 ) -> Stops:
    """An empty stop string would match before any output: it asks for nothing."""
    return Stops([s for s in ([stop] if isinstance(stop, str) else stop or []) if s],
                 min_tokens, keep)


class ChatOutput:
    """A chat output read as the model's reasoning, its answer and the tool calls in the
    answer (each part only when the config names its parser)."""

    def __init__(self, think: ThinkSplit | None, calls: TaggedCalls | ForcedCalls | None
                 ) -> None:
        self.think = think
        self.parser = calls
        self._reasoning: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls if self.parser is not None else []

    @property
    def reasoning(self) -> str:
        """The reasoning let out so far."""
        return "".join(self._reasoning)

    def feed(self, delta: str) -> tuple[str, str, list[ToolCall]]:
        """The reasoning, the content and the calls this delta lets out."""
        reasoning, content = self.think.feed(delta) if self.think is not None else ("", delta)
        if reasoning:
            self._reasoning.append(reasoning)
        if self.parser is not None and content:
            return (reasoning, *self.parser.feed(content))
        return reasoning, content, []

    def end(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.think.end() if self.think is not None else ("", "")
        if reasoning:
            self._reasoning.append(reasoning)
        if self.parser is None:
            return reasoning, content, []
        before = len(self.parser.calls)
        content = self.parser.feed(content)[0] if content else ""
        content += self.parser.end()  # (a forced call is read here, once whole)
        return reasoning, content, self.parser.calls[before:]

    def finish(self, reason: str) -> str:
        """The request's finish as OpenAI names it: a stop after calls is ``tool_calls``."""
        return "tool_calls" if self.calls and reason == "stop" else reason


def chat_reader(model: ModelConfig, prompt: str, tools: list[dict] | None, parallel: bool,
                new_id: Callable[[], str], forced: bool = False, continued: str | None = None
                ) -> Callable[[], ChatOutput] | None:
    """What reads each choice of a chat request whose rendered prompt is ``prompt`` (None:
    the output is all content). ``tools`` as the template got them, None for an output a
    grammar holds (no tagged calls there); ``new_id`` names a call. Tools need the config to
    name the model's call format: it is not guessed. A ``forced`` tool choice's output is the
    array of calls its grammar holds it to. ``continued``: the text of the final assistant
    message the output goes on with.

    With the config's reasoning parser a thinking model's reasoning block is read off first,
    a grammar's output too: an engine may let the model reason before its grammar holds it
    (SGLang launched with ``--reasoning-parser``), and an output that opens no block is all
    answer."""
    think = REASONING_PARSERS[model.reasoning_parser] if model.reasoning_parser else None
    # The template may open the reasoning block itself (DeepSeek-R1's does), or the message
    # the output goes on with may have left one open.
    opened = prompt.rstrip().endswith(ThinkSplit.START) if continued is None else \
        continued.rfind(ThinkSplit.START) > continued.rfind(ThinkSplit.END)
    if forced:
        return lambda: ChatOutput(think(opened) if think else None, ForcedCalls(new_id))
    read_calls = None
    if tools is not None:
        if model.tool_calls is None:
            raise RequestError("tools need the model's tool-call format: set "
                               "model.tool_call_parser in the config (one of: "
                               f"{', '.join(TOOL_PARSERS)})", param="tools")
        read_calls = TOOL_PARSERS[model.tool_calls]
    if think is None and read_calls is None:
        return None

    def reader() -> ChatOutput:
        return ChatOutput(think(opened) if think else None,
                          TaggedCalls(read_calls, new_id, tools, parallel) if read_calls
                          else None)
    return reader


class Sample:
    """One of a request's ``n`` choices: its request at the service, the channel its output
    comes on and how it is read (its text; its log-probabilities, if asked for); once it is
    done, its record, output token ids and the stop string that ended it."""

    __slots__ = ("index", "rid", "channel", "out", "record", "ids", "stop")

    def __init__(self, index: int, rid: str, out: ChatOutput | None,
                 logprobs: LogprobReader | None = None) -> None:
        self.index = index
        self.rid = rid
        self.channel = Channel(logprobs)
        self.out = out
        self.record: RequestDone | None = None
        self.ids: list[int] = []
        self.stop: str | None = None

    @property
    def logprobs(self) -> LogprobReader | None:
        return self.channel.logprobs


def output_ready(samples: Sequence[Sample]) -> bool:
    """Whether the samples' outputs can be read on without waiting: one has output queued,
    or all are over (what is left of them is all queued). An :class:`EventStream`'s
    ``ready``."""
    over = True
    for s in samples:  # (a loop: this runs for every event a stream writes)
        if s.channel.queue.qsize():
            return True
        over = over and s.channel.record is not None
    return over


def reasoning_tokens(tok: Tokenizer, samples: Sequence[Sample]) -> int:
    """The samples' reasoning in tokens, as the tokenizer reads its text (the usage's
    ``reasoning_tokens`` of the chat and Responses APIs)."""
    return sum(len(tok.encode(s.out.reasoning)) for s in samples if s.out is not None)


async def outputs(service: Service, tok: Tokenizer, sample: Sample, rule: Stops,
                  started: Callable[[], None] | None = None):
    """Yields ``("text", delta, ids)`` then ``("done", finish, ids)``, ``ids`` the output
    token ids not yielded before; raises the request's error. At the end ``sample`` has
    the request's record and all its output ids. ``started`` is called when the first
    output arrives.

    Text that may begin a stop string is held back until the next delta says whether it
    does (a stop string often spans tokens): none of a matched stop string is sent unless
    the rule keeps it. A stop string counts only if it ends in the text of the rule's
    ``min_tokens``-th token or later."""
    rid, queue = sample.rid, sample.channel.queue
    stops, min_tokens = rule.strings, rule.min_tokens
    detok = Detokenizer(tok)
    sample.ids = detok.ids
    held = ""
    sent = 0
    # Text so far, and how much of it the first min_tokens - 1 tokens wrote: a stop string
    # must end past that.
    total = floor = 0

    def new_ids() -> list[int]:
        nonlocal sent
        ids, sent = detok.ids[sent:], len(detok.ids)
        return ids

    while True:
        item = await queue.get()
        if started is not None and (isinstance(item, Tokens) or item.error is None):
            started()
            started = None
        match item:
            case Finished(record=record, error=error):
                if error is not None:
                    raise error
                if held:
                    yield "text", held, new_ids()
                sample.record = record
                yield "done", record.finish or "stop", new_ids()
                return
            case Tokens(ids=ids):
                below = min_tokens - 1 - len(detok.ids)  # tokens of this item below the floor
                if 0 < below < len(ids):
                    head = detok.add(ids[:below])
                    floor = total + len(head)
                    delta = head + detok.add(ids[below:])
                else:
                    delta = detok.add(ids)
                    if below >= len(ids):
                        floor = total + len(delta)
                total += len(delta)
                if stops and delta:
                    window = held + delta
                    at = floor - (total - len(window))  # the floor within the window
                    hits = [(i, s) for i, s in ((window.find(s, max(0, at - len(s) + 1)), s)
                                                for s in stops) if i >= 0]
                    if hits:
                        cut, sample.stop = min(hits)
                        if rule.keep:
                            cut += len(sample.stop)
                        if cut > 0:
                            yield "text", window[:cut], new_ids()
                        service.abort(rid)  # its record is on the queue when this returns
                        while not queue.empty():
                            it = queue.get_nowait()
                            if isinstance(it, Finished):
                                sample.record = it.record
                        yield "done", "stop", new_ids()
                        return
                    k = max(partial_marker(window, s) for s in stops)
                    delta, held = window[:len(window) - k], window[len(window) - k:]
                if delta:
                    yield "text", delta, new_ids()


def submit_one(service: Service, tok: Tokenizer, request: web.Request,
               hints: AgentHints | None, tokens: np.ndarray, sampling: Sampling, rid: str,
               reader: Callable[[], ChatOutput] | None, stops: Stops):
    """Submit a request of one choice with the agent hints of its headers and ``hints``
    (its body's); returns its :class:`Sample` and :func:`outputs`."""
    h = read_hints(request, hints)
    k = sampling.logprobs
    sample = Sample(0, rid, reader() if reader else None,
                    LogprobReader(tok, k) if k is not None else None)
    service.submit(Submission(tokens, sampling, h.branch_id, h.parent_branch_id, h.final, rid),
                   sample.channel)
    return sample, outputs(service, tok, sample, stops)


async def whole(sample: Sample, stream) -> tuple[str, str, str]:
    """An output read to its end (``stream`` is the sample's :func:`outputs`): its
    reasoning, its content and its finish; its calls are ``sample.out.calls``."""
    text, finish = [], "stop"
    async for item in stream:
        if item[0] == "text":
            text.append(item[1])
        else:
            finish = item[1]
    content, out = "".join(text), sample.out
    if out is None:
        return "", content, finish
    r1, c1, _ = out.feed(content)
    r2, c2, _ = out.end()
    return r1 + r2, c1 + c2, finish
