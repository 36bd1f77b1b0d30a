"""Markers in streamed text (a ``<tool_call>`` or ``</think>`` tag, a stop string): a delta
may end inside one."""

from __future__ import annotations

__all__ = ["partial_tag"]


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (a proper prefix): held back,
    as the next delta may complete it."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
