"""CarryIndex: an idle inferred branch's last answer, found again in another prompt."""

import numpy as np

from evinfra.control.carryover import M, W, Answer, Carried, CarryIndex

rng = np.random.default_rng(11)


def toks(n: int) -> np.ndarray:
    return rng.integers(0, 150_000, size=n, dtype=np.uint32)


def answer(tokens: np.ndarray, first_page: int = 1, chunk: int = 7) -> Answer:
    """An answer streamed in chunks, as the engines send it."""
    a = Answer(first_page)
    for i in range(0, tokens.size, chunk):
        a.add(tokens[i:i + chunk])
    return a


def test_the_edges_kept_while_streaming_are_the_answers():
    out = toks(500)
    a = answer(out)
    assert np.array_equal(a.head, out[:M + W]) and np.array_equal(a.tail, out[-(M + W):])
    short = answer(out[:10], chunk=3)
    assert np.array_equal(short.head, out[:10]) and np.array_equal(short.tail, out[:10])


def test_an_answer_is_found_by_either_edge_wherever_it_is_carried():
    index = CarryIndex()
    out = toks(400)
    index.answered("sub", answer(out, first_page=5))
    assert "sub" in index and len(index) == 1
    before = toks(300)
    # Whole, after other text; its first and last tokens re-tokenized differently.
    whole = np.concatenate([before, toks(3), out[3:-3], toks(3)])
    assert index.find(whole, 0, 5) == Carried(["sub"], [True])
    assert index.find(whole, 0, 6) == Carried(["sub"], [False])  # another first page
    # Only its end (a thinking model's answer: the thinking is not carried).
    assert index.find(np.concatenate([before, out[200:]]), 0, 5).branches == ["sub"]
    # Only its start (a harness cut the rest).
    assert index.find(np.concatenate([out[:200], before]), 0, 5).branches == ["sub"]
    # Neither edge: the middle alone is not recognised.
    assert index.find(np.concatenate([before, out[M + 1:-M - 1]]), 0, 5).branches == []
    # Only the part from ``start`` is scanned, and ``skip`` is left out.
    assert index.find(whole, 303 + M + 1, 5).branches == ["sub"]  # the tail window is later
    assert index.find(whole, whole.size - M - W + 1, 5).branches == []
    assert index.find(whole, 0, 5, skip=("sub",)).branches == []


def test_answers_are_listed_in_the_order_they_appear_and_replaced_or_forgotten():
    index = CarryIndex()
    a, b = toks(100), toks(100)
    index.answered("a", answer(a))
    index.answered("b", answer(b))
    both = np.concatenate([b, toks(50), a])
    assert index.find(both, 0, 1).branches == ["b", "a"]
    index.answered("a", answer(toks(100)))  # a answered again: its old answer is gone
    assert index.find(both, 0, 1).branches == ["b"]
    index.forget("b")
    assert index.find(both, 0, 1).branches == [] and "b" not in index
    index.forget("b")  # twice is fine
    # Too short to leave both edges out: no fingerprint.
    index.answered("c", answer(toks(M + W + M - 1)))
    assert "c" not in index


def test_fingerprints_read_the_tokens_in_order():
    index = CarryIndex()
    out = toks(200)
    index.answered("x", answer(out))
    swapped = out.copy()
    swapped[M], swapped[M + 1] = out[M + 1], out[M]
    swapped[-M - 1], swapped[-M - 2] = out[-M - 2], out[-M - 1]
    assert index.find(swapped, 0, 1).branches == []
    assert index.find(out, 0, 1).branches == ["x"]
