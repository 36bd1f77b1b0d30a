"""Tool calls read back out of the generated text.

The front end applies the chat template, so it also reads the model's tool calls back out of
its output, as vLLM's and SGLang's OpenAI servers do with a parser named per model
(``model.tool_call_parser``). Both formats so far write each call in a
``<tool_call>...</tool_call>`` block:

* ``hermes``: ``{"name": ..., "arguments": {...}}`` in the block, the format the chat templates
  of Qwen2.5, Qwen3 and Hermes models teach (vLLM's ``hermes``, SGLang's ``qwen25``);
* ``qwen3_coder``: ``<function=NAME><parameter=P>value</parameter>...</function>`` in the
  block (Qwen3-Coder); a value is text, read as the JSON type the tool's schema gives the
  parameter (SGLang's ``qwen3_coder`` does the same).

The parser is a stream (text deltas in; content and whole calls out) and a whole response is
the same stream fed at once, so both read a text the same way. A block the format cannot read
stays in the content as written, and so does an unterminated one. With calls, the whitespace
that separates content from a block (or ends the text) is not content.
"""

from __future__ import annotations

import json
import re
from typing import Callable

import msgspec

from evinfra.api.markers import partial_marker

__all__ = ["PARSERS", "TaggedCalls", "ToolCall", "read_hermes", "read_qwen3_coder"]

Reader = Callable[[str, dict[str, dict]], "tuple[str, dict] | None"]
"""A format: a block's body and the request's tools by name -> the call (its function's name
and arguments), or None when the body is not a call in this format."""


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str
    """A JSON object, as OpenAI's ``function.arguments``."""

    def wire(self, index: int | None = None) -> dict:
        """The call as OpenAI writes it (``index`` in a streamed delta)."""
        out: dict = {"id": self.id, "type": "function",
                     "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class TaggedCalls:
    """The stream of a format that writes each call in a ``<tool_call>`` block; ``read``
    (one of :data:`PARSERS`) reads a block's body."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, read: Reader, new_id: Callable[[], str],
                 tools: list[dict] | None = None, parallel: bool = True) -> None:
        """``tools``: the request's, as the chat template got them. Not ``parallel``
        (OpenAI's ``parallel_tool_calls: false``): the first call only; the blocks after it
        are dropped."""
        self._read = read
        self._new_id = new_id
        self._parallel = parallel
        self._tools = {t["function"]["name"]: t["function"] for t in tools or ()}
        self._buf = ""
        """Outside a block: what may begin a start tag (held until the next delta)."""
        self._inside = False
        self._body: list[str] = []
        """Inside a block: its text so far, in pieces (a call that writes a file may be long:
        each delta is searched for the end tag together with ``_tail`` only)."""
        self._tail = ""
        self._held = ""
        """Trailing whitespace of the content so far: content if more content follows."""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The content this delta lets out, and the calls it completes."""
        out: list[str] = []
        calls: list[ToolCall] = []
        text = delta
        while text:
            if not self._inside:
                buf, self._buf = self._buf + text, ""
                i = buf.find(self.START)
                if i < 0:
                    k = partial_marker(buf, self.START)
                    self._content(buf[:len(buf) - k], out)
                    self._buf = buf[len(buf) - k:]
                    break
                self._content(buf[:i], out)
                text, self._inside = buf[i + len(self.START):], True
                continue
            window = self._tail + text
            j = window.find(self.END)
            if j < 0:
                self._body.append(text)
                self._tail = window[-(len(self.END) - 1):]
                break
            whole = "".join(self._body) + text
            cut = len(whole) - len(window) + j
            body, text = whole[:cut], whole[cut + len(self.END):]
            self._inside, self._body, self._tail = False, [], ""
            call = self._parse(body)
            if call is None:
                self._content(self.START + body + self.END, out)
            else:
                self._held = ""
                if self._parallel or not (self.calls or calls):
                    calls.append(call)
        self.calls += calls
        return "".join(out), calls

    def end(self) -> str:
        """The content left when the text ends."""
        out: list[str] = []
        if self._inside:
            self._content(self.START + "".join(self._body), out)
        else:
            self._content(self._buf, out)
        self._buf, self._inside, self._body, self._tail = "", False, [], ""
        if not self.calls:
            out.append(self._held)
        self._held = ""
        return "".join(out)

    def _content(self, text: str, out: list[str]) -> None:
        text = self._held + text
        kept = text.rstrip()
        if kept:
            out.append(kept)
        self._held = text[len(kept):]

    def _parse(self, body: str) -> ToolCall | None:
        read = self._read(body, self._tools)
        if read is None:
            return None
        name, args = read
        return ToolCall(self._new_id(), name, json.dumps(args, ensure_ascii=False))


def read_hermes(body: str, tools: dict[str, dict]) -> tuple[str, dict] | None:
    """``{"name": ..., "arguments": {...}}`` (the tools are not needed)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def read_qwen3_coder(body: str, tools: dict[str, dict]) -> tuple[str, dict] | None:
    """``<function=NAME><parameter=P>value</parameter>...</function>``, each value read as the
    type ``tools`` gives its parameter."""
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    params = _PARAMETER.findall(inner)
    if _PARAMETER.sub("", inner).strip():
        return None  # text outside the parameters: not this format
    props = ((tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
    return name, {p.strip(): _typed(_unwrap(v), props.get(p.strip())) for p, v in params}


def _unwrap(value: str) -> str:
    """The value between the newline after ``<parameter=P>`` and the one before its end."""
    if value.startswith("\n"):
        value = value[1:]
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: object) -> object:
    """``value`` as the JSON type ``schema`` gives it; as written when it is a string, has no
    schema, or does not read as its type."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]
        kind = next((k for k in kind if k != "null"), None)
    if kind in (None, "string"):
        return value
    text = value.strip()
    if text == "null":
        return None
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            return int(text) if re.fullmatch(r"-?\d+", text) else float(text)
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            return json.loads(text)
    except ValueError:
        pass
    return value


PARSERS: dict[str, Reader] = {"hermes": read_hermes, "qwen3_coder": read_qwen3_coder}
"""``model.tool_call_parser`` names: a response's :class:`TaggedCalls` reads with one."""
