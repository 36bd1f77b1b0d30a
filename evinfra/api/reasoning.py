"""A thinking model's reasoning, split from its answer.

Thinking models (Qwen3, DeepSeek-R1, QwQ) write their reasoning in a ``<think>...</think>``
block before the answer; OpenAI-compatible servers return it apart, as ``reasoning_content``
(SGLang's ``--reasoning-parser``), so that an agent can leave it out of its next context (as
the ``cc`` workload's harness does, ``evinfra/workloads/cc.py``). The block opens either in
the output (Qwen3) or at the end of the prompt the chat template rendered (DeepSeek-R1, Qwen3
thinking-only models): the caller says which (``forced``). An unterminated block is all
reasoning; an output that does not open one (Qwen3 with ``enable_thinking: false``) is all
answer.

A stream, like the tool-call parser: deltas in, (reasoning, answer) out, the same for any split
of the same text.
"""

from __future__ import annotations

from evinfra.api.markers import partial_marker

__all__ = ["PARSERS", "ThinkSplit"]

_OPENING, _REASONING, _ANSWER = range(3)


class ThinkSplit:
    START, END = "<think>", "</think>"

    def __init__(self, forced: bool) -> None:
        self._state = _REASONING if forced else _OPENING
        self._buf = ""
        self._answered = False
        """The answer has begun (the whitespace after ``</think>`` is not part of it)."""

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and the answer this delta lets out."""
        buf, reasoning, answer = self._buf + delta, "", ""
        if self._state == _OPENING:
            head = buf.lstrip()
            if head.startswith(self.START):
                buf, self._state = head[len(self.START):], _REASONING
            elif not self.START.startswith(head):  # (an empty head may still open it)
                self._state, self._answered = _ANSWER, True
        if self._state == _REASONING:
            j = buf.find(self.END)
            if j < 0:
                k = partial_marker(buf, self.END)
                reasoning, buf = buf[:len(buf) - k], buf[len(buf) - k:]
            else:
                reasoning, buf, self._state = buf[:j], buf[j + len(self.END):], _ANSWER
        if self._state == _ANSWER:
            if not self._answered:
                buf = buf.lstrip()
                self._answered = bool(buf)
            answer, buf = buf, ""
        self._buf = buf
        return reasoning, answer

    def end(self) -> tuple[str, str]:
        """What is left when the text ends: an unterminated block's tail, or an output too
        short to say whether it opened one."""
        buf, self._buf = self._buf, ""
        return (buf, "") if self._state == _REASONING else ("", buf)


PARSERS: dict[str, type[ThinkSplit]] = {"think": ThinkSplit}
"""``model.reasoning_parser`` names."""
