"""Page-chained block hashes, byte-compatible with SGLang 0.5.23's KV events.

For page ``i`` of a token sequence (``page_size`` tokens, full pages only)::

    digest_i = SHA-256(digest_{i-1} || tokens of page i as uint32 little-endian)

with no prefix for the first page. The hash an event carries is the first 8 bytes of
``digest_i`` read big-endian as a signed int64 (SGLang ``mem_cache/utils.py``:
``get_hash_str`` and ``hash_str_to_int64``).

A branch's next request usually extends the previous context, so :class:`PathHasher` keeps
the previous tokens and digests and hashes only the pages after the common prefix: the cost
is one ``memcmp``-speed comparison plus O(new pages) SHA-256 calls, not O(context) hashing.

Because a hash names its block and the whole prefix before it, a cache that evicts leaves
first holds a prefix-closed set of hashes: :func:`held_prefix` finds how much of a path it
holds by binary search.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container, Sequence

import numpy as np

from evinfra.core.types import BlockHash
from evinfra.native import _native

__all__ = ["HashedPath", "PathHasher", "as_tokens", "block_hashes", "chain_pages", "held_prefix"]

_U32_LE = np.dtype("<u4")
_HASH_WORDS = np.dtype(">i8")  # a digest read as big-endian int64 words; the first is the hash
_DIGEST = 32  # bytes of a SHA-256 digest


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array (the hashing byte layout)."""
    arr = np.asarray(tokens)
    if arr.dtype != _U32_LE:
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError("token ids must fit in uint32")
        arr = arr.astype(_U32_LE)
    return np.ascontiguousarray(arr)


def chain_pages(tokens: np.ndarray, page_size: int, prior: bytes | None = None
                ) -> tuple[bytes, list[BlockHash]]:
    """The digests (32 bytes per page, concatenated) and event hashes of the full pages of
    ``tokens`` (from :func:`as_tokens`), chained after ``prior`` (None: the first page of a
    sequence). One native loop over the pages, SHA-256 from OpenSSL's libcrypto (as
    ``hashlib``'s)."""
    return _native.chain_pages(tokens, page_size, prior)


