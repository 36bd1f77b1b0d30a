"""The output parsers on texts made of their own tags' pieces: any split of a text reads as the
whole text does, and a text without a call comes back as content unchanged."""

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from evinfra.api.reasoning import ThinkSplit
from evinfra.api.tool_calls import TaggedCalls, read_hermes, read_qwen3_coder

PIECES = ["<tool_call>", "</tool_call>", "<tool", "</tool_", "{", "}", '"name"', ":", '"f"',
          '"arguments"', "{}", "\n", " ", "a", "<think>", "</think>", "<function=f>",
          "</function>", "<parameter=x>", "</parameter>", "1", '"', ",", "<", ">", "</"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "properties": {"x": {"type": "integer"}}}}}]
texts = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)


def pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(8)))) \
        if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def calls(read, parts: list[str]) -> tuple[str, list]:
    n = itertools.count()
    p = TaggedCalls(read, lambda: f"call_{next(n)}", TOOLS)
    content = [p.feed(x)[0] for x in parts] + [p.end()]
    return "".join(content), [(c.name, c.arguments) for c in p.calls]


def think(forced: bool, parts: list[str]) -> tuple[str, str]:
    p = ThinkSplit(forced)
    read = [p.feed(x) for x in parts] + [p.end()]
    return "".join(r for r, _ in read), "".join(a for _, a in read)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(text=texts, seed=st.integers(0, 2**32))
def test_any_split_reads_as_the_whole_text(text, seed):
    parts = pieces(text, seed)
    for read in (read_hermes, read_qwen3_coder):
        whole = calls(read, [text])
        assert calls(read, parts) == whole
        if not whole[1]:
            assert whole[0] == text
    for forced in (False, True):
        assert think(forced, parts) == think(forced, [text])
