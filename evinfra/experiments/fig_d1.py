"""Figure D.1(b, c) (paper D.2, "Scaling to larger clusters"): CC at 9, 16, 32 and 64 nodes
(36 to 256 GPUs), static PD at the paper's split ratio against evinfra: P95 TTFT and mean E2E
against the cluster's size.

Paper: from 36 to 256 GPUs the P95 TTFT of static PD rises about threefold (142 s to 418 s:
"with more prefill nodes, the cache-aware router concentrates the requests of more agents on
the few nodes that hold their prefixes"), while evinfra's stays within 10-14 s and its mean E2E
rises by only 16 %. Static PD is SGLang PD behind the gateway's cache-aware routing at a fixed
P/D ratio of 0.6 (24P40D on 64 nodes, the reference of Fig. D.1a): ``round(N * 0.6 / 1.6)``
prefill nodes; evinfra starts from the same split and adapts. Load: 10 agents per GPU, 40 per
node (the density of the paper's D.2 simulation), scaled like every experiment by ``--quick``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from evinfra.config import Config, NodeConfig
from evinfra.experiments.common import closed, system
from evinfra.experiments.report import ExperimentReport, Table, all_runs
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["NODES", "TITLE", "plans", "report", "speed"]

TITLE = "Figure D.1: static PD's P95 TTFT rises with the cluster's size, evinfra's stays flat"
NODES = (9, 16, 32, 64)
AGENTS_PER_NODE = 40
"""10 agents per GPU, four GPUs a node (paper D.2)."""
PD_RATIO = 0.6
"""Fig. D.1a's reference split, 24P40D on 64 nodes."""
SYSTEMS = (("static PD", "static"), ("evinfra", "evinfra"))
PAPER = {"static_p95": (142.0, 418.0), "evinfra_p95": (10.0, 14.0), "evinfra_e2e_rise": 0.16}


def sized(config: Config, nodes: int) -> Config:
    """``config`` with ``nodes`` nodes (its own node parameters), at the paper's ratio."""
    prefill = round(nodes * PD_RATIO / (1 + PD_RATIO))
    cluster = msgspec.structs.replace(config.cluster, initial_prefill=prefill,
                                      nodes=[NodeConfig(name=f"n{i}") for i in range(nodes)])
    return msgspec.structs.replace(config, cluster=cluster)


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    out = []
    for n in NODES:
        cfg = sized(config, n)
        agents = {"cc": scale.count(AGENTS_PER_NODE * n)}
        out.append(closed(f"{n}-static", "static PD",
                          system(cfg, "static-sglang", fixed=True), scale, seed, agents))
        out.append(closed(f"{n}-evinfra", "evinfra", system(cfg, "evinfra"), scale, seed, agents))
    return out


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    rows, series = [], {name: [] for name, _ in SYSTEMS}
    for n in NODES:
        for name, key in SYSTEMS:
            o = runs.get(f"{n}-{key}")
            if o is None:
                continue
            s = o.summary
            rows.append([n, 4 * n, name, o.initial_split, scale.count(AGENTS_PER_NODE * n),
                         s.ttft.p95, s.e2e.mean, s.throughput, o.control.final_split])
            series[name].append((n, s.ttft.p95, s.e2e.mean))
    growth = []
    for name, pts in series.items():
        if len(pts) > 1:
            growth.append([name, f"{pts[0][0]}-{pts[-1][0]} nodes", pts[-1][1] / pts[0][1]
                           if pts[0][1] else None, pts[-1][2] / pts[0][2] if pts[0][2] else None])
    tables = [
        Table(title="P95 TTFT and mean E2E against the cluster's size",
              columns=["nodes", "GPUs", "system", "initial split", "agents", "P95 TTFT (s)",
                       "mean E2E (s)", "throughput (req/s)", "final split"], rows=rows),
        Table(title="From the smallest to the largest cluster (paper: static PD's P95 TTFT "
                    "x2.9, 142 to 418 s; evinfra's within 10-14 s, mean E2E +16 %)",
              columns=["system", "sizes", "P95 TTFT x", "mean E2E x"], rows=growth),
        all_runs(runs),
    ]
    notes = [f"Static PD: SGLang PD at P/D = {PD_RATIO} (round(N x 0.375) prefill nodes) behind "
             "the cache-aware gateway; evinfra starts from the same split and adapts. "
             f"{AGENTS_PER_NODE} CC agents per node at full scale."]
    return ExperimentReport(name="figD1", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, notes=notes,
                            runs=runs), [("figD1.png", lambda p: _plot(p, series, scale))]


def speed(runs: dict[str, RunOutcome], plans: list[RunPlan]) -> list[str]:
    """Wall time against simulated time (printed, never in ``results.json``)."""
    by = {p.key: p for p in plans}
    lines = []
    for k, o in sorted(runs.items()):
        p = by.get(k)
        if p is None or not o.wall_s:
            continue
        sim = p.spec.warmup + p.spec.duration
        lines.append(f"  {k}: {len(p.config.cluster.nodes)} nodes, {sim:g} s simulated in "
                     f"{o.wall_s:.1f} s wall ({sim / o.wall_s:.1f}x real time)")
    return lines


def _plot(path: Path, series: dict, scale: Scale) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for name, pts in series.items():
        if pts:
            axes[0].plot([4 * n for n, _, _ in pts], [t for _, t, _ in pts], "o-", label=name)
            axes[1].plot([4 * n for n, _, _ in pts], [e for _, _, e in pts], "o-", label=name)
    axes[0].set_ylabel("P95 TTFT (s)")
    axes[1].set_ylabel("mean E2E (s)")
    for ax in axes:
        ax.set_xlabel("GPUs")
        ax.legend(fontsize=8)
    fig.suptitle(f"{TITLE} ({scale.name} scale)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
