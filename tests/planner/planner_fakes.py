"""Synthetic engines and workloads for the planner tests (fixtures in ``conftest.py``).

``TRUTH`` has coefficients shaped like the paper's GB300/GLM-5.2 nodes (Figure 5): a prefill of
8K uncached tokens after a 128K cached prefix takes ~0.3 s, a decode iteration 17-45 ms for
B = 8..64 (k/E = 8/256, t_fwd = 2). Measured times are the model's times with multiplicative
Gaussian noise (4 %, the middle of the 3-5 % the issue asks for).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from evinfra.core.events import IterationReport, PrefillItem
from evinfra.planner import Decision, NodeModel, Planner, PlannerConfig

TRUTH = NodeModel(node="truth", c0=0.02, c1=2e-5, c2=1e-10, c3=2e-7, d0=0.008, d1=0.014,
                  d2=0.00036, k_over_e=8 / 256, t_fwd=2, t_bar=8192.0, f=0.0)
CHUNK = 8192
"""Chunked-prefill token budget per iteration (E.3 "Parameters of our runs")."""
T_ACC = 1.8
"""Accepted tokens per request per decode iteration with t_fwd = 2 (MTP, one draft token)."""


def heterogeneous(node: str, rng: np.random.Generator, spread: float) -> NodeModel:
    """TRUTH with every coefficient scaled by U(1 − spread, 1 + spread): same hardware, not
    the same node."""
    scale = {k: getattr(TRUTH, k) * rng.uniform(1 - spread, 1 + spread)
             for k in ("c0", "c1", "c2", "c3", "d0", "d1", "d2")}
    return NodeModel(node=node, k_over_e=TRUTH.k_over_e, t_fwd=TRUTH.t_fwd, t_bar=CHUNK, f=0.0,
                     **scale)


class Synth:
    """Iteration reports an engine with known coefficients would publish."""

    def __init__(self, seed: int, noise: float = 0.04) -> None:
        self.rng = np.random.default_rng(seed)
        self.noise = noise

    def measured(self, seconds: float) -> float:
        return float(seconds) * (1 + self.rng.normal(0, self.noise))

    def prefill(self, node: str, chunks: list[tuple[int, int, int]], start: float = 0.0,
                truth: NodeModel = TRUTH, names: list[str] | None = None) -> IterationReport:
        """One prefill iteration of ``chunks`` = [(t_uc, t_c, t_rst), ...]."""
        t_uc, t_c, t_rst = np.array(chunks, dtype=float).T
        names = names or [f"r{i}" for i in range(len(chunks))]
        return IterationReport(
            node=node, start=start, duration=self.measured(truth.t_p_iter(t_uc, t_c, t_rst)),
            prefill=[PrefillItem(r, *c) for r, c in zip(names, chunks)])

    def decode(self, node: str, B: int, start: float = 0.0, truth: NodeModel = TRUTH,  # noqa: N803
               context: float = 0.0) -> IterationReport:
        """One decode iteration; ``context`` tokens per request add 1 ms per million tokens
        read (App. B.4), a term Eq. 2 leaves out."""
        seconds = truth.t_d_iter(B) + 1e-9 * B * context
        return IterationReport(node=node, start=start, duration=self.measured(seconds), batch=B,
                               t_fwd=truth.t_fwd, accepted=round(T_ACC * B))

    def busy_node(self, node: str, seconds: float, truth: NodeModel = TRUTH,
                  start: float = 0.0) -> list[IterationReport]:
        """What a busy collocated node reports in ``seconds`` (Algorithm E.3 line 1).

        Agent requests arrive at 1.5/s with 256-24K uncached tokens after a 0-200K cached
        prefix (a third of which was restored from host memory); the node alternates one
        chunked-prefill iteration (≤ 8,192 tokens) with one decode iteration of its running
        requests, which leave after 50-1,500 output tokens.
        """
        rng = self.rng
        out: list[IterationReport] = []
        queue: list[list] = []  # [name, t_uc left, t_c, t_rst, chunks done]
        running: list[float] = []  # output tokens left
        t, arrived, n, prefill_turn = start, start, 0, True
        while t < start + seconds:
            while arrived <= t:
                cached = 0 if rng.random() < 0.2 else int(np.exp(rng.uniform(np.log(1e3),
                                                                               np.log(2e5))))
                restored = cached if rng.random() < 1 / 3 else 0
                queue.append([f"{node}-{n}", int(np.exp(rng.uniform(np.log(256), np.log(24e3)))),
                              cached, restored, 0])
                n += 1
                arrived += rng.exponential(1 / 1.5)
            if queue and (prefill_turn or not running):
                chunks, names, budget = [], [], CHUNK
                while queue and budget:
                    req = queue[0]
                    take = min(req[1], budget)
                    chunks.append((take, req[2], req[3] if req[4] == 0 else 0))
                    names.append(req[0])
                    req[1], req[2], req[4], budget = req[1] - take, req[2] + take, 1, budget - take
                    if req[1] == 0:
                        queue.pop(0)
                        running.append(float(np.exp(rng.uniform(np.log(50), np.log(1500)))))
                report = self.prefill(node, chunks, t, truth, names)
            elif running:
                report = self.decode(node, min(len(running), 256), t, truth)
                running = [left - T_ACC for left in running if left > T_ACC]
            else:
                t = arrived
                continue
            out.append(report)
            t += report.duration
            prefill_turn = not prefill_turn
        return out


# -- workloads for the planner ------------------------------------------------------------


@dataclass
class Workload:
    """Per-request work drawn uniformly from these ranges, and the requests in decode (none
    wait for prefill: in flight are those in decode)."""

    rate: float
    t_uc: tuple[float, float]
    t_c: tuple[float, float]
    t_out: tuple[float, float]
    q: float


PUTNAM = Workload(rate=2.0, t_uc=(1e3, 3e3), t_c=(1e4, 6e4), t_out=(2e3, 6e3), q=200)
"""Decode-heavy: one branch per problem, long reasoning outputs (6.1)."""
OSWORLD = Workload(rate=6.0, t_uc=(1.5e4, 2.5e4), t_c=(3e4, 9e4), t_out=(150, 450), q=40)
"""Prefill-heavy: a screenshot appended to the context at every step (6.1)."""


@dataclass
class Cluster:
    """Drives a :class:`Planner` the way the service does: warmup records from busy
    collocated nodes, then per-slice observations of a workload, then decide at window end."""

    planner: Planner
    synth: Synth
    truths: dict[str, NodeModel]
    decisions: list[Decision] = field(default_factory=list)

    def warmup(self) -> None:
        p = self.planner
        start = p.warmup_end - p.config.t_learn
        for node, truth in self.truths.items():
            for report in self.synth.busy_node(node, p.config.t_learn, truth, start):
                p.observe_iteration(report)
        assert p.ready(p.warmup_end)
        p.finish_warmup(p.warmup_end)

    def window(self, slices: list[Workload], bursts: dict[int, int] | None = None,
               drain: bool = True) -> Decision:
        """Feed one window whose slice i follows ``slices[i]``; ``bursts[i]`` sub-agents start
        at once in slice i (each reads a fresh 100K-token context and answers briefly).
        Then decide."""
        p, rng = self.planner, self.synth.rng
        cfg = p.config
        start, dt = p.window_end - cfg.t_win, cfg.t_win / cfg.m
        for i, wl in enumerate(slices):
            t0 = start + i * dt
            spawned = (bursts or {}).get(i, 0)
            for t, extra in ((t0, spawned), (t0 + dt / 2, 0)):
                q = wl.q * rng.uniform(0.95, 1.05) + extra
                p.observe_population(t, q, q)
            for _ in range(rng.poisson(wl.rate * dt)):
                p.observe_request(t0 + rng.uniform(0, dt), rng.uniform(*wl.t_uc),
                                  rng.uniform(*wl.t_c), rng.uniform(*wl.t_out))
            for _ in range(spawned):
                p.observe_request(t0 + rng.uniform(0, dt), 1e5, 2e3, 800)
            batch = max(1, round(wl.q / len(p.split.decode)))
            for k, node in enumerate(p.split.decode):
                p.observe_iteration(self.synth.decode(node, batch, t0 + k * 1e-3,
                                                      self.truths[node]))
            for k, node in enumerate(p.split.prefill):
                t_c = rng.uniform(*wl.t_c)
                chunks = [(CHUNK, int(t_c), int(t_c * 0.2))]
                p.observe_iteration(self.synth.prefill(node, chunks, t0 + k * 1e-3,
                                                       self.truths[node]))
        decision = p.decide(p.window_end)
        self.decisions.append(decision)
        if drain and decision.chosen is not None:
            for node in sorted(p.draining):
                p.drained(node, decision.at + 5)
        return decision


def make_cluster(prefill: int = 6, nodes: int = 9, seed: int = 0, spread: float = 0.05,
                 **config) -> Cluster:
    """Nine heterogeneous nodes (±5 % around TRUTH), 6P3D (the paper's initial split, 6.1),
    a one-minute warmup unless ``config`` says otherwise."""
    synth = Synth(seed)
    names = [f"n{i}" for i in range(nodes)]
    truths = {n: heterogeneous(n, synth.rng, spread) for n in names}
    planner = Planner(PlannerConfig(**{"t_learn": 60.0, **config}), names, names[:prefill],
                      start=0.0)
    return Cluster(planner, synth, truths)
