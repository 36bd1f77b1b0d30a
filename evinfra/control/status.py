"""``/v1/evinfra/status``: the partition as its control plane sees it, as JSON-ready data.

Its times are on the service's clock (monotonic seconds, or virtual ones in a simulation);
given the wall time of now, each also has its wall-clock twin (``*_at_utc``, ISO 8601 UTC).
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Protocol

import msgspec

from evinfra.config import Config
from evinfra.control.branches import BranchKeeper
from evinfra.control.counters import Counters
from evinfra.control.engines import Engines
from evinfra.control.switching import Switching
from evinfra.core.bus import Bus
from evinfra.core.clock import Clock
from evinfra.core.types import NodeId, Phase
from evinfra.directory import Directory
from evinfra.router.router import Router

__all__ = ["status"]


class Partition(Protocol):
    """What status reads of the :class:`~evinfra.control.service.Service`."""

    config: Config
    clock: Clock
    bus: Bus
    nodes: list[NodeId]
    policy: object
    planner: object
    router: Router
    directory: Directory
    engines: Engines
    counters: Counters
    branches: BranchKeeper
    switching: Switching

    def in_flight(self) -> int: ...


def _utc(t: float | None, now: float, wall: float | None) -> str | None:
    if t is None or wall is None or not math.isfinite(t):
        return None
    return datetime.fromtimestamp(wall + t - now, timezone.utc).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")


def status(s: Partition, wall: float | None = None) -> dict[str, object]:
    """``wall``: the wall-clock time (Unix seconds) of the service clock's now, if known."""
    now = s.clock.now()
    router = s.router
    p, d = router.split()
    nodes = {}
    for n in s.nodes:
        view = router.node_view(n)
        state = router.state(n)
        if state is not None:
            view.update(l1_used=state.l1_used, l1_capacity=state.l1_capacity,
                        l2_used=state.l2_used, l2_capacity=state.l2_capacity,
                        reported_at=state.time,
                        reported_at_utc=_utc(state.time, now, wall))
        view["driver"] = dict(s.engines[n].stats)
        nodes[n] = view
    c = sorted(n for n in s.nodes if router.phase(n) is Phase.COLLOCATED)
    # "6P3D"; "9C" during the collocated warm-up (not "0P0D")
    label = "".join(f"{k}{x}" for k, x in ((len(p), "P"), (len(d), "D"), (len(c), "C")) if k)
    return {
        "time": now,
        "time_utc": _utc(now, now, wall),
        "policy": {"name": s.config.policy.name,
                   **{k: v for k, v in msgspec.to_builtins(s.policy).items() if k != "about"}},
        "split": {"prefill": p, "decode": d, "label": label, "collocated": c,
                  "switching": {n: ph.value for n, ph in router.switching().items()}},
        "warming_up": s.planner.warming_up,
        "warmup_until": s.planner.warmup_end,
        "warmup_until_utc": _utc(s.planner.warmup_end, now, wall),
        "next_decision_at": s.planner.window_end,
        "next_decision_at_utc": _utc(s.planner.window_end, now, wall),
        "in_flight": s.in_flight(),
        "counters": msgspec.to_builtins(s.counters),
        "inferred_branches": s.branches.inferred(),
        "nodes": nodes,
        "directory": s.directory.summary(),
        "planner": s.switching.status(),
        "bus_errors": s.bus.errors,
    }
