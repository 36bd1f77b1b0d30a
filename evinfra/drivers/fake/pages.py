"""Hashes of the pages a finished request writes after its input (its output is the prefix of
the branch's next request, so these must be SGLang's page hashes, chained from the input).

Chaining needs the SHA-256 *digest* of the input's last full page, and orders carry only the
int64 hashes. Rehashing the whole input per request would cost ~1,600 SHA-256 calls for a 100K
context, so the cluster keeps a bounded memo ``hash -> digest`` of the pages it hashed: a
branch's next request finds its previous output's last page in its path and hashes only the
pages after it. Only a branch's first request (or one whose memo entry aged out) pays the
full input.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from evinfra.core.hashing import as_tokens, chain_pages
from evinfra.core.types import BlockHash

__all__ = ["OutputPages"]

_MEMO_ENTRIES = 1 << 16
"""Two entries per finished request: a few thousand requests in flight or waiting for their
branch's next turn fit many times over, in about 10 MB."""


def _digest(digests: bytes, page: int) -> bytes:
    return digests[32 * page:32 * page + 32]


class OutputPages:
    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self._memo: OrderedDict[BlockHash, bytes] = OrderedDict()

    def hashes(self, path: Sequence[BlockHash], tokens: np.ndarray) -> list[BlockHash]:
        """Hashes of the full pages of ``tokens`` after ``path`` (the input's full pages).

        ``tokens`` is the input followed by the output whose KV exists. Cost: O(new pages),
        plus the input pages after the deepest memoised one."""
        page, memo = self.page, self._memo
        k_in, total = len(path), tokens.size // self.page
        if total <= k_in:
            return []
        start, prior = 0, None
        for i in range(k_in - 1, -1, -1):
            d = memo.get(path[i])
            if d is not None:
                start, prior = i + 1, d
                memo.move_to_end(path[i])
                break
        digests, hashes = chain_pages(as_tokens(tokens[start * page:total * page]), page, prior)
        if k_in:
            self._remember(path[k_in - 1], _digest(digests, k_in - 1 - start)
                           if k_in > start else prior)
        self._remember(hashes[-1], _digest(digests, total - 1 - start))
        return hashes[k_in - start:]

    def _remember(self, block: BlockHash, digest: bytes | None) -> None:
        if digest is None:
            return
        self._memo[block] = digest
        self._memo.move_to_end(block)
        if len(self._memo) > _MEMO_ENTRIES:
            self._memo.popitem(last=False)

