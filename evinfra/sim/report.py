"""A simulation's report: ``report.json`` (byte-identical for a seed), ``report.md``, plots.

The JSON holds only simulated quantities, rounded to six significant digits and encoded with
sorted keys, so two runs with one seed give the same bytes; the wall-clock cost of a run goes
to stdout and ``report.md`` only.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from evinfra.sim.control import ControlSummary
from evinfra.workloads.summary import WAIT_NAMES, Summary
from evinfra.workloads import RequestRecord

__all__ = ["Report", "RunInfo", "write_report"]


class RunInfo(msgspec.Struct, frozen=True):
    label: str
    policy: str
    seed: int
    warmup: float
    duration: float
    nodes: int
    initial_split: str
    load: str
    """What played: ``closed: {workload: agents}`` per phase, or ``open: rate, cap``."""
    hints: bool = True
    """Whether the agents sent their branch hints (``--no-hints``: none)."""


class Report(msgspec.Struct, frozen=True):
    run: RunInfo
    summary: Summary
    control: ControlSummary
    by_workload: dict[str, Summary] = {}


def write_report(out: Path, report: Report, records: list[RequestRecord],
                 wall_seconds: float | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_bytes(msgspec.json.format(
        msgspec.json.encode(report, order="sorted"), indent=2) + b"\n")
    (out / "report.md").write_text(_markdown(report, wall_seconds))
    _plots(out, report, records)


def _markdown(r: Report, wall: float | None) -> str:
    s, c, run = r.summary, r.control, r.run
    lines = [
        f"# Simulation: {run.label}",
        "",
        f"- policy `{run.policy}`, seed {run.seed}, {run.nodes} nodes starting at "
        f"{run.initial_split}; load {run.load}",
        f"- scored window {run.warmup:g}-{run.warmup + run.duration:g} s (warm-up excluded)",
    ]
    if not run.hints:
        lines.append(f"- the agents sent no branch hints: {c.branches_inferred} branches "
                     f"inferred, {c.requests_chained} requests joined one, "
                     f"{c.branches_joined} ended by a prompt taking in their last answer, "
                     f"{c.compactions_inferred} compactions seen")
    if wall:
        lines.append(f"- wall time {wall:.1f} s ({s.requests / wall:.0f} scored requests per "
                     "wall second)")
    lines += [
        "",
        "| metric | value |",
        "|---|---|",
        f"| throughput (req/s) | {s.throughput:.4g} |",
        f"| requests ok / errors / unfinished | {s.requests} / {s.errors} / {s.unfinished} |",
        f"| E2E mean / P50 / P95 (s) | {s.e2e.mean:.3g} / {s.e2e.p50:.3g} / {s.e2e.p95:.3g} |",
        f"| TTFT mean / P50 / P95 (s) | {s.ttft.mean:.3g} / {s.ttft.p50:.3g} / {s.ttft.p95:.3g} |",
        f"| TPOT mean / P50 / P95 (ms) | {s.tpot.mean * 1e3:.3g} / {s.tpot.p50 * 1e3:.3g} / "
        f"{s.tpot.p95 * 1e3:.3g} |",
        f"| KV hit rate h / ideal h* | {s.kv_hit_rate:.4f} / {s.ideal_hit_rate:.4f} |",
        f"| lost KV reuse 1 - h/h* | {100 * s.lost_kv_reuse:.2f} % |",
        f"| uncached prompt tokens per request | {s.uncached_tokens_per_request:.0f} |",
        f"| mean prefill queueing (s) | {c.mean_prefill_queueing:.3g} |",
        f"| prefill queueing max/avg per minute | {c.queueing_imbalance:.3g} |",
        f"| switches / mean switch time (s) | {c.switches} / {c.mean_switch_time:.3g} |",
        f"| planner decisions / final split | {c.decisions} / {c.final_split} |",
        "",
    ]
    if s.reuse_by_wait:
        lines += ["| sent after | requests | reusable tokens | lost reuse | share of lost |",
                  "|---|---|---|---|---|"]
        for label, name in WAIT_NAMES.items():
            x = s.reuse_by_wait.get(label)
            if x is not None:
                lines.append(f"| {name} | {x.requests} | "
                             f"{x.ideal_cached} | {100 * x.lost_kv_reuse:.2f} % | "
                             f"{100 * x.share_of_lost:.1f} % |")
        lines.append("")
    if r.by_workload:
        lines += ["| workload | req/s | E2E mean (s) | TTFT P95 (s) | lost reuse |", "|---|---|---|---|---|"]
        for w, x in sorted(r.by_workload.items()):
            lines.append(f"| {w} | {x.throughput:.4g} | {x.e2e.mean:.3g} | {x.ttft.p95:.3g} | "
                         f"{100 * x.lost_kv_reuse:.2f} % |")
        lines.append("")
    if c.decision_log:
        lines += ["## Planner decisions", ""]
        lines += [f"- {t:g} s: {reason}" for t, reason in c.decision_log]
        lines.append("")
    lines += ["Plots: `split.png`, `ttft_cdf.png`, `queueing.png`.", ""]
    return "\n".join(lines)


def _plots(out: Path, r: Report, records: list[RequestRecord]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = r.run
    fig, ax = plt.subplots(figsize=(7, 3))
    tl = r.control.split_timeline
    if tl:
        times = [t for t, _ in tl] + [run.warmup + run.duration]
        prefill = [int(label.split("P")[0]) for _, label in tl]
        ax.step(times, prefill + prefill[-1:], where="post")
    ax.axvspan(0, run.warmup, color="0.9", label="warm-up")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("prefill nodes")
    ax.set_title(f"Split over time ({run.label})")
    fig.tight_layout()
    fig.savefig(out / "split.png", dpi=100)
    plt.close(fig)

    end = run.warmup + run.duration
    ttft = np.sort([x.queued + x.ttft for x in records if x.status == "ok" and x.ttft is not None
                    and x.done_time is not None and run.warmup <= x.done_time < end])
    fig, ax = plt.subplots(figsize=(5, 3))
    if ttft.size:
        ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size)
        ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("CDF")
    fig.tight_layout()
    fig.savefig(out / "ttft_cdf.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    by = r.control.queueing_by_node
    ax.bar(list(by), list(by.values()))
    ax.set_ylabel("mean prefill queueing (s)")
    fig.tight_layout()
    fig.savefig(out / "queueing.png", dpi=100)
    plt.close(fig)
