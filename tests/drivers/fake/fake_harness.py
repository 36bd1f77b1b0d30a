"""A tiny control plane for the fake-engine tests: a virtual clock, a bus that records every
event, and decode binding at ``PrefillStarted`` (what the router does, paper E.3 line 13)."""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from evinfra.core.bus import Bus
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import DecodeOrder, FetchRun, PrefillOrder, Sampling
from evinfra.core.events import (IterationReport, NodeDown, NodeKVEvents, NodeState, NodeUp,
                                 PhaseSwitched, PrefillDone, PrefillStarted, RequestFailed,
                                 TokensOut, Withdrawn)
from evinfra.core.hashing import block_hashes
from evinfra.core.types import Phase
from evinfra.drivers.fake import FakeCluster, FakeEngineConfig

EVENTS = (IterationReport, NodeDown, NodeKVEvents, NodeState, NodeUp, PhaseSwitched,
          PrefillDone, PrefillStarted, RequestFailed, TokensOut, Withdrawn)
PAGE = 64


def tokens(n: int, seed: int = 0, base: np.ndarray | None = None) -> np.ndarray:
    """``n`` token ids; the first ``len(base)`` are ``base`` (a shared prefix)."""
    t = np.random.default_rng(seed).integers(0, 50_000, n).astype(np.uint32)
    if base is not None:
        t[: base.size] = base[:n]
    return t


def path(toks: np.ndarray) -> list[int]:
    return block_hashes(toks, PAGE)


# The timings these tests were written against: a fast prefill, so that scenarios settle in
# seconds. The defaults are calibrated for the simulator's sweeps and may change.
TEST_TIMING = {"c1": 2e-5, "c2": 1e-10}


class Harness:
    def __init__(self, nodes: Iterable[tuple[str, Phase]] = (("p0", Phase.PREFILL),
                                                             ("d0", Phase.DECODE)),
                 seed: int = 0, **config: Any) -> None:
        self.clock = VirtualClock()
        self.bus = Bus()
        self.events: list[Any] = []
        for t in EVENTS:
            self.bus.subscribe(t, self.events.append)
        self.bus.subscribe(PrefillStarted, self._bind)
        self.cluster = FakeCluster(list(nodes), FakeEngineConfig(**{**TEST_TIMING, **config}),
                                   self.clock,
                                   self.bus, seed)
        self.engines = self.cluster.engines
        self.cluster.start()
        self._decode: dict[str, tuple[str, DecodeOrder]] = {}

    def submit(self, request: str, toks: np.ndarray, prefill: str = "p0",
               decode: str | None = "d0", fetch: Iterable[FetchRun] = (), max_tokens: int = 16,
               ignore_eos: bool = True, **sampling: Any) -> PrefillOrder:
        """Prefill on ``prefill``; bind ``decode`` when the prefill starts."""
        s = Sampling(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
        order = PrefillOrder(request, toks, path(toks), list(fetch), s)
        if decode is not None:
            self._decode[request] = (decode, DecodeOrder(request, prefill, toks, order.path, s))
        self.engines[prefill].submit_prefill(order)
        return order

    def _bind(self, ev: PrefillStarted) -> None:
        if ev.request in self._decode:
            node, order = self._decode.pop(ev.request)
            self.engines[node].submit_decode(order)

    def run(self, until: float) -> None:
        self.clock.run(until=until)

    def of(self, kind: type, **match: Any) -> list[Any]:
        return [e for e in self.events if type(e) is kind
                and all(getattr(e, k) == v for k, v in match.items())]

    def one(self, kind: type, **match: Any) -> Any:
        found = self.of(kind, **match)
        assert len(found) == 1, (kind.__name__, match, found)
        return found[0]

    def output(self, request: str) -> tuple[list[int], str | None, float]:
        """All tokens of ``request``, its finish, and the time of its last TokensOut."""
        outs = self.of(TokensOut, request=request)
        return [t for e in outs for t in e.tokens], outs[-1].finish, outs[-1].time

    def kv(self, node: str, medium: str | None = None) -> list[Any]:
        """KV events of ``node`` in publish order (optionally of one medium)."""
        out = [ev for b in self.of(NodeKVEvents, node=node) for ev in b.batch.events]
        return out if medium is None else [e for e in out if e.medium == medium]

    def check(self) -> None:
        for e in self.engines.values():
            if not e.down:
                e.cache.check_invariants()
