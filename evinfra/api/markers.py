"""Markers in streamed text (a ``<tool_call>`` or ``</think>`` tag, a stop string): a delta
may end inside one."""

from __future__ import annotations

__all__ = ["partial_marker"]


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (a proper prefix): held
    back, as the next delta may complete it."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
