"""The control plane's books agree with each other through a random life of the cluster.

A seeded churn of requests (new branches, continuations, forks, parallel calls, branch
ends, aborts), operator actions (cordon, uncordon, forced splits) and faults (an engine
that crashes and comes back) runs on a :class:`Service` in virtual time. After every event
the bus delivers and after every command, ``Service.check_invariants()`` must hold: the
ledger's per-branch counts and held requests, the router's per-node books (each request
booked where it was sent), and the ledger and the router agreeing on what is in flight.
At the end every request has ended exactly once and nothing is left in flight.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from evinfra.control.ledger import Ledger
from evinfra.core import events as events_module
from evinfra.errors import EvinfraError
from tests.control.virtual import VSim, prompt

EVENT_TYPES = [t for t in vars(events_module).values()
               if isinstance(t, type) and issubclass(t, msgspec.Struct)
               and t.__module__ == events_module.__name__ and not t.__name__.startswith("_")]


def churn(seed: int, steps: int = 400) -> tuple[VSim, dict]:
    sim = VSim()
    svc = sim.service
    checked = [0]

    def check(_event: object) -> None:
        svc.check_invariants()
        checked[0] += 1

    for t in EVENT_TYPES:
        svc.bus.subscribe(t, check)
    rng = np.random.default_rng(seed)
    sinks, contexts, ids = {}, {}, iter(range(10**6))
    for _ in range(steps):
        op = rng.random()
        try:
            if op < 0.70:
                rid = f"r{next(ids)}"
                branch = f"b{rng.integers(0, 6)}"
                ctx = contexts.get(branch)
                if ctx is None or rng.random() < 0.2:  # a new context, or a rewrite
                    ctx = prompt(int(rng.integers(16, 400)), seed=int(rng.integers(0, 10**6)))
                else:
                    ctx = np.concatenate([ctx, prompt(int(rng.integers(1, 200)),
                                                      seed=int(rng.integers(0, 10**6)))])
                contexts[branch] = ctx
                sinks[rid] = sim.submit(rid, ctx, branch=branch,
                                        max_tokens=int(rng.integers(1, 40)),
                                        final=bool(rng.random() < 0.05))
            elif op < 0.76:
                running = sorted(rid for rid, sink in sinks.items() if not sink.finished)
                if running:
                    svc.abort(str(rng.choice(running)))
            elif op < 0.80:
                svc.end_branch(f"b{rng.integers(0, 6)}")
            elif op < 0.83:  # maintenance: out of routing for a moment
                node = f"n{rng.integers(0, 4)}"
                svc.cordon(node)
                sim.clock.call_later(float(rng.exponential(0.05)), svc.cordon, node, False)
            elif op < 0.85:
                nodes = [f"n{i}" for i in range(4)]
                svc.force_split(sorted(rng.choice(nodes, size=int(rng.integers(1, 4)),
                                                  replace=False)))
            elif op < 0.87:  # a crash, and the engine relaunched a moment later
                engine = sim.engines[f"n{rng.integers(0, 4)}"]
                if not engine.down:
                    engine.crash("chaos")
                    sim.clock.call_later(float(rng.exponential(0.05)), engine.restart)
        except EvinfraError:
            pass  # refused at the edge (no node, still switching): nothing was accepted
        svc.check_invariants()
        sim.run_for(float(rng.exponential(0.01)))
    sim.run_for(120.0)  # the faults are over: what is in flight must end
    svc.check_invariants()
    return sim, {"sinks": sinks, "checked": checked[0]}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_books_agree_after_every_event(seed):
    sim, got = churn(seed)
    sinks = got["sinks"]
    assert got["checked"] > 1000  # the invariants were checked along the way
    assert sim.service.bus.errors == 0  # ... and held (a handler's failure is only counted)
    assert all(s.done_calls == 1 for s in sinks.values()), "a request ended twice or never"
    assert sim.service.in_flight() == 0
    statuses = {s.record.status for s in sinks.values()}
    assert "ok" in statuses and "aborted" in statuses  # the churn reached both ends


def test_a_ledger_that_forgets_a_branch_s_request_is_caught(monkeypatch):
    """Control: the same churn with a ledger that drops a branch's count of requests in
    flight one request too early fails the invariants."""
    remove = Ledger.remove

    def early(self, f):
        if remove(self, f):
            for branch in list(self._active):
                self._active[branch] -= 1
                if self._active[branch] <= 0:
                    del self._active[branch]
                break
            return True
        return False

    monkeypatch.setattr(Ledger, "remove", early)
    with pytest.raises(AssertionError, match="per-branch counts"):
        churn(1)
