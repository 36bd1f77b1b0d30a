"""Stateful test: the fake engine's native cache against the pure-Python one it replaced.

Both caches (``evinfra.drivers.fake.cache.NodeCache`` over ``evinfra/native/src/cache.cpp``,
and ``tests/drivers/fake/reference_cache.py``) get the same random operations: inserts of
paths that share prefixes and fork, host-only stores (a peer fetch without L1 room), pins
taken, grown and released, room made and reserved, count hints (positive, zero, both,
resyncs), and clears. Simulated time often stands still, so the L1 heap's tie-breaks (access,
depth, push order) and the host order's regrouping are exercised. After every step the KV
events, the return values, the counters, every path's prefixes per tier, the held blocks and
the host eviction order must be the same.
"""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from evinfra.core.contracts import HintDelta
from evinfra.core.events import BlockRemoved, BlockStored
from evinfra.core.types import Tier
from evinfra.drivers.fake.cache import NodeCache
from tests.conftest import MIN_STEPS
from tests.drivers.fake.reference_cache import NodeCache as ReferenceCache

PAGE = 2
MAX_PATHS = 10
STEPS = {"n": 0}


def _event(ev: object) -> tuple:
    """An event as comparable values (token ids come as numpy views)."""
    if type(ev) is BlockStored:
        return ("stored", ev.medium, list(ev.block_hashes), ev.parent_block_hash,
                np.asarray(ev.token_ids).tolist(), ev.block_size)
    assert type(ev) is BlockRemoved
    return ("removed", ev.medium, list(ev.block_hashes))


