"""One report of a partitioned run: the cluster as a whole and each partition (paper D.2).

* cluster-wide: every partition's requests summarised together (throughput, TTFT/E2E
  percentiles, lost KV reuse), the prefill nodes summed per minute and the variation of the
  cluster's P/D ratio ((max - min) / mean over the scored minutes, paper: "varies by only
  7 %"), and the prefill queueing imbalance between partitions: per minute, the most queued
  partition's mean over the partitions' average (mean and max over the minutes);
* per partition: its own summary and control summary, its P/D ratio shift, and its mean
  queueing against the cluster's per minute (max and mean; paper: "queueing times up to
  13.9x the cluster average").

``report.json`` holds simulated quantities only, sorted and rounded: the same seed gives the
same bytes whether the partitions ran serially, in processes or on Ray.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import msgspec
import numpy as np

from evinfra.partitions.run import PartitionResult
from evinfra.sim.control import ControlSummary
from evinfra.workloads import RequestRecord
from evinfra.workloads.summary import Summary, round6, summarise

__all__ = ["ClusterView", "PartitionView", "PartitionedReport", "PartitionedRun", "merge",
           "pd_variation", "split_per_minute", "write"]


class PartitionedRun(msgspec.Struct, frozen=True):
    label: str
    policy: str
    seed: int
    warmup: float
    duration: float
    partitions: int
    nodes_per_partition: int
    binding: str
    load: str


class PartitionView(msgspec.Struct, frozen=True):
    name: str
    group: str
    nodes: int
    summary: Summary
    control: ControlSummary
    prefill_per_minute: list[int]
    pd_ratio_variation: float
    """(max - min) / mean of the partition's P/D ratio over the scored minutes."""
    mean_queueing: float
    queueing_vs_cluster_max: float
    """Max over the minutes of its mean prefill queueing over the cluster's."""
    queueing_vs_cluster_mean: float


class ClusterView(msgspec.Struct, frozen=True):
    summary: Summary
    nodes: int
    prefill_per_minute: list[int]
    pd_ratio_variation: float
    mean_queueing: float
    queueing_imbalance: float
    """Per minute, the most queued partition's mean over the partitions' average; the mean
    over the minutes (1: balanced)."""
    queueing_imbalance_max: float
    switches: int


class PartitionedReport(msgspec.Struct, frozen=True):
    run: PartitionedRun
    cluster: ClusterView
    partitions: list[PartitionView]


def split_per_minute(timeline: list[tuple[float, str]], start: float,
                        minutes: int) -> list[tuple[int, int]]:
    """``(prefill, decode)`` nodes served at the start of each scored minute."""
    out, i, p, d = [], 0, 0, 0
    for m in range(minutes):
        t = start + 60 * m
        while i < len(timeline) and timeline[i][0] <= t:
            label = timeline[i][1].split("+")[0]  # "3P5D+1C": one still collocated
            p, d = (int(x) for x in label.rstrip("D").split("P"))
            i += 1
        out.append((p, d))
    return out


def pd_variation(split: list[tuple[int, int]]) -> float:
    ratios = [p / d for p, d in split if d > 0 and p > 0]
    if not ratios:
        return 0.0
    return round6((max(ratios) - min(ratios)) / np.mean(ratios))


def _renamed(name: str, records: list[RequestRecord]) -> list[RequestRecord]:
    """Records whose ids name their partition: two partitions' ``cc-0:0`` are two branches."""
    return [msgspec.structs.replace(
        r, request_id=f"{name}/{r.request_id}", agent_id=f"{name}/{r.agent_id}",
        branch_id=f"{name}/{r.branch_id}",
        parent_branch_id=None if r.parent_branch_id is None else f"{name}/{r.parent_branch_id}")
        for r in records]


