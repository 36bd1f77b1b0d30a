"""Table D.1 (paper D.1): the best static split under SGLang PD and on evinfra's symmetric
engines, Putnam, CC and OSWorld at the paper's lowest concurrency, minutes 30 to 85 scored.

Both systems are swept over the splits (the scale's sweep): SGLang PD (its decode node
reserved at submit, cache-aware routing) and evinfra without adaptation (``evinfra-fixed``:
decode bound when the prefill starts, Eq. 7 routing, the pool). Paper: SGLang's best is
2P7D / 4P5D / 6P3D, the symmetric engines' 2P7D / 3P6D / 8P1D: OSWorld shifts most, because
SGLang's reservations hold decode memory while requests queue for prefill.
"""

from __future__ import annotations

from evinfra.config import Config
from evinfra.experiments.common import best_static, closed, label, system
from evinfra.experiments.report import METRICS, ExperimentReport, Table, metrics_row
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["PAPER", "SETTINGS", "TITLE", "plans", "report"]

TITLE = "Table D.1: the best static split under SGLang PD and on the symmetric engines"
SETTINGS = (("putnam", 224), ("cc", 90), ("osworld", 128))
SYSTEMS = (("sglang", "static-sglang"), ("symmetric", "evinfra-fixed"))
PAPER = {("putnam", "sglang"): 2, ("cc", "sglang"): 4, ("osworld", "sglang"): 6,
         ("putnam", "symmetric"): 2, ("cc", "symmetric"): 3, ("osworld", "symmetric"): 8}
"""Best static split, prefill nodes of nine."""


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    n = len(config.cluster.nodes)
    counts = [p for p in (scale.sweep or range(1, n)) if 0 < p < n]
    duration = scale.duration * 55 / 60  # minutes 30 to 85
    return [closed(f"{w}-{tag}-static-{p}P", f"{tag} {label(config, p)}",
                   system(config, policy, prefill=p, fixed=True), scale, seed,
                   {w: scale.count(agents)}, duration)
            for w, agents in SETTINGS for tag, policy in SYSTEMS for p in counts]


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    rows, sweeps = [], []
    for w, agents in SETTINGS:
        for tag, _ in SYSTEMS:
            prefix = f"{w}-{tag}"
            mine = sorted((o for k, o in runs.items() if k.startswith(f"{prefix}-static-")),
                          key=lambda o: o.key)
            if not mine:
                continue
            best = best_static(runs, prefix)
            ours = int(best.key.rsplit("-", 1)[1].rstrip("P"))
            rows.append([w, scale.count(agents), tag, best.system.split()[-1],
                         best.summary.throughput, best.summary.e2e.mean,
                         f"{PAPER[(w, tag)]}P", "yes" if ours == PAPER[(w, tag)] else "no"])
            sweeps += [[o.key] + metrics_row(o.summary, o) for o in mine]
    tables = [
        Table(title="Best static split per system", columns=[
            "workload", "agents", "engines", "best split", "throughput (req/s)",
            "mean E2E (s)", "paper", "as in the paper"], rows=rows,
              note="Paper: SGLang 2P7D / 4P5D / 6P3D, symmetric engines 2P7D / 3P6D / 8P1D "
                   "(Putnam / CC / OSWorld)."),
        Table(title="Every split played", columns=["run"] + METRICS, rows=sweeps),
    ]
    return ExperimentReport(name="tableD1", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, runs=runs), []
