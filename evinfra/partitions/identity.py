"""The agent's identity: what the global tier (nginx) hashes to bind an agent to a partition.

An agent, its forks and its sub-agents must land in one partition (paper D.2: "constraints
bind each user to one partition"), so the identity is read from request headers only (nginx
does not read bodies), the first present of :data:`IDENTITY_HEADERS`:

1. ``X-Evinfra-Agent``: the agent (or user) id, one for the whole tree of an agent;
2. the branch hints' parent, ``X-Evinfra-Parent-Branch-Id`` or Dynamo's
   ``X-Dynamo-Parent-Session-ID``: a sub-agent or fork lands with its parent;
3. the branch itself, ``X-Evinfra-Branch-Id`` or Dynamo's ``X-Dynamo-Session-ID``: a root
   agent's own requests (a sub-agent of a sub-agent needs 1 to stay with its root);
4. the API key, ``Authorization`` or ``x-api-key``: one key, one user.

The branch hints keep meaning branches (the control plane reads them as before); the identity
only reads them. A request with none of these is spread round robin by nginx. The nginx
config of ``evinfra partitions nginx`` reads the same headers in the same order
(:func:`evinfra.partitions.nginx.render`), so a partition's ``/v1/evinfra/status`` lists
exactly the agents nginx sends it (:class:`AgentBook`, keys hashed, never shown).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable, Mapping

from aiohttp import web

__all__ = ["AGENTS_KEY", "IDENTITY_HEADERS", "KEY_HEADERS", "AgentBook", "agent_of",
           "agents_middleware"]

IDENTITY_HEADERS = ("X-Evinfra-Agent", "X-Evinfra-Parent-Branch-Id",
                    "X-Dynamo-Parent-Session-ID", "X-Evinfra-Branch-Id", "X-Dynamo-Session-ID",
                    "Authorization", "x-api-key")
"""Read in this order; the first present and non-empty is the agent's identity."""
KEY_HEADERS = ("Authorization", "x-api-key")
"""Secrets: the identity they give is a digest of the header, never the key."""
INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
AGENTS_KEY = web.AppKey("agents", "AgentBook")


def agent_of(headers: Mapping[str, str]) -> str | None:
    """The identity of a request's agent (None: the request names none)."""
    for name in IDENTITY_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            if name in KEY_HEADERS:
                return "key:" + hashlib.sha256(value.encode()).hexdigest()[:16]
            return value
    return None


class AgentBook:
    """The agents a partition has served: requests and last request time per identity, the
    ``capacity`` most recent (a partition serves thousands; the book must not grow without
    bound with agents that left)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._agents: OrderedDict[str, list[float]] = OrderedDict()

    def saw(self, agent: str, now: float) -> None:
        entry = self._agents.pop(agent, None) or [0, now]
        entry[0] += 1
        entry[1] = now
        self._agents[agent] = entry
        if len(self._agents) > self.capacity:
            self._agents.popitem(last=False)

    def __contains__(self, agent: str) -> bool:
        return agent in self._agents

    def status(self) -> dict[str, object]:
        return {"count": len(self._agents),
                "agents": {a: {"requests": int(n), "last_seen": t}
                           for a, (n, t) in self._agents.items()}}


def agents_middleware(book: AgentBook, now: Callable[[], float]):
    """Notes the agent of every inference request in ``book`` as it arrives."""

    @web.middleware
    async def agents(request: web.Request, handler):
        if request.method == "POST" and request.path in INFERENCE_PATHS:
            agent = agent_of(request.headers)
            if agent is not None:
                book.saw(agent, now())
        return await handler(request)

    return agents
