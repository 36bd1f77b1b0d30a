"""Deterministic token content: the same key always gives the same tokens, on any machine.

Workloads need token *ids*, not text: what matters for serving is which prompts share which
prefixes. Every piece of synthesized content (a system prompt variant, a tool result, a trace
block) is named by a key, a tuple of ints and strings such as ``("cc", 7, "0.1", 12, "tool")``.
:func:`stable_seed` turns the key into a 64-bit seed with BLAKE2b over its msgpack bytes
(Python's ``hash`` is salted per process, so it would make runs irreproducible), and
:func:`synth` expands the seed into ``n`` ids with a vectorised counter hash: token ``i`` is a
mix of ``seed + i * golden``. Equal keys give equal tokens, so prefix sharing is exact where
the workload says so (shared system-prompt variants, forks) and absent elsewhere.

Ids lie in ``[TokenSpace.low, TokenSpace.high)``. The default ``[1000, 32000)`` is inside the
regular vocabulary of every current model (special tokens sit above 100K in Llama 3 and Qwen,
below 1000 in older vocabularies), so the same streams can be replayed against a real server.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import msgspec
import numpy as np

__all__ = ["EMPTY", "TokenSpace", "block_tokens", "stable_seed", "synth"]

EMPTY = np.zeros(0, dtype=np.uint32)
EMPTY.setflags(write=False)



def _u64(value: int) -> np.ndarray:
    """A 0-d uint64 array: numpy combines it with arrays ~2x faster than a scalar."""
    return np.array(value, dtype=np.uint64)


_GOLDEN = _u64(0x9E3779B97F4A7C15)
_M1 = _u64(0xBF58476D1CE4E5B9)
_S29, _S32 = _u64(29), _u64(32)


class TokenSpace(msgspec.Struct, frozen=True):
    """The id range synthesized tokens are drawn from, ``[low, high)``."""

    low: int = 1000
    high: int = 32000

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high <= 2**32:
            raise ValueError(f"bad token space [{self.low}, {self.high})")


DEFAULT_SPACE = TokenSpace()


def stable_seed(*key: int | str) -> int:
    """A 64-bit seed from ``key``, the same in every process (BLAKE2b of its msgpack bytes)."""
    digest = hashlib.blake2b(msgspec.msgpack.encode(key), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _expand(x: np.ndarray, space: TokenSpace) -> np.ndarray:
    """Token ids from distinct uint64 counters ``x`` (consumed): one xorshift-multiply round
    (half of splitmix64's finalizer), then multiply-shift of the high 32 bits onto the space.
    In place, since numpy's per-operation cost dominates at prompt sizes."""
    x ^= x >> _S29
    x *= _M1
    x >>= _S32
    x *= _u64(space.high - space.low)
    x >>= _S32
    out = x.astype(np.uint32)
    out += np.array(space.low, dtype=np.uint32)
    out.setflags(write=False)
    return out


def synth(key: Sequence[int | str], n: int, space: TokenSpace = DEFAULT_SPACE) -> np.ndarray:
    """``n`` token ids determined by ``key`` alone (a read-only uint32 array)."""
    if n <= 0:
        return EMPTY
    x = np.arange(n, dtype=np.uint64)
    x *= _GOLDEN
    x += _u64(stable_seed(*key))
    return _expand(x, space)


def block_tokens(
    namespace: int, hash_ids: Sequence[int] | np.ndarray, block_size: int, length: int,
    space: TokenSpace = DEFAULT_SPACE,
) -> np.ndarray:
    """The tokens of a trace prompt given as block ids (Mooncake ``hash_ids``).

    Block id ``h`` always expands to the same ``block_size`` tokens (within ``namespace``), so
    two prompts with equal leading ids share exactly those blocks; the prompt is cut to
    ``length`` tokens, which leaves its last block partial as the trace's ``input_length`` says.
    """
    ids = np.asarray(hash_ids, dtype=np.uint64)
    if length > ids.size * block_size:
        raise ValueError(f"length {length} exceeds {ids.size} blocks of {block_size}")
    # Counters: the block's id spread far apart (times 2**32) plus the position in the block,
    # offset by the namespace; distinct for distinct (id, position) below 2**32 tokens a block.
    x = (ids * _u64(2**32) + _u64(namespace))[:, None] + np.arange(
        block_size, dtype=np.uint64)[None, :]
    x = x.ravel()[:length].copy()
    x *= _GOLDEN
    return _expand(x, space)
