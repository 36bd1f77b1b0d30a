"""Route-decision latency beside the directory lookup alone, measured in one run.

    python -m bench.router [--quick]

For 9 and 64 prefill-capable nodes, queues of 0-64 requests per node and contexts of 8K-128K
tokens, each sample routes the next request of an agent branch (its context plus 512 new
tokens): E.1 step, directory lookup, Eq. 7 on every node, choice, placement. A row is
labelled by its 16 branches' starting context; each grows by 25 x 512 tokens over the 400
samples. Each branch's previous request is routed in the setup, so the samples start from
the state serving leaves (a branch's path is looked up whenever it is hashed); a branch
whose next request goes to another node counts its whole context there (E.2). Printed:
p50/p99 of the whole decision and of ``Directory.match`` on the same path, and their ratio;
then the first route of new agents that share a system prompt (hashing and looking up their
context for the first time).
Goals (issue 4): p99 <= 200 us at 9 nodes / 32K, <= 1 ms at 64 nodes / 128K.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from evinfra.core.events import BlockStored
from evinfra.core.types import Phase
from evinfra.directory import Directory
from evinfra.router.router import Router, Routing

PAGE = 64


def setup(nodes: int, context: int, seed: int) -> tuple[Router, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    names = {f"n{i}": Phase.PREFILL for i in range(nodes)}
    names.update({f"d{i}": Phase.DECODE for i in range(2)})
    router = Router(Directory(names, PAGE))
    hasher = router.directory.branches.hasher
    contexts = []
    for a in range(16):  # agent branches whose prefixes sit on random nodes
        ctx = rng.integers(0, 150_000, size=context, dtype=np.uint32)
        path = hasher.hash(ctx).hashes
        for i in rng.choice(nodes, size=3, replace=False):
            k = int(rng.integers(len(path) // 2, len(path) + 1))
            for medium in ("GPU", "CPU_PINNED"):
                router.directory.apply(f"n{i}", BlockStored(path[:k], None, [], PAGE, medium=medium))
        router.route(Routing(f"prev{a}", f"b{a}", ctx, 256), 0.0)
        router.finished(f"prev{a}")
        contexts.append(ctx)
    for i in range(nodes):
        q = router._nodes[f"n{i}"].queue
        for j in range(int(rng.integers(0, 65))):
            q.add(f"bg{i}.{j}", int(rng.integers(100, 20_000)), int(rng.integers(0, context)), 0)
    return router, contexts


def run(nodes: int, context: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    router, contexts = setup(nodes, context, nodes * 1000 + context)
    rng = np.random.default_rng(1)
    route_t, match_t = [], []
    for s in range(samples):
        a = s % len(contexts)
        contexts[a] = np.concatenate([contexts[a], rng.integers(0, 150_000, size=512, dtype=np.uint32)])
        rid = f"r{s}"
        t = time.perf_counter()
        route = router.route(Routing(rid, f"b{a}", contexts[a], 256), float(s))
        route_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        router.directory.match(route.path)
        match_t.append(time.perf_counter() - t)
        router.finished(rid)
    return np.array(route_t) * 1e6, np.array(match_t) * 1e6


def run_new_agents(nodes: int, agents: int) -> np.ndarray:
    """First routes of new agents that share a 16K-token system prompt, each with 2K tokens
    of its own (no parent): the prompt is hashed and looked up once, then reused."""
    router, _ = setup(nodes, 8_192, nodes)
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 150_000, size=16_384, dtype=np.uint32)
    times = []
    for a in range(agents):
        ctx = np.concatenate([prompt, rng.integers(0, 150_000, size=2_048, dtype=np.uint32)])
        t = time.perf_counter()
        route = router.route(Routing(f"new{a}", f"agent{a}", ctx, 256), float(a))
        times.append(time.perf_counter() - t)
        if a < 3:  # the prefill of the first agents puts the prompt on their nodes
            router.directory.apply(route.node, BlockStored(route.path.hashes, None, [], PAGE,
                                                           medium="GPU"))
        router.finished(f"new{a}")
    return np.array(times[3:]) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    samples = 60 if args.quick else 400
    print(f"{'nodes':>6}{'context':>9}{'route p50 us':>14}{'route p99 us':>14}"
          f"{'lookup p50':>12}{'lookup p99':>12}{'route/lookup':>14}   goal")
    goals = {(9, 32_768): "p99 <= 200 us", (64, 131_072): "p99 <= 1,000 us"}
    for nodes in (9, 64):
        for context in (8_192, 32_768, 131_072):
            route, look = run(nodes, context, samples)
            r50, r99 = np.percentile(route, [50, 99])
            l50, l99 = np.percentile(look, [50, 99])
            print(f"{nodes:>6}{context:>9}{r50:>14.0f}{r99:>14.0f}{l50:>12.0f}{l99:>12.0f}"
                  f"{r50 / l50:>13.1f}x   {goals.get((nodes, context), '')}")
    print("\nfirst request of a new agent: 16K-token shared system prompt + 2K own tokens")
    print(f"{'nodes':>6}{'route p50 us':>14}{'route p99 us':>14}")
    for nodes in (9, 64):
        r50, r99 = np.percentile(run_new_agents(nodes, samples // 2), [50, 99])
        print(f"{nodes:>6}{r50:>14.0f}{r99:>14.0f}")


if __name__ == "__main__":
    main()
