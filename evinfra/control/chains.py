"""Agent branches of requests that carry no branch hints, inferred from their prompts.

The paper's harness tags each request with its branch (4.3). Harnesses as they ship (Claude
Code over the Messages API, agents over chat completions) send none, so each of their requests
would be a branch of one and no count would protect the KV of an agent waiting for a tool.
Their contexts show the chain anyway: an agent's next prompt is its last prompt plus the
answer and the tool's result, so it *starts with* the last prompt. The index keeps, for each
hint-less request, a key of its prompt's full pages (its *tip*; the last token left out), and
a new hint-less request whose prompt has a tip among its own prefixes extends that request:

- the tip's branch, if the tip is still that branch's latest: the branch continues (E.1
  appends);
- a fork of that branch, if the branch has moved on since (a harness forking a context, or
  an earlier turn sent again);
- a new branch, if the tip was a branch of one (a chain's first request is kept as a branch
  of one, so a one-off request holds no count) or its branch has ended;
- a branch of one, with no tip (a first request, a sub-agent's fresh context): it ends
  with its request, and only its tip remains.

A sub-agent's end and a compaction (a fresh context that goes on from a branch's summary)
show where the branch's last answer turns up next (:mod:`evinfra.control.carryover`); the
end of an agent cannot be seen at all, so the service ends an inferred branch once it has
been idle for ``server.inferred_branch_idle_s``.

Keys are not the block hashes: finding the tip must not cost a SHA-256 pass over a context
whose branch is not known yet. A prompt's key at page ``i`` is ``Σ (token_t + 1) · w_t mod
2^64`` over its first ``i + 1`` pages, with fixed pseudo-random weights ``w_t``: one
vectorised pass. A collision (two different prefixes with one key) only misnames a branch:
the request's blocks are hashed from its tokens whatever branch it joins, and E.1 compares the
tokens with the branch's last path (a mismatch reads as a rewrite).

Pure and synchronous.
"""

from __future__ import annotations

from collections import OrderedDict
from operator import length_hint
from typing import Container, NamedTuple

import numpy as np

from evinfra.core.types import BranchId

__all__ = ["ChainIndex", "Inferred"]

_SEED = 0x6576696E  # fixed: the same prompt has the same keys in every run


class Inferred(NamedTuple):
    """What a hint-less request's prompt extends. ``continues``: a live branch whose latest
    tip it extends; ``fork_of``: a live branch it extends an earlier tip of; ``chained``: it
    extends some earlier hint-less request (False: no tip, a branch of one); ``pages``: the
    prompt's leading full pages that tip spans."""

    continues: BranchId | None
    fork_of: BranchId | None
    chained: bool
    pages: int = 0


_NONE = Inferred(None, None, False)


class ChainIndex:
    """Tips of hint-less requests, by key; the latest tip of each live inferred branch.

    At most ``capacity`` tips are kept, the least recently recorded going first, except the
    latest tip of a live branch (bounded by the live branches, which expire)."""

    def __init__(self, page_size: int, capacity: int = 1 << 16) -> None:
        self.page_size = page_size
        self.capacity = capacity
        self._w = np.zeros(0, np.uint64)
        self._tips: OrderedDict[int, BranchId | None] = OrderedDict()
        self._latest: dict[BranchId, int] = {}

    def __contains__(self, branch: object) -> bool:
        """``branch`` is a live inferred branch."""
        return branch in self._latest

    def __len__(self) -> int:
        """Live inferred branches."""
        return len(self._latest)

    def keys(self, tokens: np.ndarray) -> list[int]:
        """The key of each full page's prefix of ``tokens`` (uint32)."""
        p = self.page_size
        n = tokens.size // p * p
        if not n:
            return []
        if self._w.size < n:
            size = max(n, 2 * self._w.size)
            self._w = np.random.default_rng(_SEED).integers(
                0, 1 << 64, size=size, dtype=np.uint64, endpoint=False)
        x = tokens[:n].astype(np.uint64)
        x += 1  # a zero token would weigh nothing: a page of them would not move the key
        x *= self._w[:n]  # wraps mod 2^64, as the sums below
        return np.cumsum(x.reshape(-1, p).sum(axis=1, dtype=np.uint64), dtype=np.uint64).tolist()

    def tip(self, keys: list[int], size: int) -> int | None:
        """The tip of a prompt of ``size`` tokens with these keys: the key of its last full
        page before its last token (None: none). The last token is left out because the
        next prompt's tokenizer may merge it with the answer that follows (a generation
        prompt's newline, say)."""
        k = (size - 1) // self.page_size
        return keys[k - 1] if k else None

    def find(self, keys: list[int], live: Container[BranchId]) -> Inferred:
        """What a prompt with these keys extends: its longest prefix that is a tip (the
        prompt's own full length included: a request sent again continues its branch).
        ``live``: the branches that have not ended."""
        tips = self._tips
        back = reversed(keys)
        key = next(filter(tips.__contains__, back), None)
        if key is None:
            return _NONE
        # The keys the search has not reached are those before the tip's: a second scan
        # for its index would cost as much as the search (tens of µs for a long prompt).
        pages = length_hint(back) + 1
        branch = tips[key]
        if branch is None or branch not in live:
            return Inferred(None, None, True, pages)
        if self._latest.get(branch) == key:
            return Inferred(branch, None, True, pages)
        return Inferred(None, branch, True, pages)

    def record(self, key: int, branch: BranchId | None) -> None:
        """A hint-less request whose last key is ``key`` was submitted on ``branch`` (None: a
        branch of one): its prompt is the branch's latest tip from now on, so a second request
        extending the one before it meanwhile forks."""
        tips = self._tips
        tips.pop(key, None)
        tips[key] = branch
        if branch is not None:
            self._latest[branch] = key
        over = len(tips) - self.capacity
        for _ in range(over):
            old, b = tips.popitem(last=False)
            if b is not None and self._latest.get(b) == old:
                tips[old] = b  # a live branch's latest tip stays

    def forget(self, branch: BranchId) -> None:
        """``branch`` ended: its tips now start new branches."""
        self._latest.pop(branch, None)
