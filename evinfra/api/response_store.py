"""Stored responses of the Responses API: what ``previous_response_id`` continues, and the agent
branch a chain of responses is.

A response is stored (unless the request says ``store: false``) with its conversation: the
messages of its input and of its output, after those of the response it continued; the
``instructions`` are not carried over, as OpenAI does. A chain of responses is one context
growing, so it is one agent branch (paper 4.3) without any hint from the client: a response
that continues the latest one of a chain continues its branch; one that continues an earlier
response forks a new branch from it. A response that starts a chain is a branch of one, as any
request without hints, until a second response continues it: a one-off request keeps no KV
count. The branches end as any idle branch does (``server.branch_idle_s``).

The store is bounded in count and in bytes (``limits.stored_responses``,
``limits.stored_response_bytes``; a response's size is its answer's and its conversation's
JSON): the least recently used responses are forgotten first.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict

import msgspec

from evinfra.api.schemas import AgentHints

__all__ = ["ResponseStore", "Stored"]


class Stored:
    __slots__ = ("response", "conversation", "branch", "size")

    def __init__(self, response: dict, conversation: list[dict], branch: str | None) -> None:
        self.response = response
        self.conversation = conversation
        self.branch = branch
        # What it holds, near enough: its parts shared with the response it continued are
        # counted again (a bound, not a measure).
        self.size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._tips: dict[str, str] = {}  # branch -> its latest response

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str) -> Stored | None:
        s = self._items.get(rid)
        if s is not None:
            self._items.move_to_end(rid)
        return s

    def delete(self, rid: str) -> bool:
        s = self._items.pop(rid, None)
        if s is not None:
            self.bytes -= s.size
        if s is not None and s.branch is not None and self._tips.get(s.branch) == rid:
            del self._tips[s.branch]
        return s is not None

    def hints(self, previous: Stored | None) -> AgentHints:
        """The branch of a response that continues ``previous`` (None: starts a chain, a
        branch of one): the previous one's branch if it is that branch's latest response,
        else a new branch forked from it."""
        if previous is None:
            return AgentHints()
        prev_id = previous.response["id"]
        if previous.branch is not None and self._tips.get(previous.branch) == prev_id:
            return AgentHints(previous.branch)
        return AgentHints(f"chain-{uuid.uuid4().hex[:16]}", previous.branch)

    def claim(self, branch: str, rid: str) -> None:
        """Response ``rid`` was submitted on ``branch``: it is the branch's latest from now
        on, so a second response continuing the one before it meanwhile forks."""
        self._tips[branch] = rid

    def put(self, response: dict, conversation: list[dict], branch: str | None) -> None:
        if self.capacity == 0:
            return
        rid = response["id"]
        self.delete(rid)
        stored = Stored(response, conversation, branch)
        if stored.size > self.max_bytes:
            return  # it alone is past the bound: kept, it would push out every other
        self._items[rid] = stored
        self.bytes += stored.size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            self.delete(next(iter(self._items)))
        if len(self._tips) > 2 * self.capacity:  # tips of responses never stored (failed)
            self._tips = {b: r for b, r in self._tips.items() if r in self._items}
