"""The workload runner's own cost: requests per second of CPU time with a backend that does
nothing but answer.

    python -m bench.runner

The simulator's bar is 1,000 simulated requests per second all-in (issue 6), so the
workload side (the runner and ``cc``'s program generator) may take only a fraction of a
millisecond per request; bar here: >= 1,000 requests per CPU second for the runner alone
(4,500-6,500 measured on the 2-core dev box with the fitted ``cc``: 154-223 µs a request).
CPU time, not wall: other processes sharing the machine do not count against it.
"""

from __future__ import annotations

import time

import numpy as np

from evinfra.core.clock import VirtualClock
from evinfra.workloads import CC, Outcome, Phase, Runner

INF = float("inf")
RUNS = ((40, 1800.0), (126, 5400.0), (640, 1800.0))
"""Agents and simulated seconds."""


class PoolBackend:
    """Answers after 2 s with a slice of a fixed random pool: no per-request synthesis, so the
    time measured is the runner's (and the program generator's)."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.pool = np.random.default_rng(0).integers(1000, 32000, 1 << 20).astype(np.uint32)
        self.n = 0

    def send(self, request, done) -> None:
        self.n += 1
        off = (self.n * 7919) % (self.pool.size - 40_000)
        self.clock.call_later(2.0, done, Outcome(self.pool[off:off + request.max_tokens]))


def runner_rate(agents: int, until: float) -> tuple[float, int]:
    """Requests per CPU second of this process, and requests played."""
    backend = PoolBackend()
    runner = Runner(backend, {"cc": CC(0)}, stop_at=until)
    runner.closed_loop([Phase(INF, {"cc": agents})])
    start = time.process_time()
    backend.clock.run(until=until)
    cpu = time.process_time() - start
    return len(runner.records) / cpu, len(runner.records)


def main() -> None:
    print(f"{'agents':>7}{'sim s':>8}{'requests':>10}{'req/CPU-s':>11}{'us/req':>8}"
          "   bar >= 1,000 req/CPU-s")
    for agents, until in RUNS:
        rate, n = runner_rate(agents, until)
        print(f"{agents:>7}{until:>8.0f}{n:>10}{rate:>11,.0f}{1e6 / rate:>8.0f}")


if __name__ == "__main__":
    main()
