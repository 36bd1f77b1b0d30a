"""Issue 43 (beyond the paper): how well the latency rule's estimate predicts the latency a
split serves, and the rule against the paper's rule in the issue's budget.

The prediction-error table (``evinfra experiment latency``): ``cc``, ``osworld`` and
``putnam``, each in a closed loop (fig. 6's middle agent count) and an open loop (Poisson
agent arrivals), evinfra at fixed splits (``planner.adapt = false``:
:func:`~evinfra.sim.sweep.fixed_split`). The fixed split's planner
still closes its windows when a decision would fall (:meth:`~evinfra.planner.planner.Planner.
review`): the window's slices and the models remeasured on them, exactly what a decision sees,
go into :func:`~evinfra.planner.planner.predict` with the window's active sources
(:attr:`~evinfra.planner.planner.Planner.sources`). Its column for the run's own split is set
against what the same requests measured (those that finished in the window, as the window
counts them), on the control plane's records: prefill wait (arrival to prefill start), TTFT
(arrival to first token) and E2E (arrival to the end). An open-loop agent's wait for admission
is not the cluster's, and neither side counts it. Predictions are averaged over the slices
weighted by their requests, so both sides average the same requests; a slice where the split
is predicted not to keep up (capacity ≤ 1) is counted apart, and one without a finite
prediction (the decode has no fixed point) is left out of the mean.

:func:`budget` compares the latency rule with the paper's rule where both ran (``tableD2``,
and ``fig6``/``fig7`` with ``--latency-rule``): throughput lost (the issue's budget: at most
3 %), extra switches per hour (at most 1), mean E2E and P95 TTFT.
"""

from __future__ import annotations

from typing import Callable, Iterable

import msgspec
import numpy as np

from evinfra.config import Config
from evinfra.core.events import RequestDone
from evinfra.control import Service
from evinfra.experiments.common import closed, label, rate_factor, served, system
from evinfra.experiments.report import Cell, ExperimentReport, Table
from evinfra.experiments.runs import RunOutcome, RunPlan
from evinfra.experiments.runs import execute as execute_run
from evinfra.experiments.runs import run_plans as run_all
from evinfra.experiments.scale import Scale
from evinfra.planner.itermodel import NodeModel
from evinfra.planner.planner import Planner, Split, predict
from evinfra.planner.window import SliceWork
from evinfra.sim.harness import RunSpec
from evinfra.workloads import poisson_arrivals

__all__ = ["BUDGET", "Reviewed", "TITLE", "budget", "execute", "observe", "plans", "report",
           "run_plans", "score"]

TITLE = "Issue 43: the latency estimate against measured latency at fixed splits"
CLOSED = {"cc": 108, "osworld": 144, "putnam": 256}
"""Closed-loop agents at the paper's scale (fig. 6's middle settings)."""
OPEN = {"cc": 1.0, "osworld": 1.5, "putnam": 4.0}
"""Open-loop agent arrivals per minute at the paper's scale (cc: table D.2's middle rate)."""
CAP = 258
"""At most this many open-loop agents at once at the paper's scale (table D.2's cap)."""
SPLITS = (2, 4, 6, 7)
"""Prefill counts at full scale (a scale's ``sweep`` replaces them)."""
QUANTITIES = ("wait", "ttft", "e2e")
NAMES = {"wait": "prefill wait", "ttft": "TTFT", "service": "prefill time", "e2e": "E2E"}
BUDGET = {"throughput_lost": 0.03, "switches_per_hour": 1.0}
"""Issue 43: the latency rule loses at most 3 % throughput and adds at most one switch per
hour against the paper's rule."""


# -- what a fixed split's planner sees, and what its requests measured -----------------------


class Reviewed(msgspec.Struct, frozen=True, kw_only=True):
    """One window of a fixed-split run: the planner's view at its end, and the requests that
    finished in it, as the control plane measured them."""

    start: float
    end: float
    split: Split
    slices: list[SliceWork]
    models: list[NodeModel]
    """Every node's model, remeasured on the window (as :func:`plan` takes them)."""
    sources: list[float] | None = None
    """The active sources of each slice (:attr:`Planner.sources`, as :func:`plan` takes them)."""
    wait: list[float]
    ttft: list[float]
    e2e: list[float]
    arrivals: list[float]
    """Control-plane arrival times of those requests."""
    prefill: list[float]
    """Their prefill, from its start to the first token."""
    fetched: list[int]
    """Tokens each fetched from a peer's cache before its prefill (Eq. 7's fetch time, which
    the estimate's Eq. 3 service time leaves out)."""


