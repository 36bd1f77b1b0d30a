"""SGLang ``/generate`` for a PD pair: the bodies we send and the stream we read back (pure).

SGLang PD serves one request on two engines: the client sends the *same* request to the
prefill engine and to the decode engine, both carrying ``bootstrap_host`` and
``bootstrap_port`` (the prefill engine's bootstrap server) and one ``bootstrap_room`` (a random
63-bit id naming the pair). The decode engine's KV receiver meets the prefill engine's sender
in that room; the prefill engine holds the request in its bootstrap queue until the decode side
arrives, prefills, ships the KV and the first token, and answers with ``finish_reason``
``length`` (0 tokens of its own). The decode engine streams every output token, the first
included. We send token ids (``input_ids``): the front end tokenizes.

Streams are SSE: ``data: {json}`` lines, then ``data: [DONE]``. A chunk's ``output_ids`` are
all the tokens so far (``--incremental-streaming-output`` off, the default) or only the new
ones (on); :class:`OutputCursor` handles both from ``meta_info.completion_tokens``.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from evinfra.core.contracts import Sampling
from evinfra.core.events import TokenLogprobs

__all__ = ["Bootstrap", "Chunk", "OutputCursor", "StreamError", "Finish", "generate_body",
           "new_room", "parse_sse_line", "priority_for"]

ROOM_BITS = 63


def new_room() -> int:
    """A fresh ``bootstrap_room``: random, so rooms of different control planes (or of a
    request re-dispatched after a failure) never collide on an engine."""
    return secrets.randbits(ROOM_BITS)


class Bootstrap(msgspec.Struct, frozen=True):
    """Where the decode side of a pair meets the prefill side."""

    host: str
    port: int
    room: int


def sampling_params(s: Sampling) -> dict[str, Any]:
    p: dict[str, Any] = {"max_new_tokens": s.max_tokens, "temperature": s.temperature,
                         "top_p": s.top_p, "ignore_eos": s.ignore_eos}
    if s.stop_token_ids:
        p["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None:
        p["sampling_seed"] = s.seed
    for name in ("json_schema", "regex", "ebnf"):
        if (v := getattr(s, name)) is not None:
            p[name] = v
    if s.min_tokens:
        p["min_new_tokens"] = s.min_tokens
    if s.logit_bias:
        p["logit_bias"] = {str(t): b for t, b in s.logit_bias.items()}
    # The rest only when asked for: SGLang's defaults are the same "off" values.
    for name, off in _OFF:
        if (v := getattr(s, name)) != off:
            p[name] = v
    return p


_OFF = (("top_k", -1), ("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0))


def generate_body(tokens: Any, sampling: Sampling, rid: str, bootstrap: Bootstrap,
                  priority: int | None = None, kv_hints: dict[str, Any] | None = None,
                  prefill: bool = False) -> dict[str, Any]:
    """The ``/generate`` body, identical for both engines of the pair but for ``rid`` and
    the ``prefill`` half's extras: its ``kv_hints`` (its fetch plan for a patched engine, see
    ``engine_patch/wire.py``) and the start of the prompt's log-probabilities, when asked
    (only the prefill engine computes them)."""
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in tokens],
        "sampling_params": sampling_params(sampling),
        "stream": True,
        "rid": rid,
        "bootstrap_host": bootstrap.host,
        "bootstrap_port": bootstrap.port,
        "bootstrap_room": bootstrap.room,
    }
    if priority is not None:
        body["priority"] = priority
    if sampling.logprobs is not None:
        body["return_logprob"] = True
        body["top_logprobs_num"] = sampling.logprobs
        if prefill and sampling.prompt_logprobs:
            body["logprob_start_len"] = 0
    if kv_hints is not None:
        body["kv_hints"] = kv_hints
    return body


def priority_for(final: bool) -> int:
    """Request priority for SGLang's priority eviction (``--radix-eviction-policy priority``):
    its radix cache evicts the prefixes of low-priority requests first.

    A request whose branch goes on will be continued, so its prefix is worth keeping (1); the
    last request of a branch (a branch of one included) leaves KV its branch will not reuse
    (0). Stock SGLang cannot follow branch counts (a prefix keeps the highest priority that
    ever reached it, A.3); the count-aware hint call of the engine patch does."""
    return 0 if final else 1


# -- the stream back ----------------------------------------------------------------------


class Finish(msgspec.Struct, frozen=True):
    type: str
    message: str | None = None
    status_code: int | None = None
    length: int | None = None


class MetaInfo(msgspec.Struct, frozen=True):
    id: str | None = None
    finish_reason: Finish | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int | float | str] | None = None
    """SGLang's split of ``cached_tokens`` by tier (with HiCache), plus the engine patch's
    ``evinfra_fetched`` / ``evinfra_restored`` / ``evinfra_fetch_s`` (``engine_patch/wire.py``)."""
    e2e_latency: float | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    """With ``return_logprob``: ``(logprob, id, text)`` per output token, all so far (or,
    with incremental streaming, the chunk's)."""
    output_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    """With ``top_logprobs_num`` > 0: each position's alternatives, as the above."""
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    """With ``logprob_start_len`` 0 (a prefill's answer): the same per prompt token, the
    first's log-probability None."""
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None


class Chunk(msgspec.Struct, frozen=True):
    output_ids: list[int] = []
    meta_info: MetaInfo = MetaInfo()


class StreamError(msgspec.Struct, frozen=True):
    """``{"error": {...}}`` in a stream (SGLang reports errors raised after the response
    started this way)."""

    message: str
    code: int | None = None


class _ErrorBody(msgspec.Struct, frozen=True):
    error: StreamError


_chunk = msgspec.json.Decoder(Chunk)
_error = msgspec.json.Decoder(_ErrorBody)

DONE = object()


def parse_sse_line(line: bytes) -> Chunk | StreamError | object | None:
    """One line of the stream: a :class:`Chunk`, a :class:`StreamError`, ``DONE``, or None
    (blank lines, comments). Raises ``msgspec.DecodeError``/``ValidationError`` for a data
    line that is neither."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return DONE
    if data.startswith(b'{"error"'):
        return _error.decode(data).error
    return _chunk.decode(data)


class OutputCursor:
    """New output tokens of a stream, whether chunks repeat all tokens so far or not, and
    their log-probabilities."""

    def __init__(self) -> None:
        self.sent = 0
        self._new = 0

    def new_tokens(self, chunk: Chunk) -> list[int]:
        ids = chunk.output_ids
        total = chunk.meta_info.completion_tokens
        if total and len(ids) == total and total >= self.sent:
            new = ids[self.sent:]  # cumulative chunk
        else:
            new = ids  # incremental chunk
        self.sent += len(new)
        self._new = len(new)
        return list(new)

    def new_logprobs(self, chunk: Chunk) -> TokenLogprobs | None:
        """The log-probabilities of the tokens :meth:`new_tokens` just returned for
        ``chunk``: the last entries of its lists in either streaming mode (None: it has
        none)."""
        meta = chunk.meta_info
        entries = meta.output_token_logprobs
        if entries is None:
            return None
        return _last(entries, meta.output_top_logprobs, self._new)


def prompt_logprobs(meta: MetaInfo) -> TokenLogprobs:
    """A prefill's log-probabilities of its prompt's tokens but the first (which has none);
    fewer if the engine reported fewer."""
    return _last(meta.input_token_logprobs or [], meta.input_top_logprobs,
                 max(0, meta.prompt_tokens - 1))


def _last(entries: list, tops: list | None, n: int) -> TokenLogprobs:
    """The last ``n`` entries and their alternatives (``(logprob, id, text)`` each)."""
    n = min(n, len(entries))
    tops = tops[len(tops) - n:] if n and tops else [None] * n
    return TokenLogprobs([e[0] for e in entries[len(entries) - n:]] if n else [],
                         [[(t[1], t[0]) for t in top or ()] for top in tops])