class CacheMachine(RuleBasedStateMachine):
    make = NodeCache

    @initialize(l1=st.integers(1, 10), l2=st.integers(0, 40),
                aware=st.sampled_from([True, True, False]),
                first=st.lists(st.integers(1, 8), min_size=1, max_size=3))
    def setup(self, l1: int, l2: int, aware: bool, first: list[int]) -> None:
        self.events: list = []
        self.ref_events: list = []
        self.real = self.make(PAGE, l1 * PAGE, l2 * PAGE, aware, self.events.append)
        self.ref = ReferenceCache(PAGE, l1 * PAGE, l2 * PAGE, aware, self.ref_events.append)
        self.blocks = 0
        self.paths = [self._fresh(n) for n in first]
        self.pins: list[tuple[list[int], int]] = []
        self.reserved: list[int] = []
        self.now = 0.0

    def _fresh(self, n: int) -> list[int]:
        """``n`` new blocks: spread over int64, signs included, as SGLang's hashes are."""
        out = []
        for _ in range(n):
            self.blocks += 1
            out.append((self.blocks * 0x9E3779B97F4A7C15) % 2**64 - 2**63)
        return out

    def _path(self, i: int) -> list[int]:
        return self.paths[i % len(self.paths)]

    def _tick(self, dt: int) -> float:
        self.now += dt / 2
        return self.now

    def _both(self, name: str, *args: object) -> object:
        got = getattr(self.real, name)(*args)
        want = getattr(self.ref, name)(*args)
        assert got == want, (name, got, want)
        return got

    # -- paths ----------------------------------------------------------------------------

    @precondition(lambda self: len(self.paths) < MAX_PATHS)
    @rule(i=st.integers(0, MAX_PATHS), keep=st.floats(0, 1), extra=st.integers(1, 10),
          fresh=st.booleans())
    def new_path(self, i: int, keep: float, extra: int, fresh: bool) -> None:
        """A new path: a fresh one, or a fork of (or an append to) a known one."""
        STEPS["n"] += 1
        base = [] if fresh else self._path(i)
        self.paths.append(base[:round(keep * len(base))] + self._fresh(extra))

    # -- operations -------------------------------------------------------------------------

    def _store(self, op: str, i: int, drop: int, dt: int) -> None:
        """``op`` (``insert`` or ``store_host``) of ``path[:n]``, ``n`` short of the whole path
        by ``drop``."""
        STEPS["n"] += 1
        p = self._path(i)
        tokens = np.arange(len(p) * PAGE, dtype=np.uint32)
        self._both(op, p, max(0, len(p) - drop), tokens, self._tick(dt))

    @rule(i=st.integers(0, MAX_PATHS), drop=st.integers(0, 12), dt=st.integers(0, 2))
    def insert(self, i: int, drop: int, dt: int) -> None:
        """``path[:n]`` for an ``n`` short of the whole path by ``drop`` (a prefill's chunk)."""
        self._store("insert", i, drop, dt)

    @rule(i=st.integers(0, MAX_PATHS), dt=st.integers(0, 2))
    def insert_whole(self, i: int, dt: int) -> None:
        """The common case, weighted up: a request's whole path."""
        self.insert(i, 0, dt)

    @rule(i=st.integers(0, MAX_PATHS), drop=st.integers(0, 12), dt=st.integers(0, 2))
    def store_host(self, i: int, drop: int, dt: int) -> None:
        """``path[:n]`` into host memory only (a peer fetch that found no L1 room)."""
        self._store("store_host", i, drop, dt)

    @precondition(lambda self: len(self.pins) < 3)  # more would pin most of a small cache
    @rule(i=st.integers(0, MAX_PATHS), cut=st.floats(0, 1), dt=st.integers(0, 2))
    def lock(self, i: int, cut: float, dt: int) -> None:
        STEPS["n"] += 1
        p = self._path(i)
        k = round(cut * self._both("prefix", p))
        self._both("lock", p, k, self._tick(dt))
        self.pins.append((p, k))

    @precondition(lambda self: self.pins)
    @rule(j=st.integers(0, 100), grow=st.floats(0, 1), extend=st.booleans(),
          dt=st.integers(0, 2))
    def unlock(self, j: int, grow: float, extend: bool, dt: int) -> None:
        STEPS["n"] += 1
        p, k = self.pins.pop(j % len(self.pins))
        now = self._tick(dt)
        if extend:
            k2 = k + round(grow * max(0, self._both("prefix", p) - k))
            self._both("extend_lock", p, k, k2, now)
            self.pins.append((p, k2))
        else:
            self._both("unlock", p, k, now)

    @rule(i=st.integers(0, MAX_PATHS), data=st.data())
    def hints(self, i: int, data: st.DataObject) -> None:
        """Blocks of a path (held or not), host blocks and blocks never stored cross zero;
        a block may cross both ways in one delta; a resync replaces the positive set."""
        STEPS["n"] += 1
        pool = self._path(i) + list(self.ref.order.victims()) + [-1, -2]
        pos = data.draw(st.lists(st.sampled_from(pool), max_size=8, unique=True), label="pos")
        zero = data.draw(st.lists(st.sampled_from(pool), max_size=8, unique=True), label="zero")
        replace = data.draw(st.integers(0, 9), label="replace") == 0
        self._both("apply_hints", HintDelta(pos, [] if replace else zero, replace))

    @rule(i=st.integers(0, MAX_PATHS), data=st.data())
    def more_hints(self, i: int, data: st.DataObject) -> None:
        """Hints weighted up: they are what the host order is about."""
        self.hints(i, data)

    @precondition(lambda self: len(self.reserved) < 2)
    @rule(tokens=st.integers(0, 4 * PAGE))
    def reserve(self, tokens: int) -> None:
        STEPS["n"] += 1
        if self._both("reserve", tokens):
            self.reserved.append(tokens)

    @precondition(lambda self: self.reserved)
    @rule()
    def release(self) -> None:
        STEPS["n"] += 1
        self._both("release", self.reserved.pop())

    @rule(pick=st.integers(0, 30))
    def clear(self, pick: int) -> None:
        """The node is gone (rarely: it forgets everything the other rules built up)."""
        if pick == 0:
            self._both("clear")
            self.pins.clear()
            self.reserved.clear()

    # -- comparisons ------------------------------------------------------------------------

    @invariant()
    def same_events_and_state(self) -> None:
        if not hasattr(self, "real"):
            return
        assert [_event(e) for e in self.events] == [_event(e) for e in self.ref_events]
        self.events.clear()
        self.ref_events.clear()
        for attr in ("reserved", "l1_blocks", "l2_blocks", "locked_l1", "l1_used", "l2_used",
                     "free", "kv_room"):
            assert getattr(self.real, attr) == getattr(self.ref, attr), attr
        for p in self.paths:
            k = self._both("prefix", p)
            self._both("prefix", p, len(p) // 2)
            self._both("l1_prefix", p)
            self._both("l2_prefix", p)
            self._both("tier_prefix", p, k // 2, Tier.L2)
        for tier in (Tier.L1, Tier.L2):
            self._both("blocks", tier)
        assert list(self.real.order.victims()) == list(self.ref.order.victims())
        assert self.real.order.positive == self.ref.order.positive
        for p, k in self.pins:
            assert self.real.prefix(p) >= k, "a pinned block was evicted"
        self.real.check_invariants()
        self.ref.check_invariants()


def test_native_cache_agrees_with_reference() -> None:
    STEPS["n"] = 0
    run_state_machine_as_test(CacheMachine)
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0) // 2, f"only {STEPS['n']} steps ran"


# -- the machine must be able to fail ---------------------------------------------------------


def _hides_host_evictions(page, l1, l2, aware, emit):  # noqa: ANN001, ANN202
    return NodeCache(page, l1, l2, aware, lambda e: None if (
        type(e) is BlockRemoved and e.medium == Tier.L2.medium) else emit(e))


class _IgnoresZeroHints(NodeCache):
    def apply_hints(self, delta: HintDelta) -> None:
        super().apply_hints(HintDelta(delta.positive, [], delta.replace))


class _LeafLast(NodeCache):
    """Regroups hinted host blocks in hint order, as a plain ``HostEvictionOrder`` would
    without the cache's leaf-first arrangement."""

    def apply_hints(self, delta: HintDelta) -> None:
        if self.order.count_aware:
            self.order.apply_hints(delta)


class _HostStoreInL1(NodeCache):
    """Stores as ``insert`` does, in L1 with L2, dropping what finds no L1 room: the fake
    engine's fetch before ``store_host``."""

    def store_host(self, path, n, tokens, now):  # noqa: ANN001, ANN201
        k = self.prefix(path, n)
        return self.insert(path, n, tokens, now).resident - k


@pytest.mark.parametrize(
    "make", [_hides_host_evictions, _IgnoresZeroHints, _LeafLast, _HostStoreInL1],
    ids=["hides_host_evictions", "ignores_zero_hints", "leaf_last", "host_store_in_l1"])
def test_the_machine_catches_a_broken_cache(make) -> None:  # noqa: ANN001
    class Mutant(CacheMachine):
        pass

    Mutant.make = staticmethod(make)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Mutant, settings=settings(
            max_examples=500, phases=[Phase.generate], report_multiple_bugs=False,
            print_blob=False))
