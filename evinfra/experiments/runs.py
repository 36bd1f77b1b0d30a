"""Simulations as data: a :class:`RunPlan` says what to play, :func:`run_plans` plays many of
them in worker processes and returns a :class:`RunOutcome` for each.

Every run is one :func:`~evinfra.sim.harness.simulate` of the real control plane with its
own seed, so the outcomes do not depend on how many run at once or in which order: the same
plans give the same outcomes, byte for byte. An outcome holds simulated quantities only
(the wall time of a run is kept apart for the markdown).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable

import msgspec
import numpy as np

from evinfra.baselines.thunderagent import ProgramScheduler
from evinfra.config import Config
from evinfra.core.events import IterationReport
from evinfra.drivers.fake.idle import prefill_idle
from evinfra.experiments.fetches import FetchBin, FetchRecorder
from evinfra.planner.itermodel import NodeFitter
from evinfra.control import Service
from evinfra.sim.control import ControlSummary
from evinfra.sim.harness import RunSpec, simulate
from evinfra.workloads.summary import Summary, summarise
from evinfra.workloads import RunnerStats, make_workload

__all__ = ["RunOutcome", "RunPlan", "run_plans"]


class RunPlan(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    """Unique within an experiment; names the run's file."""
    system: str
    """What the tables call it (``evinfra``, ``dynamo``, ``static 4P5D`` ...)."""
    config: Config
    workloads: list[str]
    seed: int
    spec: RunSpec
    periods: list[tuple[str, float, float]] = []
    """Extra scored windows ``(name, start, end)``, each summarised apart (fig. 7's hours)."""
    fits_at: list[float] = []
    """Learning times at which to refit the iteration-time models (fig. 8c)."""

    @property
    def digest(self) -> str:
        """Names everything in the plan the run depends on (not the code that plays it): an
        outcome with this digest is this plan's.
        Fields at their defaults are left out, so a config that gains a field whose default
        keeps the old behaviour keeps the digests of the outcomes saved before it."""
        return hashlib.sha256(msgspec.msgpack.encode(_set(self))).hexdigest()[:16]


def _set(value: object) -> object:
    """``value`` as builtins, every struct without the fields left at their defaults."""
    if isinstance(value, msgspec.Struct):
        out = {}
        for f in msgspec.structs.fields(value):
            v = getattr(value, f.name)
            if f.default is not msgspec.NODEFAULT and v == f.default:
                continue
            if f.default_factory is not msgspec.NODEFAULT and v == f.default_factory():
                continue
            out[f.encode_name] = _set(v)
        return out
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_set(v) for v in value]
    return msgspec.to_builtins(value)


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    digest: str
    """The :attr:`RunPlan.digest` of the plan played."""
    system: str
    policy: str
    initial_split: str
    summary: Summary
    control: ControlSummary
    by_workload: dict[str, Summary] = {}
    periods: dict[str, Summary] = {}
    runner: RunnerStats = msgspec.field(default_factory=RunnerStats)
    extras: dict[str, float] = {}
    """Numbers a policy adds (ThunderAgent's pauses and its capacity estimate), and the fake
    engines' ``prefill_*`` idle time (:class:`~evinfra.drivers.fake.idle.PrefillIdle`)."""
    convergence: list[tuple[float, float, float]] = []
    """``(learning time, mean prefill error, mean decode error)`` (fig. 8c)."""
    fetches: list[FetchBin] = []
    """Peer fetch times against fetched tokens and queueing, scored window (Fig. D.3)."""
    wall_s: float = 0.0


def _fits(reports: list[IterationReport], times: list[float], held_out: float,
          config: Config) -> list[tuple[float, float, float]]:
    """Fit every node's models on the reports before each learning time; mean relative
    error of their predictions on the reports after ``held_out`` (paper Fig. 8c)."""
    k_over_e, t_fwd = config.planner.k_over_e, config.planner.t_fwd
    test = [r for r in reports if r.start >= held_out and r.duration > 0
            and not (r.prefill and r.batch)]
    out = []
    for t in times:
        fitters: dict[str, NodeFitter] = {}
        for r in reports:
            if r.start < t:
                fitters.setdefault(r.node, NodeFitter(r.node, k_over_e, t_fwd)).add(r)
        models = {n: f.fit().model for n, f in fitters.items()}
        pe, de = [], []
        for r in test:
            m = models.get(r.node)
            if m is None:
                continue
            if r.prefill and m.prefill_ok:
                guess = m.t_p_iter([i.t_uc for i in r.prefill], [i.t_c for i in r.prefill],
                                   [i.t_rst for i in r.prefill])
                pe.append(abs(float(guess) - r.duration) / r.duration)
            elif r.batch and m.decode_ok:
                de.append(abs(float(m.t_d_iter(r.batch)) - r.duration) / r.duration)
        out.append((t, float(np.mean(pe)) if pe else float("nan"),
                    float(np.mean(de)) if de else float("nan")))
    return out


