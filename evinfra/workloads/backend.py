"""The door between the runner and whatever serves its requests, and what each request leaves.

A backend is anything with a clock and a ``send``: the simulator (the real control plane on a
:class:`~evinfra.core.clock.VirtualClock`), the HTTP replay client (a
:class:`~evinfra.core.clock.WallClock` on an asyncio loop), or a fake in the tests. ``send``
returns at once and calls ``done`` later, exactly once, from the clock's loop (never from
inside ``send``), with the output token ids or an error. The runner never blocks and never
awaits: the same code drives virtual and wall time.
"""

from __future__ import annotations

from typing import Callable, Protocol

import msgspec
import numpy as np

from evinfra.core.clock import Clock
from evinfra.workloads.tokens import EMPTY

__all__ = ["AgentRequest", "Backend", "Outcome", "RequestRecord"]


class AgentRequest(msgspec.Struct, frozen=True, gc=False):
    """One LLM request of an agent branch.

    ``tokens`` is the whole prompt (uint32 ids, shared with the runner: read only); the output
    must be exactly ``max_tokens`` long (send it with ``ignore_eos``). ``parent_branch_id`` is
    set on a forked or spawned branch's first request only; ``final`` marks the branch's last
    request (paper E.1: the harness reports branch ends).
    """

    request_id: str
    agent_id: str
    workload: str
    branch_id: str
    parent_branch_id: str | None
    final: bool
    tokens: np.ndarray
    max_tokens: int
    tag: str = ""


class Outcome(msgspec.Struct, frozen=True, gc=False):
    """What a backend returns: the output ids, or an error; timings and cache hits if known."""

    tokens: np.ndarray = EMPTY
    error: str | None = None
    ttft: float | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Backend(Protocol):
    clock: Clock

    def send(self, request: AgentRequest, done: Callable[[Outcome], None]) -> None: ...


class RequestRecord(msgspec.Struct, gc=False):
    """One request as the metrics see it; the fields after ``queued`` are filled at completion.

    ``ideal_cached`` is ``h*``'s numerator for this request (``reuse.py``). ``queued`` is the
    time the agent waited for admission (open loop), carried by its first request only: paper
    D.3 counts it toward that request's TTFT and E2E. ``status`` is ``pending`` until the
    backend answers (a request cut by the end of a run stays pending).
    """

    request_id: str
    agent_id: str
    workload: str
    branch_id: str
    parent_branch_id: str | None
    tag: str
    final: bool
    send_time: float
    input_tokens: int
    max_tokens: int
    ideal_cached: int
    queued: float = 0.0
    status: str = "pending"
    error: str | None = None
    done_time: float | None = None
    output_tokens: int = 0
    ttft: float | None = None
    cached_tokens: int | None = None

    @property
    def e2e(self) -> float | None:
        return None if self.done_time is None else self.done_time - self.send_time
