"""The engine's host eviction key (1[R > 0], T_b): zero-count nodes go first, SGLang's own
order (LRU) within each group; checked against the directory's ``eviction_order``."""

import heapq
import random

from evinfra.directory.eviction import eviction_order
from evinfra.engine_patch.eviction import CountAwareHostOrder, EvictionStats
from evinfra.engine_patch.wire import CountHints


def victims(order: CountAwareHostOrder, nodes: dict[str, tuple[list[int], float]]) -> list[str]:
    """Pop nodes as SGLang's host eviction loop does, with the patched key."""
    heap = [(order.key(h, t), name) for name, (h, t) in nodes.items()]
    heapq.heapify(heap)
    return [heapq.heappop(heap)[1] for _ in range(len(heap))]


def test_zero_count_nodes_go_before_older_positive_ones():
    order = CountAwareHostOrder()
    nodes = {"old-kept": ([1, 2], 1.0), "old-gone": ([3], 2.0), "new-gone": ([4, 5], 5.0),
             "new-kept": ([6], 6.0)}
    assert victims(order, nodes) == ["old-kept", "old-gone", "new-gone", "new-kept"]  # LRU
    order.apply(CountHints(positive=[2, 6]))  # one positive page makes the node positive
    assert victims(order, nodes) == ["old-gone", "new-gone", "old-kept", "new-kept"]
    order.apply(CountHints(zero=[2]))  # its count went back to zero
    assert victims(order, nodes) == ["old-kept", "old-gone", "new-gone", "new-kept"]
    assert order.hints_applied == 2 and order.positive == {6}
    order.apply(CountHints(positive=[3], replace=True))  # a resync: only 3 is positive now
    assert victims(order, nodes) == ["old-kept", "new-gone", "new-kept", "old-gone"]
    assert order.positive == {3}


def test_single_block_nodes_follow_the_directorys_order():
    rng = random.Random(7)
    for _ in range(50):
        blocks = rng.sample(range(1, 1000), 30)
        t = {b: rng.random() for b in blocks}
        pos = set(rng.sample(blocks, 10))
        order = CountAwareHostOrder()
        order.apply(CountHints(positive=sorted(pos) + [5000]))  # hints may name absent blocks
        got = victims(order, {str(b): ([b], t[b]) for b in blocks})
        want = eviction_order(t, {b: 1 for b in pos})
        assert [int(x) for x in got] == list(want)


def test_stats_count_violations():
    s = EvictionStats(keep=2)
    s.record([1, 2], positive=False, zero_left=False, t=1.0)
    s.record([3], positive=True, zero_left=False, t=2.0)
    s.record([4], positive=True, zero_left=True, t=3.0)
    snap = s.snapshot()
    assert snap["evicted_zero_blocks"] == 2 and snap["evicted_positive_nodes"] == 2
    assert snap["violations"] == 1 and len(snap["recent"]) == 2
