"""The ``hermes`` tool-call parser: whole texts, and the same texts streamed in pieces."""

import itertools
import json
import random

import pytest

from evinfra.api.tool_calls import TaggedCalls, read_hermes, read_qwen3_coder


def fresh() -> TaggedCalls:
    n = itertools.count()
    return TaggedCalls(read_hermes, lambda: f"call_{next(n)}")


def whole(text: str) -> tuple[str, list]:
    p = fresh()
    head, _ = p.feed(text)
    return head + p.end(), [(c.name, json.loads(c.arguments)) for c in p.calls]


def streamed(text: str, rng: random.Random) -> tuple[str, list]:
    p, out, calls = fresh(), [], []
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12))))
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        content, new = p.feed(text[a:b])
        out.append(content)
        calls += new
    out.append(p.end())
    assert calls == p.calls
    return "".join(out), [(c.name, json.loads(c.arguments)) for c in calls]


CALL = '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'
TEXTS = {
    "content then calls": ("I'll look.\n\n" + CALL + "\n" + CALL.replace("a.py", "b.py"),
                           ("I'll look.",
                            [("read", {"path": "a.py"}), ("read", {"path": "b.py"})])),
    "no call": ("plain answer  \n", ("plain answer  \n", [])),
    "a call only": (CALL + "\n", ("", [("read", {"path": "a.py"})])),
    "arguments as a string": ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
                              ("", [("f", {"x": 1})])),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', ("", [("now", {})])),
    "not json: kept as written": ("a <tool_call>{oops}</tool_call> b",
                                  ("a <tool_call>{oops}</tool_call> b", [])),
    "no name: kept": ('<tool_call>{"arguments": {}}</tool_call>',
                      ('<tool_call>{"arguments": {}}</tool_call>', [])),
    "unterminated: kept": ('x <tool_call>{"name": "f"', ('x <tool_call>{"name": "f"', [])),
    "a tag's start at the end: kept": ("see <tool", ("see <tool", [])),
    "a look-alike tag": ("<tools> are <tool_calls", ("<tools> are <tool_calls", [])),
    "content between calls": (CALL + " then " + CALL, (" then", [("read", {"path": "a.py"})] * 2)),
}


@pytest.mark.parametrize("name", TEXTS)
def test_whole_texts(name):
    text, expected = TEXTS[name]
    assert whole(text) == expected


@pytest.mark.parametrize("name", TEXTS)
def test_any_split_reads_the_same_as_the_whole_text(name):
    text, _ = TEXTS[name]
    rng = random.Random(name)
    for _ in range(50):
        assert streamed(text, rng) == whole(text)


def test_a_call_is_let_out_when_its_block_closes_and_ids_are_fresh():
    p = fresh()
    assert p.feed("Sure.\n<tool_") == ("Sure.", [])
    assert p.feed('call>{"name": "f", "arguments": {}}') == ("", [])
    content, calls = p.feed("</tool_call>")
    assert content == "" and [(c.id, c.name, c.arguments) for c in calls] == [("call_0", "f", "{}")]
    assert calls[0].wire(3) == {"index": 3, "id": "call_0", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}
    assert p.end() == ""


# -- qwen3_coder ------------------------------------------------------------------------------

SCHEMA = [{"type": "function", "function": {"name": "edit", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "ratio": {"type": "number"},
        "dry": {"type": "boolean"}, "opts": {"type": "object"},
        "tags": {"type": ["array", "null"]}, "text": {"type": "string"}}}}}]
EDIT = ("<tool_call>\n<function=edit>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
        "<parameter=line>\n42\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=dry>\nTrue\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n"
        "<parameter=tags>\nnull\n</parameter>\n<parameter=text>\n  two\nlines\n\n</parameter>\n"
        "</function>\n</tool_call>")
EDIT_ARGS = {"path": "src/a.py", "line": 42, "ratio": 0.5, "dry": True, "opts": {"a": [1]},
             "tags": None, "text": "  two\nlines\n"}
CODER = {
    "typed by the schema": ("Editing.\n" + EDIT, ("Editing.", [("edit", EDIT_ARGS)])),
    "not of its type: kept as text": (
        "<tool_call><function=edit><parameter=line>forty</parameter></function></tool_call>",
        ("", [("edit", {"line": "forty"})])),
    "an unknown tool's values are text": (
        "<tool_call><function=run><parameter=n>\n3\n</parameter></function></tool_call>",
        ("", [("run", {"n": "3"})])),
    "no parameters": ("<tool_call>\n<function=now>\n</function>\n</tool_call>",
                      ("", [("now", {})])),
    "hermes JSON is not this format": ('<tool_call>{"name": "f"}</tool_call>',
                                       ('<tool_call>{"name": "f"}</tool_call>', [])),
    "text between parameters: kept": (
        "<tool_call><function=f>hi<parameter=a>1</parameter></function></tool_call>",
        ("<tool_call><function=f>hi<parameter=a>1</parameter></function></tool_call>", [])),
}


def coder(text: str, rng: random.Random | None = None) -> tuple[str, list]:
    n = itertools.count()
    p = TaggedCalls(read_qwen3_coder, lambda: f"call_{next(n)}", SCHEMA)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 12)))) \
        if rng else []
    out = [p.feed(text[a:b])[0] for a, b in zip([0] + cuts, cuts + [len(text)])]
    out.append(p.end())
    return "".join(out), [(c.name, json.loads(c.arguments)) for c in p.calls]


@pytest.mark.parametrize("name", CODER)
def test_qwen3_coder_blocks_whole_and_split(name):
    text, expected = CODER[name]
    assert coder(text) == expected
    rng = random.Random(name)
    for _ in range(30):
        assert coder(text, rng) == expected
