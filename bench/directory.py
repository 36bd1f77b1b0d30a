"""Directory speed and memory beside the naive reference, measured side by side in one run.

    python -m bench.directory [--quick]

Prints: KV block events applied per second (stores and removals, one core), longest-prefix
lookup of a 128K-token request (2,048 blocks of 64) over 9 and 64 nodes (p50/p99), bytes per
(block, node) entry, and an agent step (E.1 hash + E.2 place) of an appended request; each next
to the reference model of ``evinfra.directory.reference`` with the speed-up as a ratio.
Goals (issue 37, the native core): >= 10,000,000 block events/s on one core; lookup p99 <=
50 us at 64 nodes; at most 68 bytes per entry (twice the 34 of the last pure-Python tree).
Bytes count the Python heap (tracemalloc) plus the native tables the tree reports.

Block events are timed three ways: the first pass over a fresh directory (its tables grow from
empty), and the steady state of a long-running one (the best of three more passes, its tables
at the working set's size), in wall time and per CPU second of this process (what the other
processes of a shared machine leave out). Lookups are timed per call in wall and thread CPU
time: a p99 in wall time on a shared machine is mostly the neighbours' preemptions.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from typing import NamedTuple

import numpy as np

from evinfra.core.events import BlockRemoved, BlockStored, KVEventBatch
from evinfra.core.hashing import PathHasher
from evinfra.core.types import Phase, Tier
from evinfra.directory import Directory
from evinfra.directory.reference import ReferenceDirectory

PAGE = 64


def _nodes(n: int) -> dict[str, Phase]:
    return {f"n{i}": (Phase.PREFILL if i % 2 else Phase.DECODE) for i in range(n)}


def _chains(count: int, blocks: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.getrandbits(63) - (1 << 62) for _ in range(blocks)] for _ in range(count)]


def bench_events(quick: bool) -> tuple[EventRates, EventRates]:
    """Blocks applied per second: 32-block chains stored (a GPU store and its write-through to
    host memory) then removed from both tiers, 9 nodes; each node's events of one chain
    come as one batch, as an engine publishes them."""
    chains = _chains(200 if quick else 2000, 32, 1)
    nodes = _nodes(9)
    names = list(nodes)
    events = []
    for i, c in enumerate(chains):
        n = names[i % len(names)]
        events.append((n, BlockStored(c, None, [], PAGE, medium="GPU")))
        events.append((n, BlockStored(c, None, [], PAGE, medium="CPU_PINNED")))
    for i, c in enumerate(chains):
        n = names[i % len(names)]
        events.append((n, BlockRemoved(c, medium="GPU")))
        events.append((n, BlockRemoved(c, medium="CPU_PINNED")))
    blocks = sum(len(e.block_hashes) for _, e in events)

    batches = [(n, KVEventBatch(0.0, [e, events[i + 1][1]]))
               for i, (n, e) in enumerate(events) if i % 2 == 0]

    def passes(apply, count: int) -> list[tuple[float, float]]:
        """Blocks per wall second and per CPU second of each pass (each leaves it empty)."""
        out = []
        for _ in range(count):
            t, c = time.perf_counter(), time.process_time()
            apply()
            out.append((blocks / (time.perf_counter() - t), blocks / (time.process_time() - c)))
        return out

    d = Directory(nodes, PAGE)

    def real() -> None:
        for n, b in batches:
            d.apply_batch(n, b)

    ref = ReferenceDirectory(nodes, PAGE)

    def naive() -> None:
        for n, e in events:
            tier = Tier.from_medium(e.medium)
            if isinstance(e, BlockStored):
                ref.store(n, e.block_hashes, tier)
            else:
                ref.remove(n, e.block_hashes, tier)

    first, *steady = passes(real, 4)
    ref_first, ref_steady = passes(naive, 2)
    return EventRates(first[0], max(w for w, _ in steady), max(c for _, c in steady)), \
        EventRates(ref_first[0], ref_steady[0], ref_steady[1])


class EventRates(NamedTuple):
    """Block events applied per second: first pass (wall), steady state (wall, CPU)."""

    first: float
    steady: float
    steady_cpu: float


def _populated(num_nodes: int, path: list[int], seed: int):
    rng = random.Random(seed)
    nodes = _nodes(num_nodes)
    d = Directory(nodes, PAGE)
    ref = ReferenceDirectory(nodes, PAGE)
    for n in nodes:
        k = rng.randrange(len(path) + 1)
        k1 = rng.randrange(k + 1)
        d.apply(n, BlockStored(path[:k], None, [], PAGE, medium="CPU_PINNED"))
        d.apply(n, BlockStored(path[:k1], None, [], PAGE, medium="GPU"))
        ref.store(n, path[:k], Tier.L2)
        ref.store(n, path[:k1], Tier.L1)
    return d, ref, list(nodes)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    a = np.array(samples) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def bench_lookup(num_nodes: int, quick: bool) -> tuple[tuple[float, float], tuple[float, float],
                                                       tuple[float, float]]:
    """A request's path as the router matches it: hashed (a ``HashedPath``), 2,048 pages.
    Returns (p50, p99) in wall time, in thread CPU time, and the reference's in wall time."""
    tokens = np.random.default_rng(7).integers(0, 150_000, size=2048 * PAGE, dtype=np.uint32)
    hashed = PathHasher(PAGE).hash(tokens)
    path = hashed.hashes
    d, ref, names = _populated(num_nodes, path, num_nodes)
    reps = 200 if quick else 2000
    for _ in range(20):  # the first calls warm the caches
        d.match(hashed)
    real, cpu = [], []
    for _ in range(reps):
        c = time.thread_time()
        t = time.perf_counter()
        d.match(hashed)
        real.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    naive = []
    for _ in range(max(3, reps // 150)):
        t = time.perf_counter()
        ref.union_prefix(path)
        for n in names:
            ref.own_prefix(n, path)
            ref.own_prefix(n, path, Tier.L1)
        naive.append(time.perf_counter() - t)
    return _percentiles(real), _percentiles(cpu), _percentiles(naive)


def bench_memory(quick: bool) -> tuple[float, float]:
    """Bytes per (block, node) entry: 9 nodes each holding 4,096 blocks (some shared)."""
    chains = _chains(8 if quick else 32, 1024, 3)
    nodes = _nodes(9)

    def measure(build):
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        obj = build()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return obj, after - before

    def build_real():
        d = Directory(nodes, PAGE)
        for i, n in enumerate(nodes):
            for c in chains[i % len(chains):][:4]:
                d.apply(n, BlockStored(c, None, [], PAGE, medium="CPU_PINNED"))
        return d

    def build_ref():
        r = ReferenceDirectory(nodes, PAGE)
        for i, n in enumerate(nodes):
            for c in chains[i % len(chains):][:4]:
                r.store(n, c, Tier.L2)
        return r

    d, real_bytes = measure(build_real)
    real_bytes += d.tree.memory()  # native tables: tracemalloc sees only the Python heap
    entries = d.tree.entries()
    _, ref_bytes = measure(build_ref)
    return real_bytes / entries, ref_bytes / entries


def bench_agent_step(quick: bool) -> tuple[float, float]:
    """E.1 + E.2 for the next request of a branch at a 128K context (64 new tokens)."""
    rng = np.random.default_rng(5)
    ctx = rng.integers(0, 150_000, size=128 * 1024, dtype=np.uint32)
    nodes = _nodes(9)
    d = Directory(nodes, PAGE)
    ref = ReferenceDirectory(nodes, PAGE)
    d.step("b", ctx)
    d.place("b", "n1")
    ref.step("b", ctx.tolist())
    ref.place("b", "n1")
    reps = 20 if quick else 100
    real = []
    for i in range(reps):
        ctx = np.concatenate([ctx, rng.integers(0, 150_000, size=PAGE, dtype=np.uint32)])
        t = time.perf_counter()
        d.step("b", ctx)
        d.place("b", "n1")
        real.append(time.perf_counter() - t)
    naive = []
    toks = ctx.tolist()
    for i in range(3):
        toks = toks + [1] * PAGE
        t = time.perf_counter()
        ref.step("b", toks)
        ref.place("b", "n1")
        naive.append(time.perf_counter() - t)
    return float(np.median(real)) * 1e6, float(np.median(naive)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = ap.parse_args()
    q = args.quick
    print(f"{'measure':<52}{'evinfra':>14}{'reference':>14}{'ratio':>9}")

    real, naive = bench_events(q)
    for label, a, b, goal in (
            ("KV block events/s, first pass (tables grow)", real.first, naive.first, ""),
            ("KV block events/s, steady (wall)", real.steady, naive.steady,
             "   goal >= 10,000,000/s"),
            ("KV block events/s, steady (per CPU second)", real.steady_cpu, naive.steady_cpu,
             "   goal >= 10,000,000/s")):
        print(f"{label:<52}{a:>14,.0f}{b:>14,.0f}{a / b:>8.1f}x{goal}")
    for n in (9, 64):
        (p50, p99), (c50, c99), (rp50, rp99) = bench_lookup(n, q)
        goal = "   goal p99 <= 50 us" if n == 64 else ""
        print(f"{f'prefix lookup 2,048 blocks, {n} nodes p50 (us)':<52}{p50:>14.1f}{rp50:>14.1f}"
              f"{rp50 / p50:>8.1f}x")
        print(f"{f'prefix lookup 2,048 blocks, {n} nodes p99 (us)':<52}{p99:>14.1f}{rp99:>14.1f}"
              f"{rp99 / p99:>8.1f}x{goal}")
        print(f"{f'  in thread CPU time: p50 {c50:.1f}, p99 {c99:.1f} (us)':<52}")
    real_b, ref_b = bench_memory(q)
    print(f"{'bytes per (block, node) entry':<52}{real_b:>14.0f}{ref_b:>14.0f}{ref_b / real_b:>8.1f}x"
          "   goal <= 68")
    real_s, ref_s = bench_agent_step(q)
    print(f"{'next request at 128K context: E.1+E.2 (us)':<52}{real_s:>14.0f}{ref_s:>14.0f}"
          f"{ref_s / real_s:>8.1f}x")


if __name__ == "__main__":
    main()
