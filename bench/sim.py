"""Simulator speed: simulated requests per wall-clock second, and simulated over wall time.

    python -m bench.sim [--quick]

Runs the full control plane (service, router, planner, directory) on fake engines in virtual
time: ``cc`` with 126 agents on 9 nodes for 1.5 simulated hours (the paper's 30-minute
warm-up plus one scored hour), and 640 agents on 64 nodes. Bar (issue 6): >= 1,000 simulated
requests per second on one core; goal 10,000. ``--quick`` runs 15 simulated minutes each.

Also printed: the KV block events (blocks stored and removed, as the engines report them to
the directory) per request, and the wall time per such event. The cost of a simulated
request is mostly per moving block (each visits the directory's and the engine's per-block
tables), so these two say whether a change made blocks cheaper or fewer.
"""

from __future__ import annotations

import argparse
import logging
import time

import msgspec
import structlog

from evinfra.config import NodeConfig, load_config
from evinfra.sim.harness import RunSpec, simulate
from evinfra.workloads import Phase, make_workload


# The two runs: nodes and agents.
RUNS = ((9, 126), (64, 640))


def run(nodes: int, agents: int, seconds: float) -> tuple[int, float, int, int]:
    """Requests played, wall seconds, clock events and KV block events."""
    config = load_config("etc/cluster.toml")
    cluster = msgspec.structs.replace(
        config.cluster, nodes=[NodeConfig(name=f"n{i}") for i in range(nodes)],
        initial_prefill=max(1, nodes * 2 // 3))
    planner = msgspec.structs.replace(config.planner, t_learn=min(config.planner.t_learn,
                                                                  seconds / 3))
    config = msgspec.structs.replace(config, cluster=cluster, planner=planner)
    warmup = planner.t_learn
    spec = RunSpec(duration=seconds - warmup, warmup=warmup,
                   schedule=[Phase(seconds, {"cc": agents})])
    t = time.perf_counter()
    result = simulate(config, {"cc": make_workload("cc", 1)}, spec)
    wall = time.perf_counter() - t
    stats = result.service.directory.tree.stats
    return len(result.records), wall, result.events, stats.blocks_stored + stats.blocks_removed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    seconds = 900.0 if ap.parse_args().quick else 5400.0
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    print(f"cc agents on fake engines, {seconds:g} simulated seconds")
    print(f"{'nodes':>6}{'agents':>8}{'requests':>10}{'wall s':>9}{'req/s':>9}{'sim/wall':>10}"
          f"{'clock events/s':>16}{'blocks/req':>12}{'us/block':>10}"
          "   bar >= 1,000 req/s, goal 10,000")
    for nodes, agents in RUNS:
        n, wall, events, blocks = run(nodes, agents, seconds)
        print(f"{nodes:>6}{agents:>8}{n:>10}{wall:>9.1f}{n / wall:>9.0f}{seconds / wall:>9.0f}x"
              f"{events / wall:>16.0f}{blocks / n:>12.0f}{wall / blocks * 1e6:>10.2f}")


if __name__ == "__main__":
    main()