def _hash_array(digests: bytes) -> np.ndarray:
    """The event hashes of concatenated digests as a native int64 array."""
    return np.frombuffer(digests, _HASH_WORDS)[:: _DIGEST // 8].astype(np.int64)


def block_hashes(
    tokens: Sequence[int] | np.ndarray, page_size: int, prior_digest: bytes | None = None
) -> list[BlockHash]:
    """Event hashes of the full pages of ``tokens``, chained after ``prior_digest``."""
    return chain_pages(as_tokens(tokens), page_size, prior_digest)[1]


def held_prefix(path: Sequence[BlockHash], held: Container[BlockHash],
                limit: int | None = None) -> int:
    """Leading blocks of ``path[:limit]`` in ``held``, a prefix-closed set of blocks (each
    with its parent: a cache that evicts leaves first), by binary search."""
    n = len(path) if limit is None else min(limit, len(path))
    if n == 0 or path[0] not in held:
        return 0
    if path[n - 1] in held:
        return n
    lo, hi = 1, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if path[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


class HashedPath:
    """The full-page path of one token sequence: its tokens, SHA-256 digests and event hashes.

    Immutable once built; a branch keeps the last one to hash its next request incrementally.
    The digests are one ``bytes`` (32 per page): the next path copies the shared ones as
    one memcpy, where a list would cost a reference count write per page.
    """

    __slots__ = ("array", "digests", "hashes", "page_size", "shared", "tokens")

    def __init__(self, tokens: np.ndarray, digests: bytes, hashes: list[BlockHash],
                 page_size: int, shared: int = 0, array: np.ndarray | None = None) -> None:
        self.tokens = tokens
        self.digests = digests
        self.hashes = hashes
        self.page_size = page_size
        # Leading pages taken over from the base path this one was hashed against.
        self.shared = shared
        # The hashes as int64, which the native core reads without converting each one (a
        # branch's path is matched against the directory at every request).
        self.array = _hash_array(digests) if array is None else array

    def __len__(self) -> int:
        return len(self.hashes)

    def digest(self, page: int) -> bytes:
        """The SHA-256 digest of page ``page`` (chained over the pages before it)."""
        return self.digests[page * _DIGEST : (page + 1) * _DIGEST]

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


class PathHasher:
    """Hashes request inputs into block paths, reusing a base path's digests where it can.

    A new branch whose parent shares no page with it (a new agent, a sub-agent's fresh
    context) is hashed against the last path hashed with the same first page, if any: agents
    of one harness start with the same system prompt and tools (8-20 K tokens for a coding
    agent), so a new agent pays SHA-256 only past them. The paths of the last ``recent`` distinct first pages are remembered.
    """

    def __init__(self, page_size: int, recent: int = 16) -> None:
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.recent = recent
        self._by_first: OrderedDict[bytes, HashedPath] = OrderedDict()

    def common_pages(self, tokens: np.ndarray, base: HashedPath) -> int:
        """Number of leading full pages ``tokens`` shares with ``base`` (vectorised compare)."""
        p = self.page_size
        k = min(tokens.size // p, len(base)) * p
        if k == 0:
            return 0
        a, b = tokens[:k], base.tokens[:k]
        if (a == b).all():  # np.array_equal, without its checks (same shape here)
            return k // p
        first = int(np.flatnonzero(a != b)[0])
        return first // p

    def hash(self, tokens: Sequence[int] | np.ndarray, base: HashedPath | None = None) -> HashedPath:
        """The path of ``tokens``; pages shared with ``base`` reuse its digests (``shared``
        counts them: a branch's next path tells how much of the last one it keeps)."""
        return self._path(as_tokens(tokens), base, False)

    def start(self, tokens: Sequence[int] | np.ndarray, parent: HashedPath | None = None
              ) -> HashedPath:
        """The first path of a new branch: hashed against ``parent``'s path, or, if that
        shares no page, against the last path hashed with the same first page."""
        return self._path(as_tokens(tokens), parent, True)

    def _path(self, arr: np.ndarray, base: HashedPath | None, guess: bool) -> HashedPath:
        n = arr.size // self.page_size
        keep = self.common_pages(arr, base) if base is not None else 0
        if base is not None and keep == n and keep == len(base):
            return HashedPath(arr, base.digests, base.hashes, self.page_size, keep, base.array)
        first = arr[: self.page_size].tobytes() if n else b""
        if guess and not keep and n:
            base = self._by_first.get(first)
            keep = self.common_pages(arr, base) if base is not None else 0
        path = self._extend(arr, n, base if keep else None, keep)
        if n:
            self._by_first[first] = path
            self._by_first.move_to_end(first)
            if len(self._by_first) > self.recent:
                self._by_first.popitem(last=False)
        return path

    def _extend(self, arr: np.ndarray, n: int, base: HashedPath | None, keep: int
                ) -> HashedPath:
        """The path of ``arr`` (``n`` full pages) whose first ``keep`` pages are ``base``'s
        (None: ``keep`` is 0)."""
        prior = base.digest(keep - 1) if base is not None else None
        new, new_hashes = chain_pages(arr[keep * self.page_size : n * self.page_size],
                                      self.page_size, prior)
        if base is not None:
            # The shared part is copied once: a memoryview slice copies nothing, and one
            # list slice writes each page's reference count once.
            digests = b"".join((memoryview(base.digests)[: keep * _DIGEST], new))
            hashes = base.hashes[:keep]
            hashes += new_hashes
            array = np.concatenate((base.array[:keep], _hash_array(new)))
        else:
            digests, hashes, array = new, new_hashes, _hash_array(new)
        return HashedPath(arr, digests, hashes, self.page_size, keep, array)
