"""What a fake request generates, and when: deterministic from (seed, request id).

A request's output is fixed when its decode order arrives: the token ids, drawn from the
configured vocabulary, and the finish. With ``ignore_eos`` it runs to ``max_tokens``
("length"); otherwise it stops at a natural length drawn uniformly from
``max(1, min_tokens)..max_tokens`` ("stop", or "length" when the draw is ``max_tokens``), or
earlier at its first stop token from the ``min_tokens``-th on. As in SGLang, ``ignore_eos``
also ignores ``stop_token_ids``, and a stop token is part of the output ids.

Decode progress is integer arithmetic on milli-tokens, so the engine that wakes every
iteration and the one that jumps to the next state change agree exactly.
"""

from __future__ import annotations

import hashlib

import numpy as np

from evinfra.core.contracts import Sampling
from evinfra.core.events import TokenLogprobs

__all__ = ["DecodeProgress", "OutputPlanner"]


class OutputPlanner:
    """Plans outputs from one pool of random ids per (seed, vocabulary).

    A request reads the pool from an offset with a stride, both hashed from its id:
    deterministic per request, whatever the order requests come in, and one vectorised
    gather (a generator per request costs ~100 µs to seed, more than the rest of a simulated
    request's decode). The stride is odd, so a read never repeats within the pool's length,
    and two requests with different strides share no run of ids, as two answers of a real
    model share no long verbatim run: the service recognises an agent's answer by its
    content when it turns up in another prompt (:mod:`evinfra.control.carryover`)."""

    POOL = 1 << 20

    def __init__(self, seed: int, vocab: tuple[int, int]) -> None:
        self.seed = seed
        self.vocab = vocab
        rng = np.random.default_rng([seed, 0x6F7574])
        self.pool = rng.integers(vocab[0], vocab[1], size=self.POOL, dtype=np.uint32)

    def plan(self, request: str, sampling: Sampling) -> tuple[np.ndarray, str]:
        """The output token ids of ``request`` (uint32) and its finish."""
        digest = hashlib.blake2b(request.encode(), digest_size=16,
                                 key=self.seed.to_bytes(8, "little", signed=True)).digest()
        where = int.from_bytes(digest[:8], "little")
        length = int.from_bytes(digest[8:], "little")
        max_tokens = max(1, sampling.max_tokens)
        if sampling.ignore_eos:
            n, finish = max_tokens, "length"
        else:
            least = min(max(1, sampling.min_tokens), max_tokens)
            n = least + length % (max_tokens - least + 1)
            finish = "length" if n == max_tokens else "stop"
        if n > self.POOL:
            raise ValueError(f"{n} output tokens exceed the fake engine's pool of {self.POOL}")
        stride = 2 * (where >> 20 & (self.POOL // 2 - 1)) + 1
        at = np.arange(n, dtype=np.int64)
        at *= stride
        at += where & (self.POOL - 1)
        tokens = self.pool[at & (self.POOL - 1)]
        if not sampling.ignore_eos and sampling.stop_token_ids:
            least = max(0, sampling.min_tokens - 1)  # the engine masks them before
            hits = np.flatnonzero(np.isin(tokens[least:], sampling.stop_token_ids))
            if hits.size:
                tokens, finish = tokens[:least + hits[0] + 1], "stop"
        return tokens, finish

    def logprobs(self, tokens: np.ndarray, k: int) -> TokenLogprobs:
        """Log-probabilities of output ``tokens`` (a slice of a planned output) and, for
        each, its ``k`` most likely tokens: deterministic in the token ids. The sampled
        token has probability 0.4-0.99 and leads the top list; each next one is half as
        likely as the one before, from what the sampled token leaves (so they sum below 1),
        and is the next id in the vocabulary (as many as it has)."""
        low, high = self.vocab
        t = tokens.astype(np.int64)
        p = 0.4 + 0.59 * ((t % 1000003 * 2654435761) % 1000) / 1000.0
        sampled = np.log(p)
        k = min(k, high - low)
        if k == 0:
            return TokenLogprobs(sampled.tolist(), [[] for _ in range(t.size)])
        j = np.arange(1, k)
        ids = np.concatenate([t[:, None], low + (t[:, None] - low + j) % (high - low)], axis=1)
        lps = np.concatenate([sampled[:, None], np.log(1.0 - p)[:, None] - j * np.log(2.0)],
                             axis=1)
        return TokenLogprobs(sampled.tolist(), [list(zip(i, lp))
                                                for i, lp in zip(ids.tolist(), lps.tolist())])


class DecodeProgress:
    """Tokens of a request after ``i`` decode iterations: the first token when it joins the
    batch (the prefill's own sample), then ``t_acc`` per iteration on average, kept exact as
    ``1 + floor(i * t_acc_milli / 1000)``."""

    def __init__(self, t_acc: float) -> None:
        self.milli = max(1, round(t_acc * 1000))

    def produced(self, iters: int, n_out: int) -> int:
        return min(n_out, 1 + iters * self.milli // 1000)

    def iterations(self, n_out: int) -> int:
        """Iterations after which a request has produced all ``n_out`` tokens."""
        return -(-(n_out - 1) * 1000 // self.milli)