class _Probe:
    """Reviews the fixed split's planner at every window end and keeps each finished
    request's times."""

    def __init__(self, service: Service, end: float) -> None:
        if not isinstance(service.planner, Planner) or service.planner.adapts:
            raise ValueError("the probe needs evinfra's planner at a fixed split "
                             "(planner.adapt = false)")
        self.planner, self.clock, self.end = service.planner, service.clock, end
        self.done: list[RequestDone] = []
        self.windows: list[Reviewed] = []
        service.bus.subscribe(RequestDone, self._on_done)
        self.clock.call_at(self.planner.warmup_end, self._tick)

    def _on_done(self, d: RequestDone) -> None:
        if d.status == "ok" and d.first_token is not None and d.prefill_start is not None:
            self.done.append(d)

    def _tick(self) -> None:
        now = self.clock.now()
        if self.planner.warming_up or now < self.planner.window_end:
            self.clock.call_at(max(self.planner.window_end, now + 1e-3), self._tick)
            return
        self.review(now)
        if self.planner.window_end <= self.end:
            self.clock.call_at(self.planner.window_end, self._tick)

    def review(self, now: float) -> None:
        start = self.planner.window_end - self.planner.config.t_win
        slices = self.planner.review(now)
        mine = [d for d in self.done if start <= d.end < now]
        self.done = [d for d in self.done if d.end >= now]
        p = self.planner
        self.windows.append(Reviewed(
            start=start, end=now, split=p.split, slices=slices,
            models=[p.models[n] for n in p.nodes], sources=p.sources,
            wait=[d.prefill_start - d.arrival for d in mine],
            ttft=[d.first_token - d.arrival for d in mine],
            e2e=[d.end - d.arrival for d in mine],
            arrivals=sorted(d.arrival for d in mine),
            prefill=[d.first_token - d.prefill_start for d in mine],
            fetched=[d.fetched_tokens for d in mine]))


def observe(plan: RunPlan) -> tuple[RunOutcome, list[Reviewed]]:
    """Play a fixed-split plan with the probe: the outcome, and its windows that lie in the
    scored period."""
    probes: list[_Probe] = []
    start, end = plan.spec.warmup, plan.spec.warmup + plan.spec.duration
    outcome = execute_run(plan, on_start=lambda s: probes.append(_Probe(s, end)))
    probe = probes[0]
    if not probe.planner.warming_up and probe.planner.window_end <= end + 1e-9:
        probe.review(probe.planner.window_end)  # the window that ends with the run
    return outcome, [w for w in probe.windows if w.start >= start - 1e-9 and w.end <= end + 1e-9]


def score(windows: list[Reviewed]) -> dict[str, float]:
    """Predicted against measured over ``windows`` (see the module docstring): for the
    split's own column ``pred_Q`` and ``meas_Q`` (Q in :data:`QUANTITIES`, and ``service``:
    prefill start to first token, predicted as the batch's time ``Latency.prefill``), for
    every candidate ``pred_e2e_{p}P`` (a mean without a finite value is left out);
    ``unstable``: the share of requests in slices where the split is predicted not to keep up
    (capacity ≤ 1); ``rho``: the predicted prefill load; the measured squared
    coefficients of variation of the requests' inter-arrival times (``arrival_scv``, 1 for
    Poisson) and of their prefill times (``prefill_scv``, 1 for M/M/c's exponential
    service); ``fetched``: the share of requests that fetched KV from a peer, and
    ``service_fetched`` their mean prefill time."""
    if not windows:
        raise ValueError("no window in the scored period")
    n = len(windows[0].models)
    own = len(windows[0].split.prefill) - 1
    weights, rows = [], {q: [] for q in (*QUANTITIES, "service")}
    every, capacity, rho, gaps = [], [], [], []
    for w in windows:
        used = [s for s in w.slices if s.usable]
        if not used:
            continue
        _, lat = predict(w.models, w.split, w.slices, w.sources)
        weights.append([s.requests for s in used])
        for q in QUANTITIES:
            rows[q].append(getattr(lat, q))
        rows["service"].append(lat.prefill)
        every.append(lat.e2e)
        capacity.append(lat.capacity[:, own])
        rate = np.array([s.requests / s.length for s in used])
        rho.append(rate * lat.service[:, own] / (own + 1))
        gaps.extend(np.diff(w.arrivals).tolist())
    weight = np.concatenate(weights).astype(float)

    def mean(x: np.ndarray) -> float:
        ok = np.isfinite(x)
        return float(np.average(x[ok], weights=weight[ok])) if ok.any() and weight[ok].sum() \
            else float("nan")

    out: dict[str, float] = {}
    for q in (*QUANTITIES, "service"):
        out[f"pred_{q}"] = mean(np.concatenate(rows[q])[:, own])
        got = [x for w in windows for x in getattr(w, "prefill" if q == "service" else q)]
        out[f"meas_{q}"] = float(np.mean(got)) if got else float("nan")
    e2e = np.concatenate(every)
    for p in range(1, n):
        out[f"pred_e2e_{p}P"] = mean(e2e[:, p - 1])
    out["unstable"] = float(weight[~(np.concatenate(capacity) > 1.0)].sum() / weight.sum())
    out["rho"] = mean(np.concatenate(rho))
    out["requests"] = float(sum(len(w.e2e) for w in windows))
    out["windows"] = float(len(windows))
    out["arrival_scv"] = _scv(gaps)
    out["prefill_scv"] = _scv([x for w in windows for x in w.prefill])
    fetching = [t for w in windows for t, n in zip(w.prefill, w.fetched, strict=True) if n]
    out["fetched"] = len(fetching) / max(out["requests"], 1.0)
    out["service_fetched"] = float(np.mean(fetching)) if fetching else float("nan")
    # JSON has no NaN: a quantity without a finite value (every slice unstable) is left out.
    return {k: v for k, v in out.items() if np.isfinite(v)}


