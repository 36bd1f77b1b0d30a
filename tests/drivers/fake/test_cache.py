"""NodeCache: write-through, L1 -> L2 eviction, host eviction order, pins, and a stateful
machine whose reference is the cache's own KV events replayed into two sets."""

import msgspec
import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from evinfra.core.contracts import HintDelta
from evinfra.core.events import BlockRemoved, BlockStored
from evinfra.core.types import Tier
from evinfra.drivers.fake.cache import NodeCache

P = 4  # page size of these tests


def toks(path: list[int]) -> np.ndarray:
    return np.arange(len(path) * P, dtype=np.uint32)


def cache(l1: int, l2: int, count_aware: bool = True) -> tuple[NodeCache, list]:
    events: list = []

    def record(ev) -> None:  # token ids come as numpy views; compare them as lists
        if type(ev) is BlockStored:
            ev = msgspec.structs.replace(ev, token_ids=list(ev.token_ids))
        events.append(ev)

    return NodeCache(P, l1 * P, l2 * P, count_aware, record), events


def test_insert_writes_through_with_sglang_fields() -> None:
    c, ev = cache(10, 20)
    a = [11, 12, 13]
    assert c.insert(a, 3, toks(a), 1.0) == (3, 0, 3)
    assert ev == [BlockStored(a, None, list(range(12)), P, medium="GPU"),
                  BlockStored(a, None, list(range(12)), P, medium="CPU_PINNED")]
    ev.clear()
    b = a + [14, 15]
    assert c.insert(b, 5, toks(b), 2.0) == (5, 0, 2)
    assert ev[0] == BlockStored([14, 15], 13, list(range(12, 20)), P, medium="GPU")
    assert (c.prefix(b), c.prefix([11, 12, 99]), c.prefix([99])) == (5, 2, 0)
    assert c.l1_used == c.l2_used == 5 * P
    c.check_invariants()


def test_l1_eviction_drops_the_gpu_copy_only_and_takes_leaves_first() -> None:
    c, ev = cache(6, 20)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    c.insert(a, 4, toks(a), 1.0)
    ev.clear()
    c.insert(b, 4, toks(b), 2.0)
    assert ev[0] == BlockRemoved([3, 4], medium="GPU")  # only the tail of a, its leaf end
    assert c.l1_prefix(a) == 2 and c.l2_prefix(a) == 4 and c.blocks(Tier.L2) >= set(a)
    c.check_invariants()


def test_restore_loads_host_copies_back_without_a_second_host_store() -> None:
    c, ev = cache(4, 20)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    c.insert(a, 4, toks(a), 1.0)
    c.insert(b, 4, toks(b), 2.0)  # a is host-only now
    ev.clear()
    assert c.insert(a, 4, toks(a), 3.0) == (4, 4, 0)
    assert [type(e) for e in ev] == [BlockRemoved, BlockStored]
    assert ev[1].medium == "GPU" and ev[1].block_hashes == a
    c.check_invariants()


def test_pins_protect_blocks_and_limit_room() -> None:
    c, _ = cache(6, 20)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    c.insert(a, 4, toks(a), 1.0)
    c.lock(a, 4, 1.0)
    assert c.kv_room == 2 * P
    assert c.insert(b, 4, toks(b), 2.0).resident == 2  # only two blocks fit
    assert c.l1_prefix(a) == 4
    c.unlock(a, 4, 3.0)
    assert c.kv_room == 6 * P
    assert not c.reserve(7 * P) and c.reserve(6 * P) and c.l1_used == 6 * P
    c.check_invariants()


def _host_order_case(count_aware: bool) -> list[int]:
    c, ev = cache(3, 6, count_aware)
    a, b, x = [1, 2, 3], [4, 5, 6], [7, 8, 9]
    c.insert(a, 3, toks(a), 1.0)
    c.insert(b, 3, toks(b), 2.0)
    c.apply_hints(HintDelta(positive=a, zero=[]))  # a's branch is still active
    ev.clear()
    c.insert(x, 3, toks(x), 3.0)  # b leaves L1; L2 is full: three host blocks must go
    c.check_invariants()
    return [h for e in ev if type(e) is BlockRemoved and e.medium == "CPU_PINNED"
            for h in e.block_hashes]


def test_host_eviction_takes_zero_count_blocks_first() -> None:
    assert _host_order_case(count_aware=True) == [6, 5, 4]


def test_plain_lru_for_baselines_evicts_the_oldest() -> None:
    assert _host_order_case(count_aware=False) == [3, 2, 1]


def test_regrouped_host_blocks_join_their_group_oldest_segment_first_leaves_first() -> None:
    """Blocks a hint moves between the host groups are ordered by their segment's access
    time, each segment from its tail, so that eviction stays leaf-first; blocks in GPU
    memory or not held stay out of the host order."""
    c, _ = cache(6, 20)
    a, b, x = [1, 2, 3], [7, 8, 9], [20, 21, 22, 23, 24, 25]
    c.insert(a, 3, toks(a), 1.0)
    c.insert(b, 3, toks(b), 2.0)
    c.insert(x, 6, toks(x), 3.0)  # a and b leave L1: host-only now
    assert list(c.order.victims()) == [3, 2, 1, 9, 8, 7]
    c.apply_hints(HintDelta(positive=[7, 8, 9, 1, 2, 3, 20, 99], zero=[]))
    assert list(c.order.victims()) == [3, 2, 1, 9, 8, 7]  # all in the positive group
    assert c.order.positive == {1, 2, 3, 7, 8, 9, 20, 99}
    c.apply_hints(HintDelta(positive=[], zero=[9, 3, 1, 2, 7, 8, 20]))
    assert list(c.order.victims()) == [3, 2, 1, 9, 8, 7]
    c.apply_hints(HintDelta(positive=[9, 8, 7], zero=[]))
    assert list(c.order.victims()) == [3, 2, 1, 9, 8, 7]
    c.apply_hints(HintDelta(positive=[1, 2, 3], zero=[7, 8, 9]))
    assert list(c.order.victims()) == [9, 8, 7, 3, 2, 1]
    c.check_invariants()


