"""Static splits, swept: the same run at every fixed split (the "best static split").

Each run keeps its split for the whole scored window (``planner.adapt = false``); the best
static split is the one with the highest throughput, as the paper profiles it offline
(6.1, Fig. 2a, D.1, D.2). Runs are independent simulations with one seed, so the sweep is
exact and costs ``N − 1`` runs.
"""

from __future__ import annotations

from typing import Iterable

import msgspec

from evinfra.baselines import resolve
from evinfra.config import Config
from evinfra.sim.harness import RunSpec, simulate
from evinfra.workloads.summary import Summary, summarise
from evinfra.workloads import Workload

__all__ = ["SplitResult", "best", "fixed_split", "sweep_splits"]


class SplitResult(msgspec.Struct, frozen=True):
    prefill: int
    split: str
    summary: Summary


def fixed_split(config: Config, prefill: int) -> Config:
    """``config`` at a fixed split of ``prefill`` prefill nodes (the first ones listed): its
    policy keeps its parts but its planner, which fits without adapting (evinfra's) or holds
    the split from the start (the baselines')."""
    cluster = msgspec.structs.replace(config.cluster, initial_prefill=prefill)
    planner = msgspec.structs.replace(config.planner, adapt=False)
    kind = resolve(config.policy).planner
    policy = msgspec.structs.replace(
        config.policy, planner="evinfra-fixed" if kind.startswith("evinfra") else "static")
    return msgspec.structs.replace(config, cluster=cluster, planner=planner, policy=policy)


def sweep_splits(config: Config, workloads: dict[str, Workload], spec: RunSpec,
                 prefill: Iterable[int] | None = None) -> list[SplitResult]:
    """Throughput and latency at each fixed split of ``config``'s nodes."""
    n = len(config.cluster.nodes)
    out = []
    for p in prefill if prefill is not None else range(1, n):
        result = simulate(fixed_split(config, p), workloads, spec)
        s = summarise(result.records, spec.warmup, spec.warmup + spec.duration)
        out.append(SplitResult(p, f"{p}P{n - p}D", s))
    return out


def best(results: list[SplitResult]) -> SplitResult:
    """The split with the highest throughput (ties to lower mean E2E)."""
    return max(results, key=lambda r: (r.summary.throughput, -r.summary.e2e.mean))
