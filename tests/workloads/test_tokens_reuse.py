"""Token synthesis (stable across processes) and the ideal-reuse cache against a reference."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evinfra.core.hashing import block_hashes
from evinfra.workloads import IdealCache, TokenSpace, block_tokens, stable_seed, synth
from evinfra.workloads.reuse import NO_PATH


def test_synth_is_stable_across_processes():
    # Pinned values: a salted or platform-dependent hash would change them.
    assert stable_seed("cc", 7, "tool") == 2518884858219383825
    assert synth(("cc", 7), 6).tolist() == [31723, 8405, 20218, 24192, 14807, 26972]
    code = "from evinfra.workloads import synth; print(synth(('cc', 7), 6).tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "123"})
    assert out.stdout.strip() == "[31723, 8405, 20218, 24192, 14807, 26972]"


def test_synth_range_prefixes_and_keys():
    space = TokenSpace(5, 50)
    a = synth(("k", 1), 10_000, space)
    assert a.dtype == np.uint32 and a.min() >= 5 and a.max() < 50 and not a.flags.writeable
    assert len(np.unique(a)) == 45
    assert np.array_equal(synth(("k", 1), 100, space), a[:100])  # same key: a prefix
    b = synth(("k", 2), 10_000)
    assert np.mean(synth(("k", 1), 10_000) == b) < 0.01
    assert synth(("k",), 0).size == 0
    with pytest.raises(ValueError):
        TokenSpace(10, 10)


def test_block_tokens_share_exactly_the_equal_leading_blocks():
    a = block_tokens(1, [5, 6, 7], 16, 40)
    b = block_tokens(1, [5, 6, 8, 9], 16, 64)
    assert a.size == 40 and b.size == 64
    assert np.array_equal(a[:32], b[:32]) and np.mean(a[32:] == b[32:40]) < 0.5
    assert not np.array_equal(block_tokens(2, [5], 16, 16), a[:16])  # another namespace
    with pytest.raises(ValueError):
        block_tokens(1, [5], 16, 17)


def _reference(prompts: list[np.ndarray], page: int) -> list[int]:
    seen: set[int] = set()
    out = []
    for tokens in prompts:
        hashes = block_hashes(tokens, page)
        hits = 0
        while hits < len(hashes) and hashes[hits] in seen:
            hits += 1
        out.append(hits * page)
        seen.update(hashes)
    return out


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(0, 3)),
                min_size=1, max_size=30),
       st.sampled_from([1, 4, 8]))
def test_ideal_cache_matches_the_sha256_reference(steps, page):
    """Prompts that extend, share or diverge from earlier ones (as tokens in a tiny vocabulary,
    so that equal pages at different places and near misses happen)."""
    rng = np.random.default_rng(len(steps) * 7 + page)
    prompts: list[np.ndarray] = []
    for source, extra, vocab in steps:
        base = prompts[source % len(prompts)] if prompts and source else np.zeros(0, np.uint32)
        cut = int(rng.integers(0, base.size + 1))
        tail = rng.integers(0, vocab + 2, extra).astype(np.uint32)
        prompts.append(np.concatenate([base[:cut], tail]))
    cache = IdealCache(page)
    got = [cache.admit(p, NO_PATH, 0)[1] for p in prompts]
    assert got == _reference(prompts, page)


def test_ideal_cache_reuses_the_branch_path_and_credits_kept_output():
    cache = IdealCache(4)
    first = np.arange(10, dtype=np.uint32)
    path, hits = cache.admit(first, NO_PATH, 0)
    assert hits == 0 and path.size == 2
    # Next prompt: the first + its whole output but the last token (known) + new tokens.
    out = np.arange(100, 106, dtype=np.uint32)
    nxt = np.concatenate([first, out, [7, 7, 7]]).astype(np.uint32)
    path2, hits2 = cache.admit(nxt, path, first.size + out.size - 1)
    assert hits2 == 12 and path2.size == 4  # 15 known tokens: 3 full pages
    # The same tokens seen fresh (no path) hit the same pages through the set.
    assert cache.admit(nxt, NO_PATH, 0)[1] == 16
