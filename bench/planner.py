"""One planning decision beside a straightforward implementation, side by side in one run.

    python -m bench.planner [--quick]

Prints, for N = 9, 64 and 768 nodes and m = 10 slices, the time of one full decision of
``evinfra.planner.plan`` (move order, Θ of all N − 1 prefill counts on every slice, gains, the
2σ/√m test, the Decision object) and of the same algorithm written as loops over candidates,
slices and nodes with the NodeModel methods, the speed-up as a ratio, and whether both chose
the same split. Nodes are heterogeneous (coefficients ±10 % around the GB300/GLM-5.2 shape),
so every node's μ_D is evaluated at every candidate's B = n̄/|D|: O(N·m) per candidate
where an AM-HM bound does not show the prefill side to be the smaller. Each size runs twice:
without a KV capacity, and with a GB300 node's 2.06M tokens of GPU KV, which caps the decode
batch of the current split and of every candidate with fewer decode nodes.
Goal (issue 3): < 10 ms at 768 nodes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from evinfra.core.types import qk_pairs
from evinfra.planner import NodeModel, SliceWork, Split, plan

M = 10


def cluster(n: int, seed: int, kv_tokens: int) -> tuple[list[NodeModel], Split, list[SliceWork]]:
    """``n`` nodes, a third of them prefilling, each holding ``kv_tokens`` of GPU KV (0: not
    reported), and a window of coding-agent work whose decode concurrency grows with the
    cluster (about 18 requests in decode per node, ~80K tokens of KV each)."""
    rng = np.random.default_rng(seed)
    shape = dict(c0=0.02, c1=2e-5, c2=1e-10, c3=2e-7, d0=0.008, d1=0.014, d2=0.00036)
    models = [NodeModel(node=f"n{i}", k_over_e=8 / 256, t_fwd=2, t_bar=8192.0, f=0.2,
                        kv_tokens=kv_tokens,
                        **{k: v * rng.uniform(0.9, 1.1) for k, v in shape.items()})
              for i in range(n)]
    slices = []
    for i in range(M):
        t_uc, t_c = rng.uniform(2e3, 1.2e4, 200), rng.uniform(2e4, 1.2e5, 200)
        t_out = rng.uniform(700, 1100, 200)
        q = float(18 * n * rng.uniform(0.9, 1.1))  # in decode; 2 per node wait for prefill
        slices.append(SliceWork(start=60.0 * i, length=60.0, requests=200, t_uc=float(t_uc.mean()),
                                A=float(qk_pairs(t_uc, t_c).mean()), t_c=float(t_c.mean()),
                                t_out=float(t_out.mean()), t_acc=1.8, q=q, n=q + 2 * n,
                                kv=float(((t_uc + t_c + t_out) * t_out).sum() / t_out.sum())))
    names = [x.node for x in models]
    return models, Split.of(names, names[: n // 3]), slices


def straightforward(models: list[NodeModel], split: Split, slices: list[SliceWork]) -> Split | None:
    """Algorithm E.3 lines 17-28 as loops: per candidate, per slice, per node."""
    used = [s for s in slices if s.usable]
    by_name = {x.node: x for x in models}
    n, current = len(models), len(split.prefill)
    total = sum(s.requests for s in used)
    t_uc, A, t_c = (sum(s.requests * getattr(s, k) for s in used) / total  # noqa: N806
                    for k in ("t_uc", "A", "t_c"))
    B = statistics.fmean(s.n for s in used) / len(split.decode)  # noqa: N806
    advantage = {x.node: x.t_d_iter(B) / x.t_p_req(t_uc, t_c, A=A) for x in models}
    order = (sorted(sorted(split.prefill, reverse=True), key=lambda x: -advantage[x])
             + sorted(sorted(split.decode), key=lambda x: -advantage[x]))

    def theta(p: int, s: SliceWork) -> float:
        B = s.n / (n - p)  # noqa: N806
        mu_p = sum(by_name[x].mu_p(s.t_uc, s.t_c, A=s.A) for x in order[:p])
        mu_d = sum(by_name[x].mu_d(s.t_out, s.t_acc, min(B, by_name[x].kv_tokens / s.kv)
                                   if by_name[x].kv_tokens else B) for x in order[p:])
        return min(mu_p, mu_d)

    now = [theta(current, s) for s in used]
    best, best_mean = None, -math.inf
    for p in range(1, n):
        if p == current:
            continue
        gains = [theta(p, s) - t for s, t in zip(used, now)]
        mean = statistics.fmean(gains)
        if mean > 2 * statistics.stdev(gains) / math.sqrt(len(used)) and mean > best_mean:
            best, best_mean = p, mean
    return None if best is None else Split.of(order, order[:best])


def seconds(fn, repeat: int) -> tuple[float, object]:
    """Median wall time of ``repeat`` calls, and the last result."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the slow loop at 768 nodes")
    args = parser.parse_args()
    print(f"One planning decision, m = {M} slices, heterogeneous nodes (median wall time)")
    print(f"{'nodes':>6} {'KV cap':>6} {'candidates':>10} {'plan (ms)':>10} {'loops (ms)':>11} "
          f"{'speed-up':>9}  same choice  decision")
    for n, kv in ((n, kv) for n in (9, 64, 768) for kv in (0, 2_060_000)):
        models, split, slices = cluster(n, seed=n, kv_tokens=kv)
        cap = "GB300" if kv else "-"
        plan(models, split, slices, at=0.0)  # warm caches and imports
        fast, decision = seconds(lambda: plan(models, split, slices, at=0.0), 50 if n < 768 else 20)
        outcome = (f"{decision.split.label} -> "
                   f"{decision.chosen.label if decision.chosen else 'keep'}")
        if args.quick and n == 768:
            print(f"{n:>6} {cap:>6} {n - 1:>10} {fast * 1e3:>10.2f} {'-':>11} {'-':>9}  "
                  f"{'-':>11}  {outcome}")
            continue
        slow, chosen = seconds(lambda: straightforward(models, split, slices), 1 if n == 768 else 3)
        same = "yes" if chosen == decision.chosen else "NO"
        print(f"{n:>6} {cap:>6} {n - 1:>10} {fast * 1e3:>10.2f} {slow * 1e3:>11.1f} "
              f"{slow / fast:>8.0f}x  {same:>11}  {outcome}")
    print("goal: < 10 ms at 768 nodes")


if __name__ == "__main__":
    main()