def merge(results: list[PartitionResult], run: PartitionedRun) -> PartitionedReport:
    start, end = run.warmup, run.warmup + run.duration
    minutes = max(1, int(run.duration // 60))
    # Per minute and partition: (sum of queueing, requests).
    per: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for res in results:
        for t, w in res.queueing:
            acc = per[int((t - start) // 60)][res.name]
            acc[0] += w
            acc[1] += 1
    cluster_mean = {m: sum(a[0] for a in v.values()) / sum(a[1] for a in v.values())
                    for m, v in per.items()}
    imbalance = []
    for v in per.values():
        means = [a[0] / a[1] for a in v.values()]  # the partitions that prefilled then
        avg = float(np.mean(means))
        if len(results) > 1 and avg > 0:
            imbalance.append(max(means) / avg)
    views, splits = [], []
    for res in results:
        split = split_per_minute(res.control.split_timeline, start, minutes)
        splits.append(split)
        vs = [(v[res.name][0] / v[res.name][1]) / cluster_mean[m]
              for m, v in sorted(per.items()) if res.name in v and cluster_mean[m] > 0]
        waits = [w for _, w in res.queueing]
        views.append(PartitionView(
            name=res.name, group=res.group, nodes=res.nodes,
            summary=summarise(res.records, start, end), control=res.control,
            prefill_per_minute=[p for p, _ in split], pd_ratio_variation=pd_variation(split),
            mean_queueing=round6(np.mean(waits)) if waits else 0.0,
            queueing_vs_cluster_max=round6(max(vs)) if vs else 0.0,
            queueing_vs_cluster_mean=round6(np.mean(vs)) if vs else 0.0))
    total = [(sum(s[m][0] for s in splits), sum(s[m][1] for s in splits))
             for m in range(minutes)]
    records = [r for res in results for r in _renamed(res.name, res.records)]
    waits = [w for res in results for _, w in res.queueing]
    cluster = ClusterView(
        summary=summarise(records, start, end), nodes=sum(r.nodes for r in results),
        prefill_per_minute=[p for p, _ in total], pd_ratio_variation=pd_variation(total),
        mean_queueing=round6(np.mean(waits)) if waits else 0.0,
        queueing_imbalance=round6(np.mean(imbalance)) if imbalance else 1.0,
        queueing_imbalance_max=round6(max(imbalance)) if imbalance else 1.0,
        switches=sum(r.control.switches for r in results))
    return PartitionedReport(run=run, cluster=cluster, partitions=views)


def encode(report: PartitionedReport) -> bytes:
    """``report.json``'s bytes."""
    return msgspec.json.format(msgspec.json.encode(report, order="sorted"), indent=2) + b"\n"


def write(out: Path, report: PartitionedReport, wall_s: float | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_bytes(encode(report))
    (out / "report.md").write_text(markdown(report, wall_s))


def markdown(r: PartitionedReport, wall_s: float | None = None) -> str:
    run, c = r.run, r.cluster
    s = c.summary
    lines = [
        f"# Partitioned simulation: {run.label}",
        "",
        f"- policy `{run.policy}`, seed {run.seed}, {run.partitions} partitions of "
        f"{run.nodes_per_partition} nodes ({c.nodes} in all), binding `{run.binding}`; "
        f"load {run.load}",
        f"- scored window {run.warmup:g}-{run.warmup + run.duration:g} s",
    ]
    if wall_s:
        simulated = (run.warmup + run.duration) * run.partitions
        lines.append(f"- wall time {wall_s:.1f} s; {simulated / wall_s:.1f} partition-seconds "
                     "simulated per wall second")
    lines += [
        "",
        "| cluster | value |",
        "|---|---|",
        f"| throughput (req/s) | {s.throughput:.4g} |",
        f"| TTFT mean / P50 / P95 (s) | {s.ttft.mean:.3g} / {s.ttft.p50:.3g} / {s.ttft.p95:.3g} |",
        f"| E2E mean / P50 / P95 (s) | {s.e2e.mean:.3g} / {s.e2e.p50:.3g} / {s.e2e.p95:.3g} |",
        f"| lost KV reuse | {100 * s.lost_kv_reuse:.2f} % |",
        f"| P/D ratio variation over the minutes | {100 * c.pd_ratio_variation:.1f} % |",
        f"| prefill queueing mean (s) | {c.mean_queueing:.3g} |",
        f"| queueing, worst partition / average, per minute: mean, max | "
        f"{c.queueing_imbalance:.3g}, {c.queueing_imbalance_max:.3g} |",
        f"| switches | {c.switches} |",
        "",
        "| partition | group | req/s | TTFT P95 (s) | E2E mean (s) | lost reuse | queueing (s) "
        "| vs cluster max / mean | P/D shift | final split |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in r.partitions:
        x = p.summary
        lines.append(f"| {p.name} | {p.group} | {x.throughput:.4g} | {x.ttft.p95:.3g} | "
                     f"{x.e2e.mean:.3g} | {100 * x.lost_kv_reuse:.2f} % | {p.mean_queueing:.3g} | "
                     f"{p.queueing_vs_cluster_max:.3g} / {p.queueing_vs_cluster_mean:.3g} | "
                     f"{100 * p.pd_ratio_variation:.1f} % | {p.control.final_split} |")
    lines += ["", "Prefill nodes per scored minute, cluster: "
              + " ".join(map(str, c.prefill_per_minute)), ""]
    return "\n".join(lines)
