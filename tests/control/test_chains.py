"""ChainIndex: prompt keys, tips, and what a hint-less prompt extends."""

import numpy as np

from evinfra.control.chains import ChainIndex, Inferred

P = 4
rng = np.random.default_rng(3)


def toks(n: int) -> np.ndarray:
    return rng.integers(0, 50_000, size=n, dtype=np.uint32)


def test_keys_are_per_full_page_prefix_and_stable_as_the_weights_grow():
    index = ChainIndex(P)
    a = toks(10)
    short = index.keys(a)
    assert len(short) == 2  # two full pages; the partial one has no key
    long = index.keys(np.concatenate([a, toks(4_000)]))  # the weights grow here
    assert long[:2] == short and len(long) == 1_002
    assert ChainIndex(P).keys(a) == short  # the same in every index and run
    b = a.copy()
    b[5] += 1  # a token of the second page differs: its key and those after it differ
    assert index.keys(b)[0] == short[0] and index.keys(b)[1] != short[1]


def test_a_page_of_zero_tokens_moves_the_key():
    index = ChainIndex(P)
    a = toks(4)
    keys = index.keys(np.concatenate([a, np.zeros(P, np.uint32)]))
    assert keys[0] != keys[1]


def test_find_continues_forks_or_starts_from_the_longest_tip():
    index = ChainIndex(P)
    live = {"b"}
    first = toks(8)
    assert index.find(index.keys(first), live) == Inferred(None, None, False)
    index.record(index.keys(first)[-1], None)  # a branch of one: its tip stays
    second = np.concatenate([first, toks(6)])
    assert index.find(index.keys(second), live) == Inferred(None, None, True, 2)
    index.record(index.keys(second)[-1], "b")
    third = np.concatenate([second, toks(9)])
    assert index.find(index.keys(third), live) == Inferred("b", None, True, 3)
    index.record(index.keys(third)[-1], "b")
    assert "b" in index and len(index) == 1
    # The second turn again (an earlier tip of b): a fork of b.
    again = np.concatenate([second, toks(5)])
    assert index.find(index.keys(again), live) == Inferred(None, "b", True, 3)
    # A request identical to b's last one continues b.
    assert index.find(index.keys(third), live) == Inferred("b", None, True, 5)
    # Once b has ended, its tips start new branches.
    index.forget("b")
    assert index.find(index.keys(third), set()) == Inferred(None, None, True, 5)
    assert "b" not in index and len(index) == 0


def test_the_oldest_tips_go_first_but_a_live_branchs_latest_stays():
    index = ChainIndex(P, capacity=3)
    live = index.keys(toks(8))
    index.record(live[-1], "live")
    others = [index.keys(toks(8)) for _ in range(5)]
    for keys in others:
        index.record(keys[-1], None)
    assert index.find(live, {"live"}) == Inferred("live", None, True, 2)
    assert index.find(others[0], {"live"}) == Inferred(None, None, False)  # dropped
    assert index.find(others[-1], {"live"}) == Inferred(None, None, True, 2)
    assert len(index._tips) == 3


def test_the_tip_leaves_the_last_token_out():
    index = ChainIndex(P)
    keys = index.keys(toks(12))
    assert index.tip(keys, 12) == keys[1]  # pages 0-1; page 2 holds the last token
    assert index.tip(keys[:2], 9) == keys[1]
    assert index.tip(keys[:1], 4) is None
    # The next prompt's tokenizer merged the last token with the answer after it: still a
    # continuation.
    first = toks(8)
    index.record(index.tip(index.keys(first), 8), None)
    merged = np.concatenate([first[:7], toks(9)])
    assert index.find(index.keys(merged), set()).chained
