"""Stateful test: the native host eviction order against the pure-Python one it replaced.

``evinfra.directory.eviction.HostEvictionOrder`` (over ``evinfra/native/src/host_order.cpp``)
and the reference in ``tests/drivers/fake/reference_cache.py`` get the same touches (repeated
blocks, blocks of both groups), removals (held or not), hints (positive, zero, both, resyncs;
with and without an arrangement of the moving blocks), resets, in both modes (count-aware and
plain LRU). After every step the eviction order, with and without pins, the positive set and
the membership must be the same. The cache machine (test_cache_machine.py) drives the order
only through the fake engine's cache: count-aware hints arranged leaf-first, never a plain
LRU order's hints, a caller's arrangement or a reset.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from evinfra.core.contracts import HintDelta
from evinfra.directory.eviction import HostEvictionOrder
from tests.conftest import MIN_STEPS
from tests.drivers.fake.reference_cache import HostEvictionOrder as ReferenceOrder

BLOCKS = st.integers(-4, 24)
DISTINCT = st.lists(BLOCKS, max_size=8, unique=True)
ARRANGE = {"none": None, "reversed": lambda b: b[::-1], "sorted": sorted}
STEPS = {"n": 0}


class HostOrderMachine(RuleBasedStateMachine):
    make = HostEvictionOrder

    @initialize(aware=st.booleans())
    def setup(self, aware: bool) -> None:
        self.real = self.make(aware)
        self.ref = ReferenceOrder(aware)

    @rule(blocks=st.lists(BLOCKS, max_size=8))
    def touch_all(self, blocks: list[int]) -> None:
        STEPS["n"] += 1
        self.real.touch_all(iter(blocks))  # any iterable, as reversed(...) in the engines
        self.ref.touch_all(blocks)

    @rule(blocks=st.lists(BLOCKS, max_size=8))
    def remove_all(self, blocks: list[int]) -> None:
        STEPS["n"] += 1
        self.real.remove_all(blocks)
        self.ref.remove_all(blocks)

    @rule(pos=DISTINCT, zero=DISTINCT, replace=st.integers(0, 6),
          arrange=st.sampled_from(sorted(ARRANGE)))
    def apply_hints(self, pos: list[int], zero: list[int], replace: int, arrange: str) -> None:
        STEPS["n"] += 1
        delta = HintDelta(pos, [] if replace == 0 else zero, replace == 0)
        self.real.apply_hints(delta, ARRANGE[arrange])
        self.ref.apply_hints(delta, ARRANGE[arrange])

    @rule(pos=DISTINCT)
    def reset_hints(self, pos: list[int]) -> None:
        STEPS["n"] += 1
        self.real.reset_hints(pos)
        self.ref.reset_hints(pos)

    @invariant()
    def same_order(self) -> None:
        if not hasattr(self, "real"):
            return
        assert list(self.real.victims()) == list(self.ref.victims())
        odd = lambda h: h % 2 == 1  # noqa: E731
        assert list(self.real.victims(odd)) == list(self.ref.victims(odd))
        assert self.real.positive == self.ref.positive
        assert len(self.real) == len(self.ref)
        assert [h in self.real for h in range(-4, 25)] == [h in self.ref for h in range(-4, 25)]
        assert self.real.count_aware == self.ref.count_aware
        self.real.check_invariants()
        self.ref.check_invariants()


def test_native_host_order_agrees_with_reference() -> None:
    STEPS["n"] = 0
    run_state_machine_as_test(HostOrderMachine)
    profile = settings.get_current_profile_name()
    assert STEPS["n"] >= MIN_STEPS.get(profile, 0) // 2, f"only {STEPS['n']} steps ran"


class _TouchKeepsPlace(HostEvictionOrder):
    """Touching a held block leaves it where it was (a FIFO, not an LRU)."""

    def touch_all(self, blocks) -> None:  # noqa: ANN001
        super().touch_all([h for h in blocks if h not in self])


class _HintsNeverLeave(HostEvictionOrder):
    """Zero hints do not take blocks out of the positive group."""

    def apply_hints(self, delta: HintDelta, arrange=None) -> None:  # noqa: ANN001
        super().apply_hints(HintDelta(delta.positive, [], delta.replace), arrange)


@pytest.mark.parametrize("make", [_TouchKeepsPlace, _HintsNeverLeave],
                         ids=["touch_keeps_place", "hints_never_leave"])
def test_the_machine_catches_a_broken_order(make) -> None:  # noqa: ANN001
    class Mutant(HostOrderMachine):
        pass

    Mutant.make = make
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Mutant, settings=settings(
            max_examples=500, phases=[Phase.generate], report_multiple_bugs=False,
            print_blob=False))
