"""Output log-probabilities in OpenAI's shapes: what an RL trainer or an evaluator reads back.

The engines report, per output token, the sampled token's log-probability and, when asked,
its ``k`` most likely alternatives (``TokenLogprobs``); a choice's :class:`LogprobReader`
turns the next tokens of its output into entries as its chunks go out (after its prompt's,
for a completion's ``echo``: the prefill engine reports those). A token's text is the token
decoded alone, its ``bytes`` that text's UTF-8 (a token that is part of a character reads as
U+FFFD, as in vLLM). Every output token has an entry, whatever part of the answer
its text went to (reasoning, content, a tool call), as in SGLang and vLLM: the entries line
up with the output token ids.
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import Sequence

from evinfra.api.tokenizer import Tokenizer
from evinfra.core.events import TokenLogprobs
from evinfra.errors import EvinfraError, RequestError

__all__ = ["MAX_TOP", "LogprobReader", "top_logprobs"]

MAX_TOP = 20
"""Alternatives per token, at most (OpenAI's limit for chat)."""


def top_logprobs(k: int | None, param: str) -> int | None:
    """``k`` checked: None (not asked) or 0 to :data:`MAX_TOP`."""
    if k is not None and not 0 <= k <= MAX_TOP:
        raise RequestError(f"{param} must be between 0 and {MAX_TOP}", param=param)
    return k


@functools.lru_cache(maxsize=1 << 17)
def _token_text(tok: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token decoded alone, and its UTF-8 bytes (entries share the list: it is only
    written out). Cached: with 20 alternatives an entry reads 21 tokens, and a vocabulary's
    tokens recur in every answer."""
    text = tok.decode([token])
    return text, list(text.encode())


class LogprobReader:
    """Reads one choice's log-probabilities in output order, token by token."""

    def __init__(self, tok: Tokenizer, k: int) -> None:
        self.tok = tok
        self.k = k
        self.sampled: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self._at = 0  # entries given so far
        self._offset = 0  # characters of text before the next token (completions)

    def add(self, logprobs: TokenLogprobs) -> None:
        """What the engine reported for the next output tokens."""
        self.sampled.extend(logprobs.sampled)
        self.top.extend(logprobs.top)

    def _take(self, ids: Sequence[int]) -> range:
        span = range(self._at, self._at + len(ids))
        if span.stop > len(self.sampled):
            # An engine that reports fewer than it streams would misalign every later entry.
            raise EvinfraError("the engine did not report the log-probabilities asked for")
        self._at = span.stop
        return span

    def entries(self, ids: Sequence[int]) -> list[dict]:
        """The next tokens' entries in the chat and Responses shape: ``token``, ``logprob``,
        ``bytes`` and ``top_logprobs`` (each a ``token``, ``logprob``, ``bytes``)."""
        out = []
        tok = self.tok
        for token, i in zip(ids, self._take(ids)):
            text, raw = _token_text(tok, token)
            top = []
            for alt, lp in self.top[i][:self.k]:
                t, b = _token_text(tok, alt)
                top.append({"token": t, "logprob": lp, "bytes": b})
            out.append({"token": text, "logprob": self.sampled[i], "bytes": raw,
                        "top_logprobs": top})
        return out

    def completion(self, ids: Sequence[int]) -> dict:
        """The next tokens in the completions shape: parallel lists of ``tokens``,
        ``token_logprobs``, ``top_logprobs`` (text to log-probability) and ``text_offset``
        (each token's first character in the choice's text)."""
        span = self._take(ids)
        return self._completion(ids, [self.sampled[i] for i in span],
                                [self.top[i] for i in span])

    def prompt(self, ids: Sequence[int], logprobs: TokenLogprobs | None) -> dict:
        """A prompt's tokens in the completions shape, for ``echo``: the first token has no
        log-probability (None, and None alternatives, as OpenAI's), the others the engine's
        (``PrefillDone.prompt_logprobs``). The output's offsets then follow the prompt's."""
        if logprobs is None or len(logprobs.sampled) != len(ids) - 1:
            raise EvinfraError("the engine did not report the prompt's log-probabilities")
        return self._completion(ids, [None, *logprobs.sampled], [None, *logprobs.top])

    def _completion(self, ids: Sequence[int], sampled: list[float | None],
                    tops: list[list[tuple[int, float]] | None]) -> dict:
        tok = self.tok
        tokens = [_token_text(tok, t)[0] for t in ids]
        offsets = list(accumulate(map(len, tokens), initial=self._offset))
        self._offset = offsets.pop()
        top = [None if alts is None else {_token_text(tok, a)[0]: lp for a, lp in alts[:self.k]}
               for alts in tops]
        return {"tokens": tokens, "token_logprobs": sampled, "top_logprobs": top,
                "text_offset": offsets}
