"""Count hints waiting to go to one engine (pure; the driver sends them one message at a time).

The directory notes only crossings, so an engine's positive set is right only if it applies
every delta, in order. Sent as they come, concurrent POSTs may land out of order, and one
that fails is lost for good: the engine would protect blocks no branch needs, or evict
blocks a waiting branch does. So the driver keeps one message in flight, and what the
directory pushes meanwhile waits here, merged so that one message does what sending each
delta in turn would: a block's last crossing wins. A message that failed goes back under
what came since (applying a crossing twice changes nothing, so it may have landed). A full
resync (``replace``, an engine that came back) supersedes everything before it, and later
deltas apply to it.
"""

from __future__ import annotations

from evinfra.core.contracts import HintDelta
from evinfra.core.types import BlockHash
from evinfra.engine_patch.wire import CountHints

__all__ = ["HintOutbox"]


class HintOutbox:
    """The hints not yet sent to one engine, as one message's worth."""

    def __init__(self) -> None:
        self._marks: dict[BlockHash, bool] = {}  # block -> positive, last crossing wins
        self._full: set[BlockHash] | None = None  # a resync's positive set, when one waits

    def __bool__(self) -> bool:
        return bool(self._marks) or self._full is not None

    def add(self, delta: HintDelta) -> None:
        if delta.replace:
            self._full = set(delta.positive)
            self._marks = {}
        elif self._full is not None:
            self._full.update(delta.positive)
            self._full.difference_update(delta.zero)
        else:
            marks = self._marks
            marks.update(dict.fromkeys(delta.positive, True))
            marks.update(dict.fromkeys(delta.zero, False))

    def take(self) -> CountHints:
        """Everything waiting, as one message; the outbox is empty afterwards."""
        if self._full is not None:
            msg = CountHints(sorted(self._full), [], replace=True)
        else:
            marks = self._marks
            msg = CountHints([h for h, up in marks.items() if up],
                             [h for h, up in marks.items() if not up])
        self.clear()
        return msg

    def put_back(self, msg: CountHints) -> None:
        """``msg`` may not have landed: it goes before what waits now (unless a resync
        waits, which supersedes it)."""
        if self._full is not None:
            return
        later = self._marks
        self._marks = {}
        self.add(HintDelta(list(msg.positive), list(msg.zero), msg.replace))
        self.add(HintDelta([h for h, up in later.items() if up],
                           [h for h, up in later.items() if not up]))

    def clear(self) -> None:
        """Drop what waits (the engine is down: a restarted one starts with no marks)."""
        self._marks = {}
        self._full = None
