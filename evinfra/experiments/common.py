"""What the experiments share: configs per system, closed-loop plans, best-static sweeps."""

from __future__ import annotations

import msgspec

from evinfra.config import Config
from evinfra.drivers.fake.models import serving
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import FULL, Scale
from evinfra.sim.harness import RunSpec
from evinfra.sim.sweep import fixed_split
from evinfra.workloads import Phase

__all__ = ["best_prefill", "best_static", "closed", "label", "latency_rule", "rate_factor",
           "served", "system", "sweep"]


def system(config: Config, policy: str, *, prefill: int | None = None, fixed: bool = False,
           **parts: str) -> Config:
    """``config`` running ``policy`` (its ``[policy]`` parameters kept, ``parts``
    overriding the preset's parts), from ``prefill`` prefill nodes, at that split for good
    when ``fixed``."""
    cfg = msgspec.structs.replace(config, policy=msgspec.structs.replace(
        config.policy, name=policy, **parts))
    if prefill is not None:
        cfg = msgspec.structs.replace(cfg, cluster=msgspec.structs.replace(
            cfg.cluster, initial_prefill=prefill))
    return fixed_split(cfg, cfg.cluster.initial_prefill) if fixed else cfg


def latency_rule(config: Config) -> Config:
    """``config`` with the planner's latency objective (beyond the paper, issue 43)."""
    return msgspec.structs.replace(config, planner=msgspec.structs.replace(
        config.planner, objective="latency"))


def rate_factor(scale: Scale) -> float:
    """Open-loop arrival rates at ``scale``: a quick scale keeps the number of arrivals in
    proportion to its agent factor over its shorter run (tableD2, latency)."""
    return scale.agents * (FULL.warmup + FULL.duration) / (scale.warmup + scale.duration)


def served(config: Config, workloads: list[str]) -> Config:
    """``config`` with its fake engines serving the paper's model for ``workloads``: Kimi
    K2.6 when OSWorld's agents are among them (6.1: "Kimi K2.6 for OSWorld and for the run
    with a shifting workload composition"), GLM-5.2 otherwise."""
    model = "kimi-k2.6" if "osworld" in workloads else "glm-5.2"
    return msgspec.structs.replace(config, fake=serving(config.fake, model))


def label(config: Config, prefill: int) -> str:
    n = len(config.cluster.nodes)
    return f"{prefill}P{n - prefill}D"


def closed(key: str, name: str, config: Config, scale: Scale, seed: int,
           agents: dict[str, int], duration: float | None = None) -> RunPlan:
    """A stationary closed-loop run: ``agents`` (already scaled) for the whole run."""
    duration = scale.duration if duration is None else duration
    end = scale.warmup + duration
    spec = RunSpec(duration=duration, warmup=scale.warmup, schedule=[Phase(end, dict(agents))],
                   label=key)
    return RunPlan(key=key, system=name, config=served(scale.configure(config), list(agents)),
                   workloads=sorted(agents), seed=seed, spec=spec)


def sweep(prefix: str, config: Config, scale: Scale, make) -> list[RunPlan]:
    """The static-sglang runs of a best-static sweep: ``make(key, name, cfg)`` builds each."""
    n = len(config.cluster.nodes)
    counts = [p for p in (scale.sweep or range(1, n)) if 0 < p < n]
    return [make(f"{prefix}-static-{p}P", f"static {label(config, p)}",
                 system(config, "static-sglang", prefill=p, fixed=True)) for p in counts]


def best_static(outcomes: dict[str, RunOutcome], prefix: str) -> RunOutcome:
    """The sweep's split with the highest throughput (ties: lower mean E2E), paper 6.1."""
    runs = [o for k, o in outcomes.items() if k.startswith(f"{prefix}-static-")]
    return max(runs, key=lambda o: (o.summary.throughput, -o.summary.e2e.mean))


def best_prefill(outcomes: dict[str, RunOutcome], swept: list[RunPlan]) -> int | None:
    """The prefill count of the best split of the sweep ``swept`` (:func:`best_static`'s
    rule), once every run of it has an outcome; None before. Experiments that compare with
    "the best static split" run their comparisons at this split (their ``followups``)."""
    if not swept or any(p.key not in outcomes for p in swept):
        return None
    best = max(swept, key=lambda p: (outcomes[p.key].summary.throughput,
                                     -outcomes[p.key].summary.e2e.mean))
    return best.config.cluster.initial_prefill
