"""Where an inferred branch's last answer turns up next: how a hint-less agent's sub-agents
end and its compactions show.

:mod:`evinfra.control.chains` sees a branch go on: its next prompt starts with its last one.
A harness carries an answer forward two other ways, and neither extends an earlier prompt:

- a parent's next prompt takes in a sub-agent's report (Claude Code's Task tool result): the
  sub-agent is over, and its counts go (E.2 line 13) rather than idle out;
- a compacted context starts over from the branch's system prompt, followed by the summary
  its last request wrote: the branch is rewritten (E.1 bumps its version and trims its counts
  to the system prompt), rather than left holding the counts of the history it replaced
  while a branch of one starts beside it.

So each idle inferred branch leaves two fingerprints of its last answer: ``W`` tokens from
near its start and near its end, ``M`` tokens in (the edges are where a harness cuts, wraps
or re-tokenizes the text: a summary's tags, a report's framing). A hint-less prompt's new
part, what its chain tip does not cover, is scanned for them: every ``W``-token window's
fingerprint in one vectorised pass. Only idle branches are held (a request on a branch takes
its fingerprints back), so a branch whose request is in flight is never ended or rewritten.

A fingerprint is a polynomial hash mod 2^64 of the window's tokens: two windows collide with
probability about 2^-64, and a collision, like a harness quoting another agent's answer
verbatim, only ends or rewrites a branch early: the branch's next prompt then starts a new
one, and its blocks lose their counts sooner (no output changes).

Pure and synchronous.
"""

from __future__ import annotations

from typing import Container, NamedTuple

import numpy as np

from evinfra.core.types import BranchId

__all__ = ["Answer", "CarryIndex", "Carried"]

W = 32
"""Tokens in a fingerprinted window."""
M = 8
"""Tokens left out at either edge of an answer."""
_SPAN = M + W
_BASE = 0x9E3779B97F4A7C15  # odd: invertible mod 2^64, so windows can be read off prefix sums
_INV = pow(_BASE, -1, 1 << 64)
_LOW = np.uint64(0xFFFF)


class Answer:
    """An answer's edges, kept as it streams (its first and last ``M + W`` tokens), and the
    key of its prompt's first page (a rewrite must start with the same page)."""

    __slots__ = ("first_page", "head", "tail", "size")

    def __init__(self, first_page: int) -> None:
        self.first_page = first_page
        self.head = self.tail = np.zeros(0, np.uint32)
        self.size = 0

    def add(self, tokens: np.ndarray) -> None:
        self.size += tokens.size
        if self.head.size < _SPAN:
            self.head = np.concatenate([self.head, tokens[:_SPAN - self.head.size]])
        self.tail = np.concatenate([self.tail, tokens[-_SPAN:]])[-_SPAN:]


class Carried(NamedTuple):
    """Idle inferred branches whose last answer a prompt's new part holds, in the order the
    answers appear, and whether the prompt starts with the same page as each one's did."""

    branches: list[BranchId]
    same_start: list[bool]


class CarryIndex:
    """Fingerprints of the last answer of each idle inferred branch."""

    def __init__(self) -> None:
        self._by_print: dict[int, BranchId] = {}
        # How many held fingerprints have each low 16 bits, and whether any: a prompt's
        # windows are checked against the latter before the dict (kept here, not rebuilt
        # for every prompt; a byte per entry keeps the gather in cache).
        self._low = np.zeros(1 << 16, np.int32)
        self._any = np.zeros(1 << 16, bool)
        self._of: dict[BranchId, tuple[list[int], int]] = {}
        self._pow = np.ones(1, np.uint64)
        self._inv = np.ones(1, np.uint64)

    def __contains__(self, branch: object) -> bool:
        return branch in self._of

    def __len__(self) -> int:
        return len(self._of)

    def answered(self, branch: BranchId, answer: Answer) -> None:
        """``branch``'s request is done and the branch idle: its answer may turn up next.
        An answer too short to leave both edges out leaves no fingerprint."""
        self.forget(branch)
        if answer.size < W + 2 * M:
            return
        prints = [int(self._windows(answer.head[M:])[0]),
                  int(self._windows(answer.tail[:W])[0])]
        self._of[branch] = (prints, answer.first_page)
        for p in prints:
            if p not in self._by_print:
                self._count_low(p, 1)
            self._by_print[p] = branch

    def forget(self, branch: BranchId) -> None:
        """``branch`` has a request in flight again, or ended."""
        entry = self._of.pop(branch, None)
        if entry is not None:
            for p in entry[0]:
                if self._by_print.get(p) == branch:
                    del self._by_print[p]
                    self._count_low(p, -1)

    def find(self, tokens: np.ndarray, start: int, first_page: int,
             skip: Container[BranchId] = ()) -> Carried:
        """The held answers in ``tokens[start:]`` (uint32), but those of ``skip``."""
        out = Carried([], [])
        if not self._by_print or tokens.size - start < W:
            return out
        h = self._windows(tokens[start:])
        # The windows whose low 16 bits some fingerprint has, then the dict: one pass over a
        # long fresh prompt (np.isin sorts it, ten times slower with hundreds of branches).
        for i in self._any[h & _LOW].nonzero()[0].tolist():
            branch = self._by_print.get(int(h[i]))
            if branch is not None and branch not in out.branches and branch not in skip:
                out.branches.append(branch)
                out.same_start.append(self._of[branch][1] == first_page)
        return out

    def _count_low(self, p: int, d: int) -> None:
        low = p & 0xFFFF
        self._low[low] += d
        self._any[low] = self._low[low] > 0

    def _windows(self, tokens: np.ndarray) -> np.ndarray:
        """The fingerprint of each ``W``-token window of ``tokens``: ``Σ_j (t_{i+j} + 1) ·
        B^j``, read off prefix sums of ``(t_k + 1) · B^k`` and scaled back by ``B^-i``."""
        n = tokens.size
        if n < W:
            return np.zeros(0, np.uint64)
        if self._pow.size < n:
            size = max(n, 2 * self._pow.size)
            self._pow = _powers(_BASE, size)
            self._inv = _powers(_INV, size)
        x = tokens.astype(np.uint64)
        x += np.uint64(1)  # a zero token would weigh nothing
        x *= self._pow[:n]
        s = np.zeros(n + 1, np.uint64)
        np.cumsum(x, out=s[1:])
        return (s[W:] - s[:-W]) * self._inv[:n - W + 1]


def _powers(base: int, n: int) -> np.ndarray:
    """``base^k mod 2^64`` for ``k < n``."""
    out = np.full(n, base, np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)
