"""Figure D.2 (paper D.2, "Hierarchical serving"): 8 partitions of 96 nodes (3,072 GPUs),
30,720 agents, each partition its own router, planner and KV directory; CC and Codex agents,
bound to partitions by constraint groups (``evinfra/partitions/binding.py``).

Paper: "the aggregate workload stays nearly constant, and the PD ratio of the cluster varies
by only 7 % ... a static split leaves 2 of the 8 partitions severely imbalanced, with queueing
times up to 13.9x the cluster average ... the planner of each partition follows these shifts
and improves the throughput by 1.42x over a static split."

Groups (agents per partition, 40 per node): six ``steady`` partitions serve half CC, half
Codex throughout; ``to-codex`` moves from all CC to all Codex in thirds of the scored window,
``to-cc`` the other way, so the cluster's composition stays the same while two partitions
shift. Each partition runs three times: evinfra adapting from the paper's P/D ratio of 0.6,
evinfra held at that split (``static``: the planner's gain), and SGLang PD held there
(``static-pd``). The partitions are separate runs (``--jobs``,
resumable), bound and seeded as ``evinfra simulate --partitions`` binds and seeds them.
``--quick``: partitions of 9 nodes and a sixteenth of the agents.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from evinfra.config import Config
from evinfra.experiments.common import system
from evinfra.experiments.fig_d1 import sized
from evinfra.experiments.fig_d1 import speed as run_speeds
from evinfra.experiments.report import ExperimentReport, Table, all_runs
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale
from evinfra.partitions.binding import Group
from evinfra.partitions.merge import pd_variation, split_per_minute
from evinfra.partitions.simulate import plans as partition_plans
from evinfra.sim.harness import RunSpec
from evinfra.workloads import Phase

__all__ = ["TITLE", "groups", "plans", "report", "speed"]

TITLE = "Figure D.2: 8 partitions, a constant aggregate, local shifts; each planner vs static"
PARTITIONS = 8
NODES = {"full": 96, "quick": 9}
AGENTS_PER_NODE = 40
SYSTEMS = {"evinfra": "evinfra", "static": "evinfra", "static-pd": "static-sglang"}
"""Run name -> policy: evinfra adapting, evinfra held at the split (the planner's gain), and
SGLang PD held at it behind the cache-aware gateway (static PD, as in Fig. D.1)."""
PAPER = {"pd_variation": 0.07, "imbalanced": 2, "queueing_max": 13.9, "gain": 1.42}


def groups(agents: int, scale: Scale) -> list[Group]:
    """The three constraint groups; ``agents`` per partition."""
    third = scale.duration / 3
    first = scale.warmup + third
    half = agents // 2

    def shift(a: str, b: str) -> list[Phase]:
        return [Phase(first, {a: agents, b: 0}), Phase(third, {a: half, b: agents - half}),
                Phase(third, {a: 0, b: agents})]

    return [Group(name="steady", partitions=6,
                  schedule=[Phase(first + 2 * third, {"cc": half, "codex": agents - half})]),
            Group(name="to-codex", partitions=1, schedule=shift("cc", "codex")),
            Group(name="to-cc", partitions=1, schedule=shift("codex", "cc"))]


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    nodes = NODES["quick" if scale.name == "quick" else "full"]
    agents = scale.count(AGENTS_PER_NODE * nodes)
    cfg = sized(config, nodes)
    spec = RunSpec(duration=scale.duration, warmup=scale.warmup, label="figD2")
    out = []
    for name, policy in SYSTEMS.items():
        c = scale.configure(system(cfg, policy, fixed=name != "evinfra"))
        for p in partition_plans(c, spec, ["cc", "codex"], PARTITIONS, seed,
                                 groups(agents, scale)):
            out.append(RunPlan(key=f"{name}-{p.name}", system=f"{name} {p.group}", config=c,
                               workloads=p.workloads, seed=p.seed, spec=p.spec))
    return out


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    start = scale.warmup
    minutes = max(1, int(scale.duration // 60))
    names = [f"p{i}" for i in range(PARTITIONS)]
    rows, gains = [], []
    splits: dict[str, list[list[tuple[int, int]]]] = {s: [] for s in SYSTEMS}
    queueing: dict[str, list[tuple[float, int]]] = {s: [] for s in SYSTEMS}
    for name in SYSTEMS:
        for p in names:
            o = runs.get(f"{name}-{p}")
            if o is None:
                continue
            splits[name].append(split_per_minute(o.control.split_timeline, start, minutes))
            queueing[name].append((o.control.mean_prefill_queueing, o.summary.requests))
    static_avg = _weighted(queueing["static"])
    evinfra_avg = _weighted(queueing["evinfra"])
    pd_avg = _weighted(queueing["static-pd"])
    for i, p in enumerate(names):
        ev, st, pd = (runs.get(f"{s}-{p}") for s in SYSTEMS)
        if ev is None or st is None:
            continue
        gain = ev.summary.throughput / st.summary.throughput if st.summary.throughput else None
        gains.append(gain)
        rows.append([p, ev.system.split(" ", 1)[1], st.summary.throughput, ev.summary.throughput,
                     gain, st.control.mean_prefill_queueing,
                     st.control.mean_prefill_queueing / static_avg if static_avg else None,
                     ev.control.mean_prefill_queueing / evinfra_avg if evinfra_avg else None,
                     pd_variation(splits["evinfra"][i]) if i < len(splits["evinfra"]) else None,
                     ev.control.final_split,
                     pd.summary.throughput if pd else None,
                     pd.control.mean_prefill_queueing / pd_avg if pd and pd_avg else None])
    total = {s: [(sum(x[m][0] for x in splits[s]), sum(x[m][1] for x in splits[s]))
                 for m in range(minutes)] for s in SYSTEMS if splits[s]}
    cluster = []
    if "evinfra" in total:
        cluster.append(["P/D ratio variation of the cluster (evinfra)",
                        pd_variation(total["evinfra"]), PAPER["pd_variation"]])
    if rows:
        worst = [r[6] for r in rows if r[6] is not None]
        cluster += [
            ["partitions queueing > 2x the cluster average (static)",
             sum(1 for w in worst if w > 2), PAPER["imbalanced"]],
            ["worst partition's queueing / cluster average (static)",
             max(worst) if worst else None, PAPER["queueing_max"]],
            ["planner gain over static, per partition (min-max)",
             f"{min(g for g in gains if g):.3g}-{max(g for g in gains if g):.3g}"
             if any(gains) else None, PAPER["gain"]],
            ["cluster throughput, evinfra / static",
             sum(r[3] for r in rows) / sum(r[2] for r in rows) if sum(r[2] for r in rows)
             else None, PAPER["gain"]]]
    tables = [
        Table(title="The cluster beside the paper", columns=["quantity", "ours", "paper"],
              rows=cluster),
        Table(title="Per partition", columns=[
            "partition", "group", "static req/s", "evinfra req/s", "planner gain",
            "static queueing (s)", "static queueing / cluster", "evinfra queueing / cluster",
            "evinfra P/D ratio shift", "evinfra final split", "static PD req/s",
            "static PD queueing / cluster"], rows=rows),
        all_runs(runs),
    ]
    notes = [f"{PARTITIONS} partitions of {NODES['quick' if scale.name == 'quick' else 'full']} "
             f"nodes; static: evinfra held at P/D = 0.6 (the planner's gain); static PD: SGLang PD "
             "held there; queueing: mean prefill queueing over "
             "the scored window, against the cluster's request-weighted mean."]
    return ExperimentReport(name="figD2", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, notes=notes,
                            runs=runs), [("figD2.png", lambda path: _plot(path, total, start))]


PAPER_RUN = (30_720, 24 * 3600.0)
"""The paper's D.2 run: agents, simulated seconds (24 hours of traces)."""


def speed(runs: dict[str, RunOutcome], plans: list[RunPlan]) -> list[str]:
    """Each run's wall time against simulated time, and the paper's 24-hour run projected
    from the agent-seconds played per wall second (printed, never in ``results.json``).
    A lower bound: a partition of 96 nodes costs more per agent than one of 9 (each
    placement scores every node of its partition)."""
    lines = run_speeds(runs, plans)
    by = {p.key: p for p in plans}
    played = [(by[k], o) for k, o in runs.items() if k in by and o.wall_s]
    if not played:
        return lines
    agent_s = sum(max(sum(ph.agents.values()) for ph in p.spec.schedule)
                  * (p.spec.warmup + p.spec.duration) for p, _ in played)
    wall = sum(o.wall_s for _, o in played)
    agents, seconds = PAPER_RUN
    one = agents * seconds / (agent_s / wall)
    lines += [f"  {agent_s / wall:,.0f} agent-seconds simulated per wall second (one core)",
              f"  the paper's 24-hour run of {agents:,} agents ({PARTITIONS} partitions), one "
              f"system: about {one / 3600:,.0f} core-hours; on this machine's 2 cores "
              f"{one / 2 / 3600:,.0f} h; each added Ray core divides it further, down to "
              f"{one / PARTITIONS / 3600:,.0f} h with a core per partition"]
    return lines


def _weighted(pairs: list[tuple[float, int]]) -> float:
    n = sum(k for _, k in pairs)
    return float(np.sum([q * k for q, k in pairs]) / n) if n else 0.0


def _plot(path: Path, total: dict, start: float) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for name, split in total.items():
        ax.plot([m for m in range(len(split))], [p / d if d else np.nan for p, d in split],
                label=name)
    ax.set_xlabel(f"scored minute (from {start:g} s)")
    ax.set_ylabel("cluster P/D ratio")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
