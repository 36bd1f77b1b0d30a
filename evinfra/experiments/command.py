"""``evinfra experiment NAME [--quick] [--out DIR]``: plan the runs, play them, write the
tables and plots.

Each run's outcome is saved in ``OUT/runs/KEY.json`` as it finishes, with the digest of its
plan; a later invocation with the same plans reuses them, so a long experiment can be played
in parts (``--only 'cc-*'``) and resumed after an interruption. The digest names the plan,
not the code that plays it: after changing a generator or an engine, play into a new OUT."""

from __future__ import annotations

import argparse
import fnmatch
import inspect
import sys
import time
from pathlib import Path

import msgspec

from evinfra.config import load_config
from evinfra.errors import ConfigError
from evinfra.experiments import EXPERIMENTS
from evinfra.experiments.html import write_html
from evinfra.experiments.report import write
from evinfra.experiments.runs import RunOutcome, RunPlan, execute, run_plans
from evinfra.experiments.scale import FULL, QUICK

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("experiment", help="run one of the paper's experiments in the simulator")
    e.add_argument("name", choices=sorted(EXPERIMENTS), help="the figure or table")
    e.add_argument("--quick", action="store_true",
                   help="fewer agents and shorter windows (minutes on two cores); see the output")
    e.add_argument("--config", default="etc/cluster.toml",
                   help="TOML config of the cluster and the systems (etc/cluster.toml)")
    e.add_argument("--out", help="output directory (default: runs/NAME[-quick])")
    e.add_argument("--seed", type=int, default=1)
    e.add_argument("--jobs", type=int, default=2, help="simulations run at once (processes)")
    e.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="play the runs as Ray tasks (a local Ray without ADDRESS; the "
                        "evinfra[ray] extra) instead of --jobs processes")
    e.add_argument("--only", metavar="GLOB",
                   help="play only the runs whose key matches and have no saved outcome of "
                        "the same plan (the others come from earlier outcomes in OUT/runs/, "
                        "or are left out of the tables)")
    e.add_argument("--latency-rule", action="store_true",
                   help="also play evinfra with planner.objective = \"latency\" beside the "
                        "paper's rule (issue 43; fig6, fig7)")
    e.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="error")
    e.set_defaults(func=run)


def _earlier(saved: Path, plans: list[RunPlan]) -> dict[str, RunOutcome]:
    """Outcomes saved by an earlier invocation for exactly these plans."""
    out = {}
    for plan in plans:
        f = saved / f"{plan.key}.json"
        if f.exists():
            o = msgspec.json.decode(f.read_bytes(), type=RunOutcome)
            if o.digest == plan.digest:
                out[plan.key] = o
    return out


def _play(plan: bytes) -> bytes:
    """One run, plan and outcome as msgpack (a Ray task)."""
    return msgspec.msgpack.encode(execute(msgspec.msgpack.decode(plan, type=RunPlan)))


def _on_ray(plans: list[RunPlan], address: str) -> dict[str, RunOutcome]:
    """The plans played as Ray tasks: the same outcomes as in processes (each run is its
    own seeded simulation)."""
    from evinfra.partitions.run import ray_map

    raw = ray_map(_play, [msgspec.msgpack.encode(p) for p in plans], address)
    return {p.key: msgspec.msgpack.decode(r, type=RunOutcome)
            for p, r in zip(plans, raw, strict=True)}


