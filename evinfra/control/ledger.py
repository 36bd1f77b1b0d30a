"""The request ledger: the control plane's record of each request in flight.

A :class:`Flight` is the one record of a request: the router books the same object
(:class:`~evinfra.router.router.Routing`, which it extends). It is created when a request is
submitted, enters the ledger when the router accepts it, and leaves it when it ends
(:meth:`~evinfra.control.lifecycle.Lifecycle.end`, the one way out). The ledger also knows
which requests the prefill strategy holds back and how many requests each branch has in
flight: a branch with requests in flight is never idle and never ended under them.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

import numpy as np

from evinfra.control.carryover import Answer
from evinfra.core.clock import Timer
from evinfra.core.contracts import Sampling
from evinfra.core.types import BranchId, NodeId, RequestId
from evinfra.router.router import Routing

__all__ = ["Flight", "Ledger"]


class Flight(Routing):
    """One request in flight, from acceptance to its end: the router's :class:`Routing`
    (what it is, where it was sent; the router writes those fields) and what the lifecycle
    keeps of it (the fields below; the lifecycle writes them)."""

    __slots__ = ("sampling", "sink", "arrival", "first", "prefill_start", "cached", "fetched",
                 "computed", "out", "timer", "progress", "reroutes", "finish", "answer")

    def __init__(self, rid: RequestId, branch: BranchId, tokens: np.ndarray,
                 sampling: Sampling, sink, now: float, parent: BranchId | None = None,
                 final: bool = False) -> None:
        super().__init__(rid, branch, tokens, sampling.max_tokens, parent, final,
                         reuse=not sampling.prompt_logprobs)
        self.sampling = sampling
        self.sink = sink
        self.arrival = now
        self.first: float | None = None
        """When its first output token came (None: not yet)."""
        self.prefill_start: float | None = None
        self.cached = self.fetched = self.computed = self.out = 0
        self.timer: Timer | None = None
        self.progress = now
        """When it last made progress (the timeouts count from here)."""
        self.reroutes = 0
        self.finish: str | None = None
        self.answer: Answer | None = None
        """Where its answer's fingerprints collect, if its inferred branch lives on."""

    def nodes(self) -> set[NodeId]:
        """The nodes that hold an order of it."""
        return {n for n in (self.prefill, self.decode) if n is not None}


class Ledger:
    def __init__(self) -> None:
        self._flights: dict[RequestId, Flight] = {}
        self._held: dict[RequestId, Flight] = {}
        self._active: Counter[BranchId] = Counter()

    def __len__(self) -> int:
        return len(self._flights)

    def __contains__(self, request: RequestId) -> bool:
        return request in self._flights

    def __iter__(self) -> Iterator[Flight]:
        return iter(list(self._flights.values()))

    def get(self, request: RequestId) -> Flight | None:
        return self._flights.get(request)

    def add(self, f: Flight) -> None:
        self._flights[f.id] = f
        self._active[f.branch] += 1

    def remove(self, f: Flight) -> bool:
        """``f`` leaves the ledger; False if it had left already."""
        if self._flights.pop(f.id, None) is None:
            return False
        self._held.pop(f.id, None)
        self._active[f.branch] -= 1
        if not self._active[f.branch]:
            del self._active[f.branch]
        return True

    def hold(self, f: Flight) -> None:
        """The prefill strategy holds ``f`` back (it has no prefill node)."""
        self._held[f.id] = f

    def unhold(self, request: RequestId) -> Flight | None:
        return self._held.pop(request, None)

    def has_held(self) -> bool:
        return bool(self._held)

    def busy(self, branch: BranchId) -> int:
        """How many requests of ``branch`` are in flight."""
        return self._active[branch]

    def on(self, node: NodeId) -> list[Flight]:
        """The requests with an order on ``node``."""
        return [f for f in self._flights.values() if node in (f.prefill, f.decode)]

    def of_branch(self, branch: BranchId) -> list[Flight]:
        return [f for f in self._flights.values() if f.branch == branch]

    def check_invariants(self) -> None:
        """What the lifecycle keeps true (tests call this after every step)."""
        assert self._active == Counter(f.branch for f in self._flights.values()), \
            "per-branch counts disagree with the flights"
        for rid, f in self._held.items():
            assert self._flights.get(rid) is f, f"held {rid} is not in flight"
            assert f.prefill is None and f.decode is None, f"held {rid} has a node"
        for rid, f in self._flights.items():
            assert f.id == rid
            assert not f.admitted or f.decode is not None, f"{rid} admitted with no decode node"
            assert f.first is None or f.admitted, f"{rid} has output but was not admitted"
            assert f.prefill_start is None or f.prefill is not None, \
                f"{rid} started a prefill on no node"
