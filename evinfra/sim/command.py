"""``evinfra simulate``: build the run from the command line, play it, write the report."""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import msgspec

from evinfra.baselines import POLICIES
from evinfra.config import Config, load_config
from evinfra.errors import ConfigError
from evinfra.sim.harness import RunSpec, simulate
from evinfra.sim.html import write_html
from evinfra.sim.report import Report, RunInfo, write_report
from evinfra.workloads.summary import summarise
from evinfra.workloads import (GENERATORS, Phase, make_workload, paper_shift, poisson_arrivals,
                               read_trace, schedule_from_data)

__all__ = ["add_parser", "build"]

def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="run the control plane on fake engines in virtual time")
    s.add_argument("--config", required=True, help="TOML config (etc/cluster.toml)")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", help="cc | putnam | osworld | shift")
    what.add_argument("--trace", help="a trace file (see --format)")
    s.add_argument("--format", default="mooncake", help="trace format: mooncake | agentic | trie")
    s.add_argument("--schedule", help="shift: a TOML/JSON file with phases [[seconds, {workload: agents}], ...]")
    s.add_argument("--agents", type=int, help="closed loop: concurrent agents")
    s.add_argument("--arrival-rate", type=float, help="open loop: agents per second")
    s.add_argument("--max-active", type=int, help="open loop: admission cap")
    s.add_argument("--duration", type=float, default=3600.0, help="scored simulated seconds")
    s.add_argument("--warmup", type=float, default=1800.0, help="unscored simulated seconds first")
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--no-hints", action="store_true",
                   help="the agents send no branch hints, as harnesses ship: the service "
                        "infers their branches (server.infer_branches)")
    s.add_argument("--policy", choices=POLICIES,
                   help="the system to run (default: the config's [policy] name, evinfra)")
    s.add_argument("--out", required=True, help="directory for report.json, report.md, report.html, plots")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    s.set_defaults(func=run)


def build(args: argparse.Namespace, config: Config):
    """``(workloads, RunSpec, load description)`` from the arguments; ConfigError if they
    do not describe one run."""
    if args.duration <= 0 or args.warmup < 0:
        raise ConfigError("--duration must be positive and --warmup not negative")
    if args.agents is not None and args.arrival_rate is not None:
        raise ConfigError("give one of --agents (closed loop) or --arrival-rate (open loop)")
    if args.workload not in (None, "shift") and args.agents is None and args.arrival_rate is None:
        raise ConfigError("give --agents (closed loop) or --arrival-rate (open loop)")
    end = args.warmup + args.duration
    if args.trace:
        trace = read_trace(args.trace, args.format, name="trace", seed=args.seed,
                           **({"cycle": True} if args.agents else {}))
        workloads = {"trace": trace}
        if args.agents:
            return workloads, RunSpec(duration=args.duration, warmup=args.warmup,
                                      schedule=[Phase(end, {"trace": args.agents})],
                                      label=Path(args.trace).name), f"closed: {args.agents} agents"
        arrivals = [a for a in trace.arrivals() if a.time < end]
        return workloads, RunSpec(duration=args.duration, warmup=args.warmup, arrivals=arrivals,
                                  max_active=args.max_active, label=Path(args.trace).name), \
            "open: the trace's timestamps"
    if args.workload == "shift":
        if args.schedule:
            raw = Path(args.schedule).read_bytes()
            data = (tomllib.loads(raw.decode())["phases"] if args.schedule.endswith(".toml")
                    else msgspec.json.decode(raw))
            schedule = schedule_from_data(data, args.schedule)
        else:
            schedule = paper_shift(args.warmup)
        names = sorted({w for p in schedule for w in p.agents})
        workloads = {w: make_workload(w, args.seed) for w in names}
        load = "; ".join(f"{p.duration:g} s {dict(p.agents)}" for p in schedule)
        return workloads, RunSpec(duration=args.duration, warmup=args.warmup, schedule=schedule,
                                  label="shift"), f"closed: {load}"
    if args.workload not in GENERATORS:
        raise ConfigError(f"unknown workload {args.workload!r}; use one of "
                          f"{sorted(GENERATORS) + ['shift']}")
    workloads = {args.workload: make_workload(args.workload, args.seed)}
    if args.agents is not None:
        if args.agents <= 0:
            raise ConfigError("--agents must be positive")
        return workloads, RunSpec(duration=args.duration, warmup=args.warmup,
                                  schedule=[Phase(end, {args.workload: args.agents})],
                                  label=f"{args.workload} x{args.agents}"), \
            f"closed: {args.agents} agents"
    arrivals = []
    for a in poisson_arrivals({args.workload: args.arrival_rate}, args.seed):
        if a.time >= end:
            break
        arrivals.append(a)
    return workloads, RunSpec(duration=args.duration, warmup=args.warmup, arrivals=arrivals,
                              max_active=args.max_active,
                              label=f"{args.workload} @{args.arrival_rate:g}/s"), \
        f"open: {args.arrival_rate:g} agents/s, cap {args.max_active}"


def _progress(quiet: bool):
    if quiet or not sys.stderr.isatty():
        return None

    def show(now: float, end: float, answered: int) -> None:
        width = 30
        done = int(width * now / end)
        sys.stderr.write(f"\rsimulate [{'#' * done}{'.' * (width - done)}] {now:8.0f}/{end:.0f} s"
                         f"  {answered} requests")
        if now >= end:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def with_policy(config: Config, name: str | None) -> Config:
    """``config`` running the policy ``name`` (its other ``[policy]`` keys kept)."""
    if name is None:
        return config
    return msgspec.structs.replace(config, policy=msgspec.structs.replace(config.policy,
                                                                          name=name))


def run(args: argparse.Namespace) -> int:
    config = with_policy(load_config(args.config), args.policy)
    workloads, spec, load = build(args, config)
    spec = msgspec.structs.replace(spec, hints=not args.no_hints)
    out = Path(args.out)
    try:  # before the run, which may take an hour, not after it
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot write the report to {out}: {exc.strerror}") from None
    result = simulate(config, workloads, spec, _progress(args.no_progress))
    start, end = spec.warmup, spec.warmup + spec.duration
    summary = summarise(result.records, start, end)
    by = {}
    if len(workloads) > 1:
        by = {w: summarise([r for r in result.records if r.workload == w], start, end)
              for w in sorted(workloads)}
    nodes = len(config.cluster.nodes)
    p = config.cluster.initial_prefill
    report = Report(RunInfo(spec.label, config.policy.name, args.seed, spec.warmup, spec.duration,
                            nodes, f"{p}P{nodes - p}D", load, spec.hints),
                    summary, result.control.summarise(start, end), by)
    write_report(out, report, result.records, result.wall_seconds)
    write_html(out, report)
    s = summary
    print(f"{spec.label}: {s.requests} requests, {s.throughput:.3g} req/s, E2E mean {s.e2e.mean:.3g} s, "
          f"TTFT P95 {s.ttft.p95:.3g} s, lost KV reuse {100 * s.lost_kv_reuse:.2f} %, "
          f"switches {report.control.switches}, final split {report.control.final_split}")
    wall = result.wall_seconds
    print(f"simulated {end:g} s in {wall:.1f} s wall ({len(result.records) / max(wall, 1e-9):.0f} "
          f"requests/s, {end / max(wall, 1e-9):.0f}x real time); report in {args.out}")
    return 0
