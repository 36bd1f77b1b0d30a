"""Play partitions: each its own control plane (``sim.harness.simulate``), in this process,
in worker processes, or as Ray tasks; the results are the same bytes whichever.

A partition is independent of the others once its agents are bound (``binding.py``): its own
service, clock, workload seed and agents. So a partition's result depends on its plan only,
and the plans go out and the results come back as msgpack bytes, in the plans' order.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable
import msgspec

from evinfra.config import Config
from evinfra.core.events import RequestDone
from evinfra.control import Service
from evinfra.errors import ConfigError
from evinfra.sim.control import ControlSummary
from evinfra.sim.harness import RunSpec, simulate
from evinfra.workloads import RequestRecord, make_workload

__all__ = ["PartitionPlan", "PartitionResult", "play", "play_one", "ray_map"]


class PartitionPlan(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    group: str
    """The constraint group it belongs to (``hash`` binding: ``all``)."""
    config: Config
    workloads: list[str]
    seed: int
    """Its workloads' seed: partitions serve different agents."""
    spec: RunSpec


class PartitionResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    group: str
    nodes: int
    records: list[RequestRecord]
    control: ControlSummary
    queueing: list[tuple[float, float]]
    """``(prefill start, seconds queued)`` of every request prefilled in the scored window."""
    wall_s: float
    events: int


def play_one(plan: PartitionPlan) -> PartitionResult:
    """One partition, in this process."""
    queueing: list[tuple[float, float]] = []
    start, end = plan.spec.warmup, plan.spec.warmup + plan.spec.duration

    def on_done(d: RequestDone) -> None:
        if d.prefill_start is not None and start <= d.prefill_start < end:
            queueing.append((d.prefill_start, d.prefill_start - d.arrival))

    def hook(service: Service) -> None:
        service.bus.subscribe(RequestDone, on_done)

    workloads = {w: make_workload(w, plan.seed) for w in plan.workloads}
    t0 = time.perf_counter()
    result = simulate(plan.config, workloads, plan.spec, on_start=hook)
    return PartitionResult(name=plan.name, group=plan.group,
                           nodes=len(plan.config.cluster.nodes), records=result.records,
                           control=result.control.summarise(start, end), queueing=queueing,
                           wall_s=time.perf_counter() - t0, events=result.events)


def _play_encoded(plan: bytes) -> bytes:
    return msgspec.msgpack.encode(play_one(msgspec.msgpack.decode(plan, type=PartitionPlan)))


def play(plans: list[PartitionPlan], jobs: int = 1,
         ray: str | None = None) -> list[PartitionResult]:
    """Every plan's result, in the plans' order: ``jobs`` worker processes (1: this process),
    or Ray tasks when ``ray`` is given (``"local"``: a Ray started here; else the address of
    a running cluster)."""
    encoded = [msgspec.msgpack.encode(p) for p in plans]
    if ray is not None:
        raw = ray_map(_play_encoded, encoded, ray)
    elif jobs <= 1:
        raw = [_play_encoded(p) for p in encoded]
    else:
        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            raw = list(pool.map(_play_encoded, encoded))
    return [msgspec.msgpack.decode(r, type=PartitionResult) for r in raw]


def ray_map(fn: Callable[[bytes], bytes], payloads: list[bytes], address: str) -> list[bytes]:
    """``[fn(p) for p in payloads]`` as Ray tasks, in order: on the Ray at ``address``, or
    one started here for the call (``"local"``)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'evinfra[ray]'") from None
    started = not ray.is_initialized()
    if started:
        # A local Ray when no address is given; the workers import evinfra from this tree.
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    try:
        task = ray.remote(fn)
        return ray.get([task.remote(p) for p in payloads])
    finally:
        if started:
            ray.shutdown()
