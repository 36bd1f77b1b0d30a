"""Figure 2(b) (paper 2): as the composition shifts from Putnam to OSWorld, the best split per
10-minute window moves, and the best static split loses throughput in some periods.

SGLang PD at every static split (the scale's sweep) plays fig. 7's shift: 288 Putnam agents,
then 144 Putnam and 72 OSWorld, then 144 OSWorld, an hour each after the warm-up. Each run's
scored three hours are cut into 10-minute windows; per window the split with the highest
throughput is that window's best, the split with the highest whole-run throughput is the
best static split, and its loss in a window is ``1 − its throughput / the window's best``.
Paper: the best split per window moves from 3P6D to 7P2D; the best static split (5P4D) loses
up to 24 % of throughput in the Putnam and OSWorld periods.
"""

from __future__ import annotations

from evinfra.config import Config
from evinfra.experiments.common import best_static, sweep
from evinfra.experiments.fig7 import PERIODS, shift_plan, windows
from evinfra.experiments.report import ExperimentReport, Table, steps
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.scale import Scale

__all__ = ["PAPER", "TITLE", "plans", "report"]

TITLE = "Figure 2(b): the best split per 10-minute window over a shifting composition"
PAPER = {"first": 3, "last": 7, "static": 5, "loss": 24.0}
"""Best split of the first and last windows, the best static split (prefill nodes), and its
largest loss in the Putnam and OSWorld periods (%)."""


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    """Fig. 7's static sweep, the same runs: fig7's outcomes copied or linked into OUT/runs/
    serve here unplayed."""
    return sweep("shift", config, scale,
                 lambda key, name, cfg: shift_plan(key, name, cfg, scale, seed))


def _prefill(o: RunOutcome) -> int:
    return int(o.key.rsplit("-", 1)[1].rstrip("P"))


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    statics = sorted((o for k, o in runs.items() if k.startswith("shift-static-")), key=_prefill)
    periods = windows(scale)
    best = best_static(runs, "shift") if statics else None
    rows, line, worst = [], [], {name: 0.0 for name, _ in PERIODS}
    for name, start, end in periods:
        through = {_prefill(o): o.periods[name].throughput for o in statics if name in o.periods}
        if not through:
            continue
        top = max(through, key=lambda p: (through[p], -p))
        loss = (1 - through[_prefill(best)] / through[top]) * 100 if best and through[top] else None
        period = name.rsplit("-", 1)[0]
        if loss is not None:
            worst[period] = max(worst[period], loss)
        rows.append([name, start - scale.warmup, f"{top}P", through[top],
                     best.system if best else None, loss])
        line.append((start, float(top)))
    summary = [
        ["best split of the first window", rows[0][2] if rows else None, f"{PAPER['first']}P"],
        ["best split of the last window", rows[-1][2] if rows else None, f"{PAPER['last']}P"],
        ["best static split (whole run)", best.system.split()[-1] if best else None,
         f"{PAPER['static']}P4D"],
        ["its largest loss, Putnam and OSWorld periods (%)",
         max(worst["putnam"], worst["osworld"]) if rows else None, PAPER["loss"]],
    ]
    tables = [
        Table(title="Best split per window (SGLang PD, every split swept)",
              columns=["window", "start (s, scored)", "best split", "its throughput (req/s)",
                       "best static split", "best static's loss (%)"], rows=rows),
        Table(title="Beside the paper", columns=["quantity", "ours", "paper"], rows=summary),
    ]
    end = scale.warmup + 3 * scale.duration
    plots = [("fig2b.png", lambda p: steps(p, f"best split per window ({scale.name} scale)",
                                           {"best per window": line}, end, "prefill nodes"))]
    return ExperimentReport(name="fig2b", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, runs=runs), plots
