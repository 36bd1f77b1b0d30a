"""``evinfra simulate --partitions P``: the cluster as ``P`` partitions of the config's nodes,
each its own control plane, agents bound by ``--binding`` (``binding.py``), played serially,
in ``--jobs`` processes or on Ray (``run.py``), merged into one report (``merge.py``).

    evinfra simulate --config etc/cluster.toml --workload cc --agents 720 --partitions 8 \\
        --jobs 2 --out runs/p8
    evinfra simulate ... --workload shift --groups groups.toml --partitions 8   # per group
    evinfra simulate ... --partitions 8 --ray [ADDRESS]     # Ray: a local one, or a cluster
"""

from __future__ import annotations

import argparse
import time
import tomllib
from pathlib import Path

import msgspec

from evinfra.config import Config, load_config
from evinfra.errors import ConfigError
from evinfra.partitions.binding import Group, bind_arrivals, bind_groups, bind_schedule
from evinfra.partitions.merge import PartitionedRun, merge, write
from evinfra.partitions.run import PartitionPlan, play
from evinfra.sim.harness import RunSpec
from evinfra.sim.command import build, with_policy
from evinfra.sim.command import run as simulate_one
from evinfra.workloads import stable_seed

__all__ = ["add_arguments", "command", "load_groups", "plans", "run"]


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--partitions", type=int,
                   help="play the cluster as this many partitions of the config's nodes, each "
                        "its own control plane, agents bound by --binding; one merged report")
    s.add_argument("--binding", choices=("hash", "groups"), default=None,
                   help="hash: each user by a hash of its id (default); groups: by the "
                        "constraint groups of --groups")
    s.add_argument("--groups", help="TOML: [[groups]] name, partitions, schedule (agents per "
                                    "partition), with --workload shift")
    s.add_argument("--jobs", type=int, default=1, help="partitions played at once (processes)")
    s.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="play the partitions as Ray tasks (a local Ray without ADDRESS)")
    s.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """``evinfra simulate``: one control plane (``sim.command.run``), or ``--partitions``."""
    if args.partitions is None:
        if args.jobs != 1 or args.ray or args.groups or args.binding:
            raise ConfigError("--jobs, --ray, --binding and --groups go with --partitions")
        return simulate_one(args)
    config = with_policy(load_config(args.config), args.policy)
    workloads, spec, load = build(args, config)
    spec = msgspec.structs.replace(spec, hints=not args.no_hints)
    return run(args, config, workloads, spec, load)


def load_groups(path: str) -> list[Group]:
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("no such file", path=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", path=path) from None
    try:
        return msgspec.convert(raw.get("groups"), list[Group])
    except msgspec.ValidationError as exc:
        raise ConfigError(f"bad groups: {exc}", path=path) from None


def plans(config: Config, spec: RunSpec, workloads: list[str], partitions: int, seed: int,
          groups: list[Group] | None = None) -> list[PartitionPlan]:
    """One plan per partition: its agents bound by hash (``groups`` None) or by group."""
    if partitions < 1:
        raise ConfigError("--partitions must be at least 1")
    names = [f"p{i}" for i in range(partitions)]
    if groups is not None:
        bound = bind_groups(groups, partitions)
        used = sorted({w for _, sched in bound for ph in sched for w in ph.agents})
        return [PartitionPlan(name=n, group=g, config=config, workloads=used,
                              seed=stable_seed(seed, "partition", i),
                              spec=msgspec.structs.replace(spec, schedule=sched, arrivals=None,
                                                           label=f"{spec.label} {n}"))
                for i, (n, (g, sched)) in enumerate(zip(names, bound, strict=True))]
    if spec.schedule is not None:
        loads = [{"schedule": s} for s in bind_schedule(spec.schedule, partitions)]
    elif spec.arrivals is not None:
        loads = [{"arrivals": a} for a in bind_arrivals(spec.arrivals, partitions)]
    else:
        raise ConfigError("a partitioned run needs a closed-loop schedule or arrivals")
    return [PartitionPlan(name=n, group="all", config=config, workloads=sorted(workloads),
                          seed=stable_seed(seed, "partition", i),
                          spec=msgspec.structs.replace(spec, label=f"{spec.label} {n}", **load))
            for i, (n, load) in enumerate(zip(names, loads, strict=True))]


def run(args: argparse.Namespace, config: Config, workloads: dict, spec: RunSpec,
        load: str) -> int:
    """``evinfra simulate --partitions``, after ``sim.command.build``."""
    if args.trace:
        raise ConfigError("--partitions plays generated workloads (--workload), not a trace")
    if args.jobs < 1:
        raise ConfigError("--jobs must be at least 1")
    binding = args.binding or ("groups" if args.groups else "hash")
    groups = None
    if binding == "groups":
        if not args.groups or args.workload != "shift":
            raise ConfigError("--binding groups needs --workload shift --groups FILE")
        groups = load_groups(args.groups)
        load = "; ".join(f"{g.name}: {g.partitions} x " + ", ".join(
            f"{p.duration:g} s {dict(p.agents)}" for p in g.schedule) for g in groups)
    elif args.groups:
        raise ConfigError("--groups binds by group: leave out --binding hash")
    todo = plans(config, spec, list(workloads), args.partitions, args.seed, groups)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {out}: {exc.strerror}") from None
    t0 = time.perf_counter()
    results = play(todo, jobs=args.jobs, ray=args.ray)
    wall = time.perf_counter() - t0
    nodes = len(config.cluster.nodes)
    report = merge(results, PartitionedRun(
        label=spec.label, policy=config.policy.name, seed=args.seed, warmup=spec.warmup,
        duration=spec.duration, partitions=args.partitions, nodes_per_partition=nodes,
        binding=binding, load=load))
    write(out, report, wall)
    s, c = report.cluster.summary, report.cluster
    print(f"{spec.label}: {args.partitions} partitions x {nodes} nodes, {s.requests} requests, "
          f"{s.throughput:.3g} req/s, TTFT P95 {s.ttft.p95:.3g} s, E2E mean {s.e2e.mean:.3g} s, "
          f"lost KV reuse {100 * s.lost_kv_reuse:.2f} %, queueing imbalance "
          f"{c.queueing_imbalance:.3g} (max {c.queueing_imbalance_max:.3g})")
    simulated = (spec.warmup + spec.duration) * args.partitions
    how = f"Ray ({args.ray})" if args.ray else f"{args.jobs} process(es)"
    print(f"simulated {spec.warmup + spec.duration:g} s x {args.partitions} partitions in "
          f"{wall:.1f} s wall on {how} ({simulated / max(wall, 1e-9):.1f}x real time per "
          f"partition-second); report in {args.out}")
    return 0
