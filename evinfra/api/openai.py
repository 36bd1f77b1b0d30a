"""``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming (SSE) and not.

The handler validates the body, applies the chat template and tokenizes, and serves the
request as ``serving.py`` does for every dialect (hints, submission, output text, chat
reading); this module writes OpenAI's answers and chunks. ``usage`` reports
``prompt_tokens_details.cached_tokens``: the input tokens whose KV the request reused.
Log-probabilities (``logprobs.py``) come in each chunk for its tokens.
``n`` choices are ``n`` requests at the service: choice 0 and forks of its branch; a
completion's ``best_of`` candidates likewise, ranked by log-probability per token once all
are done. A completion's batch of prompts is that many requests, their choices in prompt
order.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from functools import partial
from typing import AsyncIterator, Callable, Sequence

import msgspec
import numpy as np
from aiohttp import web

from evinfra.api.constraints import (Grammar, check_served, engine_grammars, one_grammar,
                                     output_schema)
from evinfra.api.logprobs import LogprobReader, top_logprobs
from evinfra.api.schemas import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                 TokenizeRequest, ToolChoice, decode_body, refuse_unserved,
                                 template_kwargs)
from evinfra.api.serving import (ChatOutput, Sample, chat_reader, check_model, max_tokens_for,
                                 output_ready, outputs, read_hints, reasoning_tokens,
                                 stop_strings, whole)
from evinfra.api.sse import EventStream
from evinfra.api.tokenizer import Tokenizer, continue_final, message_text
from evinfra.api.tool_calls import ToolCall
from evinfra.core.contracts import Sampling
from evinfra.errors import EvinfraError, RequestError
from evinfra.control import Service, Submission

__all__ = ["OpenAIRoutes"]

_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


_INLINE_TOKENIZE = 64 * 1024
"""Bytes of text tokenized on the event loop; a longer one goes to a thread, so that one
client's long ``/tokenize`` does not stall every other request."""

_MAX_SAMPLED = 2048
"""Requests one completion may make: its prompts times its candidates per prompt."""

_Echo = Callable[[Sample], tuple[str, dict | None]]
"""A choice's echoed prompt: its text and, with ``logprobs``, its entries (else None)."""


def _token_ids(ids: list, param: str = "prompt") -> np.ndarray:
    if not ids or not all(type(i) is int for i in ids):
        raise RequestError("prompt must be a string, a list of token ids, or a list of "
                           "either (a batch), none of them empty", param=param)
    if min(ids) < 0 or max(ids) > 0xFFFFFFFF:  # (before numpy: ids past 2^63 overflow it)
        raise RequestError("token ids must be in [0, 2^32)", param=param)
    return np.asarray(ids, dtype=np.uint32)


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion: one (text or token ids) or a batch of them."""
    p = body.prompt
    if isinstance(p, str) or p and type(p[0]) is int:
        return [p]
    if not p:
        raise RequestError("prompt must not be empty", param="prompt")
    for i, one in enumerate(p):
        if not isinstance(one, (str, list)):  # a batch mixing texts and ids ([["a"], 5])
            raise RequestError("a batch of prompts is a list of texts or of token-id lists, "
                               f"not {type(one).__name__}s", param=f"prompt[{i}]")
    return p


def _prompt_tokens(prompt: str | list[int], tok: Tokenizer) -> np.ndarray:
    """A completion's prompt as the engines read it: a text gets the special tokens the
    model's tokenizer adds (a BOS), as SGLang and vLLM tokenize it; token ids are taken as
    they are."""
    return (tok.encode(prompt, add_special_tokens=True) if isinstance(prompt, str)
            else _token_ids(prompt))


def _chat_prompt(body: ChatCompletionRequest | TokenizeRequest, tools: list[dict] | None,
                 tok: Tokenizer) -> str:
    """The messages through the chat template; the assistant's turn opened after them, or
    their final message, an assistant's, left open to go on with
    (``continue_final_message``)."""
    if not body.messages:
        raise RequestError("messages must not be empty", param="messages")
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # (a list is not hashable)
            raise RequestError(f"messages[{i}].role must be one of {sorted(_ROLES)}",
                               param=f"messages[{i}].role")
        if m.get("content") is None and "tool_calls" not in m and "function_call" not in m:
            # (calls are checked where the template reads them: only an assistant's may
            # stand for its content)
            raise RequestError(f"messages[{i}] has no content (only an assistant's message "
                               "with tool_calls may leave it out)",
                               param=f"messages[{i}].content")
    go_on = body.continue_final_message
    if go_on and body.add_generation_prompt:
        raise RequestError("continue_final_message goes on with the final message: "
                           "add_generation_prompt cannot open a new one",
                           param="add_generation_prompt")
    opened = not go_on if body.add_generation_prompt is None else body.add_generation_prompt
    effort = body.reasoning_effort if isinstance(body, ChatCompletionRequest) else None
    text = tok.apply_chat_template(body.messages, tools,
                                   template_kwargs(body.chat_template_kwargs, effort), opened)
    return continue_final(text, body.messages) if go_on else text


def _candidates(body: CompletionRequest, prompts: int) -> int:
    """How many choices a completion samples per prompt (``best_of``), its options
    checked."""
    best = body.best_of or body.n
    if best < body.n:
        raise RequestError("best_of must be at least n", param="best_of")
    if best > body.n and body.stream:
        raise RequestError("best_of greater than n cannot be streamed", param="best_of")
    if prompts * best > _MAX_SAMPLED:
        raise RequestError(f"{prompts} prompts of {best} choices each: at most "
                           f"{_MAX_SAMPLED} in one request", param="prompt")
    return best


def _echo(body: CompletionRequest, prompt: str | list[int], tokens: np.ndarray,
          tok: Tokenizer) -> str:
    """A prompt's text, for ``echo`` (token ids are decoded)."""
    if not body.echo:
        return ""
    return prompt if isinstance(prompt, str) else tok.decode(tokens.tolist())


