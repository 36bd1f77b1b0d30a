"""Tool calls read back out of the generated text.

The front end applies the chat template, so it also reads the model's tool calls back out of
its output, as vLLM's and SGLang's OpenAI servers do with a parser named per model
(``model.tool_call_parser``). One format so far:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, the format
  the chat templates of Qwen2.5, Qwen3 and Hermes models teach (vLLM's ``hermes``, SGLang's
  ``qwen25``).

The parser is a stream (text deltas in; content and whole calls out) and a whole response is
the same stream fed at once, so both read a text the same way. A block that is not a JSON
object with a string ``name`` stays in the content as written, and so does an unterminated
one. With calls, the whitespace that separates content from a block (or ends the text) is
not content.
"""

from __future__ import annotations

import json
from typing import Callable

import msgspec

from evinfra.api.tags import partial_tag

__all__ = ["PARSERS", "HermesCalls", "ToolCall"]

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


class HermesCalls:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._buf = ""
        """Text not yet decided: a block's body so far, or what may begin a start tag."""
        self._inside = False
        self._held = ""
        """Trailing whitespace of the content so far: content if more content follows."""
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The content this delta lets out, and the calls it completes."""
        out: list[str] = []
        calls: list[ToolCall] = []
        buf = self._buf + delta
        while True:
            if not self._inside:
                i = buf.find(self.START)
                if i < 0:
                    k = partial_tag(buf, self.START)
                    self._content(buf[:len(buf) - k], out)
                    buf = buf[len(buf) - k:]
                    break
                self._content(buf[:i], out)
                buf, self._inside = buf[i + len(self.START):], True
            else:
                j = buf.find(self.END)
                if j < 0:
                    break
                body, buf, self._inside = buf[:j], buf[j + len(self.END):], False
                call = self._parse(body)
                if call is None:
                    self._content(self.START + body + self.END, out)
                else:
                    self._held = ""
                    calls.append(call)
        self._buf = buf
        self.calls += calls
        return "".join(out), calls

    def end(self) -> str:
        """The content left when the text ends."""
        out: list[str] = []
        self._content(self.START + self._buf if self._inside else self._buf, out)
        self._buf, self._inside = "", False
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
        if not isinstance(args, dict):
            return None
        return ToolCall(self._new_id(), obj["name"], json.dumps(args, ensure_ascii=False))


PARSERS: dict[str, type[HermesCalls]] = {"hermes": HermesCalls}
"""``model.tool_call_parser`` names: a fresh parser per response."""
