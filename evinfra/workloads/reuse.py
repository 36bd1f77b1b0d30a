"""The ideal KV reuse ``h*`` of each request: what an unlimited cache shared by all nodes holds.

Paper Figure 3 defines lost KV reuse as ``1 - h/h*``, with ``h*`` the hit rate "with an unlimited
KV cache shared by all nodes and no phase switches": every prompt token whose KV an earlier
request produced. An earlier request produces the KV of its input and of its output tokens
except the last one (the last sampled token is never fed back through the model). Only full
pages can be reused (engines cache pages of ``page_size`` tokens), so a request's ideal reuse
is ``page_size`` times the number of leading full pages of its input that some earlier request
produced.

Input pages count as produced when a request is sent ("earlier" means sent earlier). Output
pages are credited lazily: a page is named by its whole prefix, so the pages holding a request's
output can only recur in a sequence that extends that request's input and output, and in the
runner that is the next prompt of the same branch or of a fork of it, both built from the
branch's context. The runner passes how many leading tokens of a prompt an earlier request
produced (``known``); those pages are hits without a lookup and are added to the set then.
This hashes each page once, where registering outputs at completion would hash them twice.

A page is named by a 64-bit hash of the whole prefix up to it, a random linear form of the
prefix's tokens mod ``2**64``: ``H_i = H_{i-1} + o_i * sum_k w_k (t_{i,k} + 1)`` with random
odd weights ``w`` (per position in a page) and ``o`` (per page position); the ``+ 1`` keeps a page
of zeros from adding nothing. This is not SGLang's
SHA-256 chain (``core/hashing.py``): ``h*`` only needs prefix identity, and this hash costs one
matrix-vector product and one cumulative sum per batch of pages, where the SHA-256 chain costs a
Python call per page. For two different prefixes the hashes collide with probability about
``2**-63`` over the weights (token contents are not adversarial: they are synthesized).

All produced pages go into one cluster-wide set; every added path brings all its pages, so the
set is closed under prefixes and a request's hits are its leading pages up to the first miss.
Pages the branch's previous prompt already hashed are taken from its path, so only the pages
after them are hashed.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NO_PATH", "IdealCache"]

NO_PATH = np.zeros(0, dtype=np.uint64)
"""The path of an empty sequence (a branch that has sent nothing)."""


def _odd(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class IdealCache:
    """The cluster-wide set of produced pages and the page hashes of request paths.

    A *path* is the array of prefix hashes of a token sequence's full pages (uint64).
    """

    def __init__(self, page_size: int) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        rng = np.random.default_rng(0x1DEA1)
        self._weights = _odd(rng, page_size)
        # sum_k w_k (t_k + 1) = t @ w + sum(w): the offset costs one addition per batch.
        self._offset = np.array(self._weights.sum(dtype=np.uint64), dtype=np.uint64)
        self._positions = _odd(rng, 1 << 12)  # grown on demand, deterministically
        self._pages: set[int] = set()

    def __len__(self) -> int:
        return len(self._pages)

    def extend(self, path: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """The prefix hashes of the full pages of ``tokens`` chained after ``path``, whose
        sequence ended on a page boundary just before ``tokens``."""
        p = self.page_size
        n = tokens.size // p
        if n == 0:
            return NO_PATH
        pages = tokens[: n * p].reshape(n, p).astype(np.uint64) @ self._weights
        pages += self._offset
        end = path.size + n
        while end > self._positions.size:
            more = _odd(np.random.default_rng(self._positions.size), self._positions.size)
            self._positions = np.concatenate([self._positions, more])
        pages *= self._positions[path.size:end]
        out = np.cumsum(pages, dtype=np.uint64)
        if path.size:
            out += path[-1:]
        return out

    def admit(self, tokens: np.ndarray, base: np.ndarray, known: int) -> tuple[np.ndarray, int]:
        """A request's input path and ideal cached tokens; adds its pages to the set.

        ``base`` is the path of the branch's previous prompt; the first ``known`` tokens of
        ``tokens`` repeat that prompt and the part of its output the branch kept, which an
        earlier request produced.
        """
        p = self.page_size
        shared = min(known // p, base.size)
        new = self.extend(base[:shared], tokens[shared * p:])
        hashes = new.tolist()
        pages = self._pages
        hits = max(0, min(known // p - shared, len(hashes)))
        while hits < len(hashes) and hashes[hits] in pages:
            hits += 1
        pages.update(hashes)
        return np.concatenate([base[:shared], new]), (shared + hits) * p
