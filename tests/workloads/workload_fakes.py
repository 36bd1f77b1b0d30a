"""Fakes for the workload tests: an echo-like backend on a virtual clock, a scripted workload,
and a reference model of ``h*`` written from its definition (paper Fig. 3), not from
``reuse.py``."""

from __future__ import annotations

from typing import Callable

import numpy as np

from evinfra.core.clock import VirtualClock
from evinfra.core.hashing import block_hashes
from evinfra.workloads import AgentRequest, Outcome, Program, Spawn, TraceWorkload, synth
from evinfra.workloads.tokens import EMPTY

INF = float("inf")


def output_ids(request_id: str, n: int) -> np.ndarray:
    """What :class:`EchoBackend` answers: ids decided by the backend (by request id)."""
    return synth(("out", request_id), n)


class EchoBackend:
    """Answers ``max_tokens`` ids (:func:`output_ids`) ``delay`` seconds after each send.

    Requests whose id is in ``fail`` get an error. With ``keep`` (the default) it logs every
    send and completion in order in ``events``; benchmarks turn it off (a run's prompts would
    fill the memory).
    """

    def __init__(self, clock: VirtualClock | None = None, delay: float = 1.0,
                 fail: frozenset[str] = frozenset(), keep: bool = True) -> None:
        self.clock = clock or VirtualClock()
        self.delay = delay
        self.fail = fail
        self.keep = keep
        self.requests: list[AgentRequest] = []
        self.sent_at: list[float] = []
        self.events: list[tuple] = []

    def send(self, request: AgentRequest, done: Callable[[Outcome], None]) -> None:
        if request.request_id in self.fail:
            outcome = Outcome(error="injected failure")
        else:
            outcome = Outcome(output_ids(request.request_id, request.max_tokens),
                              ttft=self.delay / 2)
        if self.keep:
            self.requests.append(request)
            self.sent_at.append(self.clock.now())
            self.events.append(("send", request))
        self.clock.call_later(self.delay, self._finish, request, outcome, done)

    def _finish(self, request: AgentRequest, outcome: Outcome,
                done: Callable[[Outcome], None]) -> None:
        if self.keep:
            self.events.append(("done", request, outcome))
        done(outcome)

    def by_id(self) -> dict[str, AgentRequest]:
        return {r.request_id: r for r in self.requests}


def stream(backend: EchoBackend) -> list[tuple]:
    """The request stream as comparable tuples (ids, flags, send time, token bytes digest)."""
    return [
        (r.request_id, r.branch_id, r.parent_branch_id, r.final, r.max_tokens, r.tag, t,
         r.tokens.size, hash(r.tokens.tobytes()))
        for r, t in zip(backend.requests, backend.sent_at)
    ]


def scripted(make: Callable[[], Program], system=EMPTY, task=EMPTY, count: int = 1,
             name: str = "t") -> TraceWorkload:
    """A workload whose agents all run ``make()`` on ``system + task``."""
    return TraceWorkload(name, count, lambda i: Spawn(make(), u32(system), u32(task)))


def u32(*parts) -> np.ndarray:
    if not parts:
        return EMPTY
    return np.concatenate([np.asarray(p, dtype=np.uint32).ravel() for p in parts])


def reference_ideal(events: list[tuple], page_size: int) -> dict[str, int]:
    """``h*`` per request id, from the definition: a prompt page is a hit if an earlier request
    produced it (its input, when sent; its input and output but the last token, when done).
    Pages are named by SGLang's SHA-256 chain (``core/hashing.py``), independent of the
    runner's hash."""
    produced: set[int] = set()
    ideal = {}
    for event in events:
        request = event[1]
        if event[0] == "send":
            hashes = block_hashes(request.tokens, page_size)
            hits = 0
            while hits < len(hashes) and hashes[hits] in produced:
                hits += 1
            ideal[request.request_id] = hits * page_size
            produced.update(hashes)
        elif event[2].ok and event[2].tokens.size > 1:
            seq = np.concatenate([request.tokens, event[2].tokens[:-1]])
            produced.update(block_hashes(seq, page_size))
    return ideal