def test_write_through_failure_leaves_l1_only_blocks_that_eviction_drops() -> None:
    c, ev = cache(4, 2)
    a = [1, 2, 3, 4]
    assert c.insert(a, 4, toks(a), 1.0).resident == 4
    assert c.l2_prefix(a) == 2 and c.l1_prefix(a) == 4
    ev.clear()
    c.insert([9], 1, toks([9]), 2.0)
    assert ev[0] == BlockRemoved([4], medium="GPU") and c.prefix(a) == 3
    c.check_invariants()


# -- stateful: the cache against its own events --------------------------------------------


class CacheMachine(RuleBasedStateMachine):
    """Random inserts, pins, hints and reservations on a small cache. After every step the
    KV events replayed into two sets must equal the cache's tiers (the directory's view is
    exact), pinned blocks must still be held, and the internal invariants must hold."""

    make = NodeCache

    @initialize(l1=st.integers(2, 12), l2=st.integers(1, 30), aware=st.booleans(),
                seed=st.integers(0, 2**16))
    def setup(self, l1: int, l2: int, aware: bool, seed: int) -> None:
        rnd = np.random.default_rng(seed)
        bases = [list(range(100 * i, 100 * i + 16)) for i in range(3)]
        self.paths = []
        for i in range(8):
            cut = int(rnd.integers(1, 16))
            tail = list(range(10_000 + 100 * i, 10_000 + 100 * i + int(rnd.integers(0, 6))))
            self.paths.append(bases[int(rnd.integers(0, 3))][:cut] + tail)
        self.events: list = []
        self.c = self.make(P, l1 * P, l2 * P, aware, self.events.append)
        self.l1: set[int] = set()
        self.l2: set[int] = set()
        self.pins: list[tuple[list[int], int]] = []
        self.reserved: list[int] = []
        self.now = 0.0

    def _path(self, i: int) -> list[int]:
        return self.paths[i % len(self.paths)]

    @rule(i=st.integers(0, 7), cut=st.floats(0, 1))
    def insert(self, i: int, cut: float) -> None:
        p = self._path(i)
        self.now += 1
        self.c.insert(p, round(cut * len(p)), toks(p), self.now)

    @rule(i=st.integers(0, 7))
    def lock(self, i: int) -> None:
        p = self._path(i)
        k = self.c.prefix(p)
        self.now += 1
        self.c.lock(p, k, self.now)
        self.pins.append((p, k))

    @precondition(lambda self: self.pins)
    @rule(j=st.integers(0, 100), extend=st.booleans())
    def unlock(self, j: int, extend: bool) -> None:
        p, k = self.pins.pop(j % len(self.pins))
        self.now += 1
        if extend:
            k2 = max(k, self.c.prefix(p))
            self.c.extend_lock(p, k, k2, self.now)
            self.pins.append((p, k2))
        else:
            self.c.unlock(p, k, self.now)

    @rule(i=st.integers(0, 7), data=st.data())
    def hints(self, i: int, data: st.DataObject) -> None:
        p = self._path(i)
        pos = data.draw(st.lists(st.sampled_from(p), max_size=4, unique=True))
        zero = data.draw(st.lists(st.sampled_from(p), max_size=4, unique=True))
        self.c.apply_hints(HintDelta(pos, [h for h in zero if h not in pos]))

    @rule(tokens=st.integers(0, 3 * P))
    def reserve(self, tokens: int) -> None:
        if self.c.reserve(tokens):
            self.reserved.append(tokens)

    @precondition(lambda self: self.reserved)
    @rule()
    def release(self) -> None:
        self.c.release(self.reserved.pop())

    @invariant()
    def events_describe_the_cache(self) -> None:
        for ev in self.events:
            tier = self.l1 if ev.medium == "GPU" else self.l2
            if type(ev) is BlockStored:
                assert not tier & set(ev.block_hashes), "stored twice"
                tier.update(ev.block_hashes)
            else:
                assert set(ev.block_hashes) <= tier, "removed what was not stored"
                tier.difference_update(ev.block_hashes)
        self.events.clear()
        assert self.l1 == self.c.blocks(Tier.L1)
        assert self.l2 == self.c.blocks(Tier.L2)
        for p, k in self.pins:
            assert self.c.prefix(p) >= k, "a pinned block was evicted"
        self.c.check_invariants()


MACHINE = settings(max_examples=40, stateful_step_count=50, deadline=None)
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = MACHINE


def _silent_host_evictions(page, l1, l2, aware, emit):  # noqa: ANN001, ANN202
    return NodeCache(page, l1, l2, aware, lambda e: None if (
        type(e) is BlockRemoved and e.medium == "CPU_PINNED") else emit(e))


def test_the_machine_catches_a_cache_that_hides_host_evictions() -> None:
    class Mutant(CacheMachine):
        make = staticmethod(_silent_host_evictions)

    with pytest.raises(AssertionError):
        run_state_machine_as_test(Mutant, settings=settings(MACHINE, phases=[Phase.generate],
                                                            report_multiple_bugs=False))