def execute(plan: RunPlan, on_start: Callable[[Service], None] | None = None) -> RunOutcome:
    """Play one plan (in this process); ``on_start`` sees the service before it starts (an
    experiment's own recorders)."""
    reports: list[IterationReport] = []
    services: list[Service] = []
    fetches: list[FetchRecorder] = []

    def hook(service: Service) -> None:
        services.append(service)
        fetches.append(FetchRecorder(service.bus))
        if service.fake_cluster is not None:
            service.fake_cluster.record_prefill()
        if plan.fits_at:
            service.bus.subscribe(IterationReport, reports.append)
        if on_start is not None:
            on_start(service)

    workloads = {w: make_workload(w, plan.seed) for w in plan.workloads}
    t0 = time.perf_counter()
    result = simulate(plan.config, workloads, plan.spec, on_start=hook)
    start, end = plan.spec.warmup, plan.spec.warmup + plan.spec.duration
    records = result.records
    by = {w: summarise([r for r in records if r.workload == w], start, end)
          for w in plan.workloads} if len(plan.workloads) > 1 else {}
    periods = {name: summarise(records, a, b) for name, a, b in plan.periods}
    extras: dict[str, float] = {}
    prefill = services[0].router.prefill
    if isinstance(prefill, ProgramScheduler):
        extras = {"pauses": float(prefill.pauses), "peak_use": prefill.peak_use,
                  "mean_use": prefill.mean_use}
    cluster = services[0].fake_cluster
    if cluster is not None:  # the prefill nodes' idle GPU time (paper D.6)
        idle = prefill_idle([e.prefill_log for e in cluster.engines.values()], start, end)
        extras.update({f"prefill_{k}": float(v)
                       for k, v in msgspec.structs.asdict(idle).items()})
    nodes = len(plan.config.cluster.nodes)
    p = plan.config.cluster.initial_prefill
    return RunOutcome(
        key=plan.key, digest=plan.digest, system=plan.system, policy=plan.config.policy.name,
        initial_split=f"{p}P{nodes - p}D", summary=summarise(records, start, end),
        control=result.control.summarise(start, end), by_workload=by, periods=periods,
        runner=result.stats, extras=extras,
        convergence=_fits(reports, plan.fits_at, plan.config.planner.t_learn, plan.config)
        if plan.fits_at else [],
        fetches=fetches[0].bins(start, end),
        wall_s=time.perf_counter() - t0)


def _execute_encoded(play: Callable[[RunPlan], RunOutcome], plan: bytes) -> bytes:
    return msgspec.msgpack.encode(play(msgspec.msgpack.decode(plan, type=RunPlan)))


def run_plans(plans: Iterable[RunPlan], jobs: int = 1,
              progress: Callable[[RunOutcome, int, int], None] | None = None,
              play: Callable[[RunPlan], RunOutcome] = execute) -> dict[str, RunOutcome]:
    """Play every plan with ``play`` (a module-level function, for the worker processes),
    ``jobs`` at a time in worker processes (1: in this process). Outcomes come back by key;
    ``progress`` hears of each as it finishes."""
    plans = list(plans)
    keys = [p.key for p in plans]
    if len(set(keys)) != len(keys):
        raise ValueError(f"run keys repeat: {sorted(k for k in keys if keys.count(k) > 1)}")
    out: dict[str, RunOutcome] = {}
    # The largest runs first, so the last ones to finish are short.
    order = sorted(plans, key=lambda p: -_cost(p))
    if jobs <= 1:
        for plan in order:
            out[plan.key] = play(plan)
            if progress is not None:
                progress(out[plan.key], len(out), len(plans))
        return out
    ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_execute_encoded, play, msgspec.msgpack.encode(p)) for p in order]
        for f in futures:
            outcome = msgspec.msgpack.decode(f.result(), type=RunOutcome)
            out[outcome.key] = outcome
            if progress is not None:
                progress(outcome, len(out), len(plans))
    return out


def _cost(plan: RunPlan) -> float:
    """A rough size of a run: agent-seconds played."""
    spec = plan.spec
    if spec.schedule:
        return sum(p.duration * sum(p.agents.values()) for p in spec.schedule)
    return (spec.warmup + spec.duration) * (spec.max_active or 1)
