"""The ``think`` reasoning parser: whole texts, and the same texts streamed in pieces."""

import random

import pytest

from evinfra.api.reasoning import ThinkSplit


def whole(text: str, forced: bool) -> tuple[str, str]:
    p = ThinkSplit(forced)
    r1, a1 = p.feed(text)
    r2, a2 = p.end()
    return r1 + r2, a1 + a2


def streamed(text: str, forced: bool, rng: random.Random) -> tuple[str, str]:
    p, rs, ans = ThinkSplit(forced), [], []
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        r, x = p.feed(text[a:b])
        rs.append(r)
        ans.append(x)
    r, x = p.end()
    return "".join(rs + [r]), "".join(ans + [x])


TEXTS = {  # (text, the prompt opened the block) -> (reasoning, answer)
    "opened in the output": (("<think>\nLet me see.\n</think>\n\nIt is 4.", False),
                             ("\nLet me see.\n", "It is 4.")),
    "after leading whitespace": (("\n<think>a</think>b", False), ("a", "b")),
    "opened by the prompt": (("Let me see.</think>\n4", True), ("Let me see.", "4")),
    "no block": (("Just 4.", False), ("", "Just 4.")),
    "no block, leading whitespace kept": (("  4 <think>", False), ("", "  4 <think>")),
    "unterminated: all reasoning": (("<think>still going </thi", False),
                                    ("still going </thi", "")),
    "forced and unterminated": (("hmm", True), ("hmm", "")),
    "too short to tell": (("<thi", False), ("", "<thi")),
    "empty block": (("<think></think>answer", False), ("", "answer")),
    "a second block is answer": (("<think>a</think>b<think>c</think>", False),
                                 ("a", "b<think>c</think>")),
}


@pytest.mark.parametrize("name", TEXTS)
def test_whole_texts(name):
    (text, forced), expected = TEXTS[name]
    assert whole(text, forced) == expected


@pytest.mark.parametrize("name", TEXTS)
def test_any_split_reads_the_same_as_the_whole_text(name):
    (text, forced), _ = TEXTS[name]
    rng = random.Random(name)
    for _ in range(50):
        assert streamed(text, forced, rng) == whole(text, forced)


def test_reasoning_streams_as_it_comes():
    p = ThinkSplit(False)
    assert p.feed("<think>ab") == ("ab", "")
    assert p.feed("c</th") == ("c", "")
    assert p.feed("ink>\n") == ("", "")
    assert p.feed("\nanswer") == ("", "answer")