def _per_token(sample: Sample) -> float:
    """A candidate's mean log-probability per output token it returns (a stop string may
    end it before tokens the engine reported): ``best_of``'s rank. An empty one ranks
    last."""
    sampled = sample.logprobs.sampled[:len(sample.ids)]
    return math.fsum(sampled) / len(sampled) if sampled else -math.inf


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """``logit_bias`` checked: token ids (decimal strings) to biases in [-100, 100]."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isdigit() and int(key) < 2**32) or not -100 <= value <= 100:
            raise RequestError("logit_bias maps token ids (decimal strings) to biases from "
                               f"-100 to 100, not {key!r}: {value!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _chat_grammar(body: ChatCompletionRequest, tools: list[dict] | None
                  ) -> tuple[Grammar | None, bool]:
    """What holds a chat request's output (None: nothing), and whether it is a forced tool
    choice's calls: :func:`~evinfra.api.constraints.output_schema` and the engines' own
    constraints."""
    choice, fmt = body.tool_choice, body.response_format
    schema, forced = output_schema(
        tools, choice not in (None, "none", "auto"),
        choice.function.name if isinstance(choice, ToolChoice) else None,
        body.parallel_tool_calls, fmt.type if fmt is not None else None,
        fmt.json_schema.schema if fmt is not None and fmt.json_schema is not None else None,
        "response_format", "response_format.json_schema.schema")
    given = engine_grammars(None, body.regex, body.ebnf, body.structured_outputs)
    if schema is not None:
        given.insert(0, Grammar("a forced tool choice", "tool_choice", json_schema=schema)
                     if forced else Grammar("a JSON response_format", "response_format",
                                            json_schema=schema))
    return one_grammar(given), forced


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OpenAIRoutes:
    def __init__(self, service: Service, tokenizer: Tokenizer) -> None:
        self.service = service
        self.tok = tokenizer
        self.model = service.config.model
        self.limits = service.config.limits

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model_info)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    def _model(self) -> dict[str, object]:
        """OpenAI's fields, and the context window as vLLM and SGLang give it (harnesses read
        it to know when to compact)."""
        return {"id": self.model.name, "object": "model", "created": 0, "owned_by": "evinfra",
                "max_model_len": self.model.max_context_tokens}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model()]})

    async def model_info(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (the OpenAI client's ``models.retrieve``)."""
        check_model(self.model, request.match_info["model"])
        return web.json_response(self._model())

    async def tokenize(self, request: web.Request) -> web.Response:
        """The tokens this server prefills for a completion's ``prompt`` or a chat
        completion's ``messages`` and ``tools`` (by default): what a harness counts against
        the context window (``max_model_len``) before it sends, or compacts."""
        body = decode_body(await request.read(), TokenizeRequest)
        if body.model is not None:
            check_model(self.model, body.model)
        if body.prompt is None and body.messages is None:
            raise RequestError("give a prompt or messages", param="prompt")
        if body.prompt is not None and body.messages is not None:
            raise RequestError("give a prompt or messages, not both", param="prompt")
        if body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            tools = msgspec.to_builtins(body.tools) if body.tools else None
            text = _chat_prompt(body, tools, self.tok)
            special = bool(body.add_special_tokens)
        size, limit = len(text.encode()), self.limits.tokenize_bytes
        if size > limit:
            raise RequestError(f"the text to tokenize is {size} bytes: at most {limit} "
                               "(limits.tokenize_bytes)", status=413, param="prompt")
        if size > _INLINE_TOKENIZE:  # a long text is tokenized off the event loop
            ids = await asyncio.to_thread(self.tok.encode, text, add_special_tokens=special)
        else:
            ids = self.tok.encode(text, add_special_tokens=special)
        context = self.model.max_context_tokens
        if ids.size > context:
            raise RequestError(f"the text is {ids.size} tokens, past the model's context of "
                               f"{context}", param="prompt", code="context_length_exceeded")
        tokens = ids.tolist()
        out: dict[str, object] = {"count": len(tokens), "tokens": tokens,
                                  "max_model_len": context}
        if body.return_token_strs:
            out["token_strs"] = self.tok.token_strs(tokens)
        return web.Response(body=msgspec.json.encode(out), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), DetokenizeRequest)
        if body.model is not None:
            check_model(self.model, body.model)
        ids = _token_ids(body.tokens, "tokens").tolist() if body.tokens else []
        return web.json_response({"prompt": self.tok.decode(ids)})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), ChatCompletionRequest)
        refuse_unserved(body)
        tools = body.template_tools()
        grammar, forced = _chat_grammar(body, tools)
        self._check_grammar(grammar)
        prompt = _chat_prompt(body, tools, self.tok)
        continued = message_text(body.messages[-1]) if body.continue_final_message else None
        reader = chat_reader(self.model, prompt, tools if grammar is None else None,
                             body.parallel_tool_calls, _call_id, forced, continued)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._serve(request, body, [self.tok.encode(prompt)], max_tokens,
                                 chat=True, reader=reader, grammar=grammar)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), CompletionRequest)
        refuse_unserved(body)
        grammar = one_grammar(engine_grammars(body.json_schema, body.regex, body.ebnf,
                                              body.structured_outputs))
        self._check_grammar(grammar)
        prompts = _prompts(body)
        candidates = _candidates(body, len(prompts))
        tokens = [_prompt_tokens(p, self.tok) for p in prompts]
        return await self._serve(request, body, tokens, body.max_tokens, chat=False,
                                 grammar=grammar, candidates=candidates,
                                 echoes=[_echo(body, p, t, self.tok)
                                         for p, t in zip(prompts, tokens)])

    def _check_grammar(self, grammar: Grammar | None) -> None:
        if grammar is not None:
            check_served(self.service.constrains_output(), grammar.what, grammar.param)

    def _check(self, body: ChatCompletionRequest | CompletionRequest, tokens: np.ndarray,
               max_tokens: int | None, chat: bool, grammar: Grammar | None) -> Sampling:
        check_model(self.model, body.model)
        if body.top_k == 0 or body.top_k < -1:
            raise RequestError("top_k must be -1 (no limit) or at least 1", param="top_k")
        max_tokens = max_tokens_for(self.model, tokens, max_tokens)
        if body.min_tokens > max_tokens:
            raise RequestError(f"min_tokens ({body.min_tokens}) must not exceed max_tokens "
                               f"({max_tokens})", param="min_tokens")
        stop_ids = list(self.tok.eos_token_ids)
        k = _logprobs(body) if chat else top_logprobs(body.logprobs, "logprobs")
        sampling = Sampling(max_tokens, body.temperature, body.top_p, body.ignore_eos,
                            stop_ids, body.seed, body.top_k, body.min_p,
                            body.frequency_penalty, body.presence_penalty,
                            body.repetition_penalty, k, _logit_bias(body.logit_bias),
                            min_tokens=body.min_tokens,
                            prompt_logprobs=not chat and body.echo and k is not None)
        return grammar.hold(sampling) if grammar is not None else sampling

    async def _serve(self, request: web.Request, body, prompts: list[np.ndarray],
                     max_tokens: int | None, *, chat: bool,
                     reader: Callable[[], ChatOutput] | None = None,
                     grammar: Grammar | None = None, candidates: int | None = None,
                     echoes: Sequence[str] = ("",)) -> web.StreamResponse:
        """``reader`` makes how a chat output is read (None: all content), one per choice.
        A completion samples ``candidates`` choices per prompt (``best_of``; None: ``n``)
        and starts each choice's text with its prompt's ``echoes`` (one per prompt), and
        its log-probabilities with the prompt's, which its prompt's first choice asks for.

        Choice 0 is the request on its branch. With ``n`` > 1 the others are forks of that
        branch, each a branch of one (the harness continues its branch with the choice it
        keeps), sent when choice 0's first token arrives: its prefill is done then, so the
        router finds the prompt's KV in the directory and the forks reuse it, where sending
        all at once would prefill the prompt ``n`` times. A batch of prompts is served as
        that many such requests at once, each prompt's choices after the previous prompt's;
        it carries no branch hint (a branch runs one request at a time)."""
        samplings = [self._check(body, t, max_tokens, chat, grammar) for t in prompts]
        hints = read_hints(request, body.evinfra)
        if len(prompts) > 1 and (hints.branch_id or hints.parent_branch_id or hints.final):
            raise RequestError("a batch of prompts carries no branch hints: send a branch's "
                               "request on its own", param="prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        count = candidates or body.n
        if count > body.n and samplings[0].logprobs is None:  # the rank reads them
            samplings = [msgspec.structs.replace(s, logprobs=0) for s in samplings]
        k = samplings[0].logprobs
        samples = [Sample(i, rid if i == 0 else f"{rid}-{i}", reader() if reader else None,
                          LogprobReader(self.tok, k) if k is not None else None)
                   for i in range(count * len(prompts))]
        for tokens, sampling, head in zip(prompts, samplings, samples[::count]):
            self.service.submit(Submission(tokens, sampling, hints.branch_id,
                                           hints.parent_branch_id, hints.final, head.rid),
                                head.channel)

        def fork(p: int) -> Callable[[], None]:
            """Send prompt ``p``'s choices after its first."""
            def send() -> None:
                tokens, sampling = prompts[p], samplings[p]
                for j, s in enumerate(samples[p * count + 1:(p + 1) * count], 1):
                    seed = None if sampling.seed is None else sampling.seed + j
                    self.service.submit(Submission(
                        tokens, msgspec.structs.replace(sampling, seed=seed,
                                                        prompt_logprobs=False),
                        None, hints.branch_id, True, s.rid), s.channel)
            return send

        def echo(s: Sample) -> tuple[str, dict | None]:
            """Choice ``s``'s prompt text and, for ``echo`` with ``logprobs``, its prompt
            entries (else None): the engine reported them to the prompt's first choice,
            which has started (the others are sent then), so they are in."""
            p = s.index // count
            if chat or not body.echo or body.logprobs is None:
                return echoes[p], None
            return echoes[p], s.logprobs.prompt(prompts[p].tolist(),
                                                samples[p * count].channel.prompt)

        stops = stop_strings(body.stop, body.min_tokens,
                             body.include_stop_str_in_output or body.no_stop_trim)
        streams = [outputs(self.service, self.tok, s, stops,
                           fork(s.index // count) if s.index % count == 0 and count > 1
                           else None)
                   for s in samples]
        try:
            prompt = sum(int(t.size) for t in prompts)
            if body.stream:
                return await self._stream(request, rid, body, samples, streams, chat, prompt,
                                          count, echo)
            return await self._whole(rid, body, samples, streams, chat, prompt, count, echo)
        finally:
            # The answer is out, the client went away or a choice failed: no choice still
            # running is wanted now (a finished one is not aborted).
            for s in samples:
                self.service.abort(s.rid)

    def _usage(self, samples: list[Sample], prompt: int, count: int, whole: bool = True
               ) -> dict:
        """A prompt counts once (its KV is shared by its ``count`` choices, its cached part
        is what its first choice reused); the completions of every choice (of every
        ``best_of`` candidate). With a reasoning parser, once the outputs are ``whole``,
        ``completion_tokens_details.reasoning_tokens``: the reasoning's tokens as the
        tokenizer reads its text (the Responses API counts them so too)."""
        cached = sum(h.record.cached_tokens for h in samples[::count] if h.record is not None)
        completion = sum(len(s.ids) for s in samples)
        usage: dict = {"prompt_tokens": prompt, "completion_tokens": completion,
                       "total_tokens": prompt + completion,
                       "prompt_tokens_details": {"cached_tokens": cached}}
        if whole and samples[0].out is not None and samples[0].out.think is not None:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": reasoning_tokens(self.tok, samples)}
        return usage

    async def _whole(self, rid: str, body, samples: list[Sample], streams: list, chat: bool,
                     prompt: int, count: int, echo: _Echo) -> web.Response:
        """``count`` choices per prompt; ``echo`` gives a choice's prompt text and entries."""
        if len(samples) == 1:
            choices = [await self._whole_choice(body, samples[0], streams[0], chat, echo)]
        else:
            # Each choice is read as its output comes, so a stop string ends it at once.
            tasks = [asyncio.ensure_future(self._whole_choice(body, s, o, chat, echo))
                     for s, o in zip(samples, streams)]
            try:
                choices = await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        if count > body.n:  # best_of: each prompt's n best candidates, best first
            best = [s for p in range(0, len(samples), count)
                    for s in sorted(samples[p:p + count], key=_per_token, reverse=True)[:body.n]]
            choices = [{**choices[s.index], "index": i} for i, s in enumerate(best)]
            if body.logprobs is None:  # read for the rank only
                for c in choices:
                    c["logprobs"] = None
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.model.name, "choices": choices,
            "usage": self._usage(samples, prompt, count)})

    async def _whole_choice(self, body, sample: Sample, stream, chat: bool,
                            echo: _Echo) -> dict:
        reasoning, content, finish = await whole(sample, stream)
        message: dict = {"role": "assistant"}
        out = sample.out
        if out is not None:
            if out.think is not None:
                message["reasoning_content"] = reasoning or None
            if out.calls:
                message["tool_calls"] = [c.wire() for c in out.calls]
                content = content or None
            finish = out.finish(finish)
        message["content"] = content
        i = sample.index
        text, echoed = echo(sample)  # first: the output's text offsets follow the prompt's
        logprobs = _logprobs_of(sample.logprobs, sample.ids, chat)
        if echoed is not None:
            logprobs = {key: echoed[key] + logprobs[key] for key in echoed}
        choice = ({"index": i, "message": message, "finish_reason": finish,
                   "logprobs": logprobs} if chat else
                  {"index": i, "text": text + content, "finish_reason": finish,
                   "logprobs": logprobs})
        if body.return_token_ids:
            choice["token_ids"] = sample.ids
        return choice

    async def _stream(self, request: web.Request, rid: str, body, samples: list[Sample],
                      streams: list, chat: bool, prompt: int, count: int,
                      echo: _Echo) -> web.StreamResponse:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        enc = msgspec.json.encode
        opts = body.stream_options
        running_usage = opts is not None and opts.continuous_usage_stats

        def sse(obj: dict) -> bytes:
            return b"data: " + enc(obj) + b"\n\n"

        def chunk(sample: Sample, delta: str | None, finish: str | None, role: bool = False,
                  ids: list[int] | None = None, calls: list[dict] | None = None,
                  reasoning: str = "", logprobs: dict | None = None) -> bytes:
            """``logprobs``: given for a chunk of no output tokens (``ids``)."""
            index = sample.index
            if ids is not None:
                logprobs = _logprobs_of(sample.logprobs, ids, chat)
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
                choice = {"index": index, "delta": d, "finish_reason": finish,
                          "logprobs": logprobs}
            else:
                choice = {"index": index, "text": delta or "", "finish_reason": finish,
                          "logprobs": logprobs}
            if body.return_token_ids and ids is not None:
                choice["token_ids"] = ids
            out = {"id": rid, "object": obj, "created": created, "model": self.model.name,
                   "choices": [choice]}
            if running_usage:
                out["usage"] = self._usage(samples, prompt, count, whole=False)
            return sse(out)

        async def choice_events(sample: Sample, stream, item):
            """One choice's chunks, from its first output ``item`` to its finish."""
            out, lp = sample.out, sample.logprobs
            n_calls = 0

            def read(reasoning: str, delta: str, calls: list[ToolCall],
                     ids: list[int] | None = None) -> bytes:
                """A chunk of what the reader lets out (maybe only the token ids or their
                log-probabilities: the parsers hold a tag's text until they know what it is,
                a call's until it is whole)."""
                nonlocal n_calls
                wire = [c.wire(n_calls + k) for k, c in enumerate(calls)]
                n_calls += len(calls)
                if not (reasoning or delta or wire or ids and (body.return_token_ids or lp)):
                    return b""
                return chunk(sample, delta if delta or not (wire or reasoning) else None, None,
                             ids=ids, calls=wire, reasoning=reasoning)

            if chat:
                yield chunk(sample, "", None, role=True)
            elif body.echo:
                if item is None:  # the prompt's log-probabilities are in by then
                    item = await stream.__anext__()
                text, echoed = echo(sample)
                yield chunk(sample, text, None, logprobs=echoed)
            if item is None:
                item = await stream.__anext__()
            while item[0] == "text":
                if out is None:
                    yield chunk(sample, item[1], None, ids=item[2])
                else:
                    yield read(*out.feed(item[1]), item[2])
                item = await stream.__anext__()
            _, finish, rest = item
            if out is not None:
                yield read(*out.end())
                finish = out.finish(finish)
            yield chunk(sample, None if chat else "", finish, ids=rest)

        # An error before the first output leaves as an ordinary error response.
        first = await streams[0].__anext__()

        async def events():
            """The stream after the headers: the choices' chunks, the usage, [DONE]."""
            try:
                if len(samples) == 1:
                    async for data in choice_events(samples[0], streams[0], first):
                        yield data
                else:
                    async for data in _merged([choice_events(s, o, first if s.index == 0
                                                             else None)
                                               for s, o in zip(samples, streams)]):
                        yield data
                if opts is not None and opts.include_usage:
                    yield sse({"id": rid, "object": obj, "created": created,
                               "model": self.model.name, "choices": [],
                               "usage": self._usage(samples, prompt, count)})
            except EvinfraError as exc:
                # Headers are out: report the error in the stream, as OpenAI does.
                yield sse({"error": {"message": exc.message, "type": type(exc).__name__,
                                     "code": None}})
            yield b"data: [DONE]\n\n"

        resp = EventStream(partial(output_ready, samples))
        await resp.prepare(request)
        try:
            async for data in events():
                await resp.send(data)
            await resp.end()
        except ConnectionResetError:
            # The client went away mid-stream, an everyday event: end the handler without
            # raising (aiohttp would log a traceback per disconnect); _serve stops the choices.
            pass
        return resp


def _logprobs(body: ChatCompletionRequest) -> int | None:
    """A chat request's ``Sampling.logprobs``: ``top_logprobs`` alternatives, if
    ``logprobs``."""
    k = top_logprobs(body.top_logprobs, "top_logprobs")
    if not body.logprobs:
        if k:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return k or 0


def _logprobs_of(reader: LogprobReader | None, ids: list[int], chat: bool) -> dict | None:
    """A choice's ``logprobs`` for its next tokens ``ids`` (None: not asked for)."""
    if reader is None:
        return None
    if chat:
        return {"content": reader.entries(ids), "refusal": None}
    return reader.completion(ids)


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