def _scv(x: list[float]) -> float:
    a = np.asarray(x, dtype=float)
    return float(a.var() / a.mean() ** 2) if a.size > 1 and a.mean() > 0 else float("nan")


def execute(plan: RunPlan) -> RunOutcome:
    """One run, its scores in :attr:`RunOutcome.extras`."""
    outcome, windows = observe(plan)
    return msgspec.structs.replace(outcome, extras=score(windows))


def run_plans(plans: Iterable[RunPlan], jobs: int = 1,
              progress: Callable[[RunOutcome, int, int], None] | None = None
              ) -> dict[str, RunOutcome]:
    """:func:`~evinfra.experiments.runs.run_plans` with the probe in every run."""
    return run_all(plans, jobs, progress, play=execute)


# -- the experiment --------------------------------------------------------------------------


def splits(scale: Scale) -> tuple[int, ...]:
    return scale.sweep or SPLITS


def plans(config: Config, scale: Scale, seed: int) -> list[RunPlan]:
    out = []
    end = scale.warmup + scale.duration
    for w in CLOSED:
        per_s = OPEN[w] * rate_factor(scale) / 60.0
        arrivals = []
        for a in poisson_arrivals({w: per_s}, seed):
            if a.time >= end:
                break
            arrivals.append(a)
        for p in splits(scale):
            cfg = system(config, "evinfra", prefill=p, fixed=True)
            out.append(closed(f"{w}-closed-{p}P", f"fixed {label(config, p)}", cfg, scale, seed,
                              {w: scale.count(CLOSED[w])}))
            key = f"{w}-open-{p}P"
            spec = RunSpec(duration=scale.duration, warmup=scale.warmup, arrivals=arrivals,
                           max_active=scale.count(CAP), label=key)
            out.append(RunPlan(key=key, system=f"fixed {label(config, p)}",
                               config=served(scale.configure(cfg), [w]), workloads=[w],
                               seed=seed, spec=spec))
    return out


def _err(pred: float, meas: float) -> float | None:
    """Relative error ``(predicted − measured) / measured``."""
    if not np.isfinite(pred) or not np.isfinite(meas) or meas <= 0:
        return None
    return float(f"{(pred - meas) / meas:.4g}")