def run(args: argparse.Namespace) -> int:
    experiment = EXPERIMENTS[args.name]
    scale = QUICK if args.quick else FULL
    config = load_config(args.config)
    out = Path(args.out or f"runs/{args.name}{'-quick' if args.quick else ''}")
    options = {"latency_rule": True} if args.latency_rule else {}
    if options and "latency_rule" not in inspect.signature(experiment.plans).parameters:
        raise ConfigError(f"--latency-rule: {args.name} does not play the latency rule "
                          "(fig6 and fig7 do; tableD2 always does)")
    plans = experiment.plans(config, scale, args.seed, **options)
    # An experiment that measures inside its runs plays them itself (issue 43's probe).
    play_plans = getattr(experiment, "run_plans", run_plans)
    if args.ray is not None and play_plans is not run_plans:
        raise ConfigError(f"--ray: {args.name} plays its runs in processes only")
    # Runs that depend on others' outcomes (at the best static split a sweep chooses) come
    # from ``followups`` once those are in: a second stage.
    followups = getattr(experiment, "followups", None)
    saved = out / "runs"
    runs = _earlier(saved, plans)
    if followups is not None:
        plans += followups(config, scale, args.seed, runs)
        runs = _earlier(saved, plans)

    def matches(ps: list[RunPlan]) -> bool:
        return any(fnmatch.fnmatch(p.key, args.only) for p in ps)

    if args.only is not None and not matches(plans) and followups is None:
        raise ConfigError(f"--only {args.only!r} matches no run of {args.name}; its runs: "
                          f"{', '.join(p.key for p in plans)}")
    todo = [p for p in plans if p.key not in runs
            and (args.only is None or fnmatch.fnmatch(p.key, args.only))]
    print(f"{experiment.TITLE}\n{scale.describe()}\n{len(plans)} runs: {len(runs)} done "
          f"earlier, {len(todo)} to play, {args.jobs} at a time; output in {out}", flush=True)
    t0 = time.perf_counter()
    saved.mkdir(parents=True, exist_ok=True)

    def progress(o: RunOutcome, done: int, total: int) -> None:
        (saved / f"{o.key}.json").write_bytes(msgspec.json.encode(o))
        s = o.summary
        print(f"  [{done}/{total}] {o.key}: {s.throughput:.3g} req/s, E2E {s.e2e.mean:.3g} s, "
              f"TTFT P95 {s.ttft.p95:.3g} s, lost reuse {100 * s.lost_kv_reuse:.2f} % "
              f"({o.wall_s:.0f} s wall)", file=sys.stderr, flush=True)

    def play(todo: list[RunPlan]) -> None:
        if args.ray is not None:
            played = _on_ray(todo, args.ray)
            for i, o in enumerate(played.values(), 1):
                progress(o, i, len(todo))
            runs.update(played)
        else:
            runs.update(play_plans(todo, jobs=args.jobs, progress=progress))

    play(todo)
    if followups is not None:
        known = {p.key for p in plans}
        later = [p for p in followups(config, scale, args.seed, runs) if p.key not in known]
        if later:
            runs.update(_earlier(saved, later))
            todo = [p for p in later if p.key not in runs
                    and (args.only is None or fnmatch.fnmatch(p.key, args.only))]
            print(f"then {len(later)} runs that follow from those: {len(todo)} to play",
                  flush=True)
            play(todo)
            plans += later
        if args.only is not None and not matches(plans):
            raise ConfigError(f"--only {args.only!r} matches no run of {args.name} (runs "
                              "that follow from a sweep exist once it has played); its "
                              f"runs: {', '.join(p.key for p in plans)}")
    missing = [p.key for p in plans if p.key not in runs]
    if missing:
        print(f"not played (left out of the tables): {', '.join(missing)}", flush=True)
    report, plots = experiment.report(runs, scale, args.config, args.seed)
    fake = config.fake
    report = msgspec.structs.replace(report, engine={
        k: float(getattr(fake, k)) for k in ("c0", "c1", "c2", "c3", "d0", "d1", "d2",
                                             "l1_tokens", "l2_tokens")})
    if missing:
        report = msgspec.structs.replace(
            report, notes=report.notes + [f"Not played: {', '.join(missing)}."])
    files = write(out, report, plots, wall=time.perf_counter() - t0)
    files.append(write_html(out, report, [name for name, _ in plots]))
    print((out / "results.md").read_text())
    speed = getattr(experiment, "speed", None)
    if speed is not None:  # wall time against simulated time: printed, never in results.json
        print("wall time of the runs:\n" + "\n".join(speed(runs, plans)))
    print(f"wrote {', '.join(str(f) for f in files)} in {time.perf_counter() - t0:.0f} s")
    return 0
