import hashlib

import numpy as np
import pytest

from evinfra.core import hashing
from evinfra.core.hashing import PathHasher, block_hashes

# Captured from a real SGLang 0.5.23 server, page size 4 (issue 2).
P1, P2 = [5, 6, 7, 8], [9, 10, 11, 12]
H1, H2 = -873556230699706081, -8429985882354289250


def test_vectors_from_a_real_sglang_server() -> None:
    assert block_hashes(P1 + P2, 4) == [H1, H2]
    assert block_hashes(P1 + P2 + [13, 14, 178, 14], 4)[2] == -3748320092956984501
    assert block_hashes(P1 + P2 + [20, 21, 22, 350], 4)[2] == -6242108631941482323


def test_only_full_pages_are_hashed() -> None:
    assert block_hashes(P1 + P2 + [1, 2, 3], 4) == [H1, H2]
    assert block_hashes([1, 2, 3], 4) == []


def test_definition_sha256_chain_first_eight_bytes_big_endian_signed() -> None:
    d1 = hashlib.sha256(np.array(P1, "<u4").tobytes()).digest()
    d2 = hashlib.sha256(d1 + np.array(P2, "<u4").tobytes()).digest()
    assert block_hashes(P1 + P2, 4) == [int.from_bytes(d[:8], "big", signed=True) for d in (d1, d2)]


def test_native_chain_is_hashlibs_chain_after_any_prior() -> None:
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 2**32, size=16 * 9 + 5, dtype=np.uint32)
    for prior in (None, hashlib.sha256(b"x").digest()):
        digests, hashes = hashing.chain_pages(tokens, 16, prior)
        want, d = [], prior
        for i in range(9):
            d = hashlib.sha256((d or b"") + tokens[16 * i:16 * i + 16].tobytes()).digest()
            want.append(d)
        assert digests == b"".join(want)
        assert hashes == [int.from_bytes(d[:8], "big", signed=True) for d in want]
    # Control: the prior is part of every page's digest.
    assert hashing.chain_pages(tokens, 16, b"\0" * 32)[1][-1] != hashes[-1]
    with pytest.raises(ValueError):
        hashing.chain_pages(tokens, 16, b"short")
    with pytest.raises(ValueError):
        hashing.chain_pages(tokens, 0, None)


class _CountingSha:
    """Counts the pages the native loop hashes (one SHA-256 call each)."""

    calls = 0

    def __init__(self, native):
        self._native = native

    def chain_pages(self, tokens, page_size, prior):
        type(self).calls += tokens.size // page_size
        return self._native.chain_pages(tokens, page_size, prior)


def test_next_request_of_a_branch_hashes_only_its_new_pages(monkeypatch) -> None:
    h = PathHasher(4)
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, 50_000, size=4 * 1000, dtype=np.uint32)
    base = h.hash(ctx)
    monkeypatch.setattr(hashing, "_native", _CountingSha(hashing._native))
    _CountingSha.calls = 0
    nxt = np.concatenate([ctx, rng.integers(0, 50_000, size=4 * 3 + 2, dtype=np.uint32)])
    path = h.hash(nxt, base)
    assert _CountingSha.calls == 3
    assert path.shared == 1000
    assert path.hashes == block_hashes(nxt, 4)


def test_rewritten_context_reuses_only_the_common_prefix() -> None:
    h = PathHasher(4)
    base = h.hash(P1 + P2 + [13, 14, 178, 14])
    path = h.hash(P1 + P2 + [20, 21, 22, 350], base)
    assert path.shared == 2
    assert path.hashes == [H1, H2, -6242108631941482323]
    # A change inside the first page shares nothing.
    assert h.hash([5, 6, 7, 9] + P2, base).shared == 0


def test_a_path_keeps_every_page_digest_through_extensions_and_rewrites() -> None:
    h = PathHasher(4)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, size=4 * 40, dtype=np.uint32)
    path = h.hash(tokens[:4 * 10])
    for cut, grow in ((10, 7), (17, 0), (12, 9), (0, 5)):  # extend, same, rewrite, from scratch
        tokens[4 * cut:] = rng.integers(0, 50_000, size=tokens.size - 4 * cut, dtype=np.uint32)
        ctx = tokens[:4 * (max(cut, len(path)) + grow)].copy()
        path = h.hash(ctx, path)
        prior = b""
        for i in range(len(path)):
            prior = hashlib.sha256(prior + ctx[4 * i:4 * i + 4].tobytes()).digest()
            assert path.digest(i) == prior
        assert path.hashes == block_hashes(ctx, 4)


def test_a_new_branch_hashes_only_past_a_prompt_seen_before(monkeypatch) -> None:
    h = PathHasher(4, recent=2)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 50_000, size=4 * 100, dtype=np.uint32)
    parent = h.hash(rng.integers(0, 50_000, size=4 * 100, dtype=np.uint32))
    first = h.start(np.concatenate([prompt, rng.integers(0, 50_000, size=40, dtype=np.uint32)]))
    monkeypatch.setattr(hashing, "_native", _CountingSha(hashing._native))
    _CountingSha.calls = 0
    task = np.concatenate([prompt, rng.integers(0, 50_000, size=4 * 7, dtype=np.uint32)])
    path = h.start(task, parent)  # a parent that shares no page: the prompt serves
    assert _CountingSha.calls == 7 and path.shared == 100
    assert path.hashes == block_hashes(task, 4) and path.hashes[:100] == first.hashes[:100]
    # A branch's next path is hashed against its last one only: a rewrite from the first
    # page keeps nothing of it, whatever was hashed before.
    assert h.hash(task, parent).shared == 0
    # Only the last two first pages are remembered.
    for _ in range(2):
        h.hash(rng.integers(0, 50_000, size=8, dtype=np.uint32))
    _CountingSha.calls = 0
    assert h.start(task).hashes == path.hashes and _CountingSha.calls == 107


def test_token_ids_must_fit_uint32() -> None:
    with pytest.raises(ValueError):
        block_hashes([-1, 2, 3, 4], 4)
    with pytest.raises(ValueError):
        block_hashes([2**32, 2, 3, 4], 4)


def test_held_prefix_searches_a_prefix_closed_set():
    from evinfra.core.hashing import held_prefix

    path = list(range(10))
    for k in range(11):
        held = set(path[:k]) | {99}
        assert held_prefix(path, held) == k
        assert held_prefix(path, held, 4) == min(k, 4)
    assert held_prefix([], {1}) == 0