def report(runs: dict[str, RunOutcome], scale: Scale, config_path: str, seed: int):
    rows, summary, across = [], [], []
    for w in CLOSED:
        for loop in ("closed", "open"):
            played = [(p, runs[k]) for p in splits(scale) if (k := f"{w}-{loop}-{p}P") in runs]
            errs: dict[str, list[float]] = {q: [] for q in ("wait", "ttft", "service", "e2e")}
            for p, o in played:
                x = _Extras(o.extras)
                row: list[Cell] = [w, loop, o.initial_split, int(x["requests"]),
                                   x["pred_wait"], x["meas_wait"]]
                if np.isfinite(x["pred_wait"]):
                    errs["wait"].append(abs(x["pred_wait"] - x["meas_wait"]))
                for q in ("ttft", "service", "e2e"):
                    e = _err(x[f"pred_{q}"], x[f"meas_{q}"])
                    row += [x[f"pred_{q}"], x[f"meas_{q}"], e]
                    if e is not None:
                        errs[q].append(abs(e))
                rows.append(row + [100 * x["unstable"], x["rho"], x["arrival_scv"],
                                   x["prefill_scv"], 100 * x["fetched"],
                                   x["service_fetched"]])
            if played:
                summary.append([w, loop, len(played)] + [
                    float(f"{np.mean(e):.3g}") if e else None for e in errs.values()])
                across.append(_across(w, loop, played))
    tables = [
        Table(title="Predicted against measured at each fixed split (s)",
              columns=["workload", "loop", "split", "requests", "prefill wait predicted",
                       "prefill wait measured"]
              + [f"{NAMES[q]} {m}" for q in ("ttft", "service", "e2e")
                 for m in ("predicted", "measured", "rel. error")]
              + ["unstable slices (% of requests)", "predicted prefill load ρ",
                 "arrival SCV", "prefill time SCV", "fetched from a peer (%)",
                 "their prefill time (s)"],
              rows=rows,
              note="Predicted: the planner's estimate (planner/latency.py) for the run's own "
                   "split at each window end, from that window's slices and remeasured "
                   "models, weighted by the slices' requests; measured: the same requests' "
                   "control-plane times. Prefill time: from the prefill's start to the first "
                   "token (the estimate's batch time b·S). Relative error (predicted − "
                   "measured) / measured. Unstable: slices where the split's predicted "
                   "capacity is at most the slice's rate. SCV: squared coefficient of "
                   "variation, 1 for the model's Poisson arrivals and exponential prefill "
                   "times."),
        Table(title="Mean error per workload and loop, over the splits",
              columns=["workload", "loop", "splits", "prefill wait, mean |error| (s)",
                       "TTFT, mean |rel. error|", "prefill time, mean |rel. error|",
                       "E2E, mean |rel. error|"],
              rows=summary),
        Table(title="What the rule decides on: the split each estimate ranks first",
              columns=["workload", "loop", "measured best (mean E2E)",
                       "predicted best, own runs", "predicted E2E of the measured best "
                       "from the other splits' runs (s)", "its measured E2E (s)"],
              rows=across,
              note="A decision predicts every candidate from the window of the split it "
                   "runs: the fifth column is that, averaged over the other splits' runs."),
    ]
    notes = [f"Closed loop: {', '.join(f'{w} {scale.count(n)}' for w, n in CLOSED.items())} "
             f"agents; open loop: {', '.join(f'{w} {r:g}' for w, r in OPEN.items())} "
             f"agents/min at the paper's scale ({rate_factor(scale):.3g}x that simulated), "
             f"at most {scale.count(CAP)} at once."]
    return ExperimentReport(name="latency", title=TITLE, scale=scale.describe(),
                            config=config_path, seed=seed, tables=tables, notes=notes,
                            runs=runs), []


def _across(w: str, loop: str, played: list[tuple[int, RunOutcome]]) -> list[Cell]:
    best = min(played, key=lambda x: _Extras(x[1].extras)["meas_e2e"])
    predicted = min(played, key=lambda x: _Extras(x[1].extras)["pred_e2e"])
    others = [_Extras(o.extras)[f"pred_e2e_{best[0]}P"] for p, o in played if p != best[0]]
    finite = [x for x in others if np.isfinite(x)]
    return [w, loop, best[1].initial_split, predicted[1].initial_split,
            float(np.mean(finite)) if finite else None, _Extras(best[1].extras)["meas_e2e"]]


class _Extras(dict):
    """A run's scores; one :func:`score` left out (no finite value) reads as inf."""

    def __missing__(self, key: str) -> float:
        return float("inf")


# -- the latency rule against the paper's rule -----------------------------------------------


BUDGET_COLUMNS = ["throughput, paper's rule (req/s)", "throughput, latency rule (req/s)",
                  "throughput lost (%)", "switches/h, paper's rule", "switches/h, latency rule",
                  "mean E2E, paper's (s)", "mean E2E, latency (s)", "P95 TTFT, paper's (s)",
                  "P95 TTFT, latency (s)", "within budget"]


def budget(paper: RunOutcome, latency: RunOutcome, hours: float) -> list[Cell]:
    """The latency rule's run against the paper's rule's over ``hours`` scored
    (:data:`BUDGET_COLUMNS`)."""
    a, b = paper.summary, latency.summary
    lost = 1 - b.throughput / a.throughput if a.throughput else 0.0
    per_h = (paper.control.switches / hours, latency.control.switches / hours)
    ok = (lost <= BUDGET["throughput_lost"]
          and per_h[1] - per_h[0] <= BUDGET["switches_per_hour"])
    return [a.throughput, b.throughput, float(f"{100 * lost:.3g}"), per_h[0], per_h[1],
            a.e2e.mean, b.e2e.mean, a.ttft.p95, b.ttft.p95, "yes" if ok else "no"]
