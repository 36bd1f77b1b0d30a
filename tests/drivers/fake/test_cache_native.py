"""The native cache and host order refuse bad input with Python exceptions, and stay usable:
a wrong call must never take the process down (issue 37)."""

import numpy as np
import pytest

from evinfra.core.contracts import HintDelta
from evinfra.core.types import Tier
from evinfra.directory.eviction import HostEvictionOrder
from evinfra.drivers.fake.cache import NodeCache

P = 4


def toks(path: list) -> np.ndarray:
    return np.arange(len(path) * P, dtype=np.uint32)


def test_bad_calls_raise_and_leave_the_cache_consistent() -> None:
    events: list = []
    c = NodeCache(P, 6 * P, 12 * P, True, events.append)
    a = [1, 2, 3, 4]
    c.insert(a, 4, toks(a), 1.0)
    c.lock(a, 2, 1.0)
    bad = [
        (ValueError, lambda: c.insert(a, 5, toks(a), 2.0)),  # more blocks than the path
        (ValueError, lambda: c.lock(a, -1, 2.0)),
        (ValueError, lambda: c.prefix(a, -1)),
        (ValueError, lambda: c.tier_prefix(a, 9, Tier.L1)),
        (ValueError, lambda: c.unlock(a, 4, 2.0)),  # blocks 3 and 4 are not pinned
        (ValueError, lambda: c.extend_lock(a, -2, 3, 2.0)),
        (KeyError, lambda: c.lock([7, 8], 2, 2.0)),  # not held
        (ValueError, lambda: c.lock([2], 1, 2.0)),  # block 2 is the second of its path
        (ValueError, lambda: c.insert([1, 2, 7, 3], 4, toks(a), 2.0)),  # not a hash chain
        (ValueError, lambda: c.insert([5, 6, 5], 3, toks(a), 2.0)),  # a block twice
        # Not from the root: refused once its new block 9 is claimed, which must be undone.
        (ValueError, lambda: c.insert([2, 9], 2, toks(a), 2.0)),
        (ValueError, lambda: c.insert(a, 4, toks(a), float("nan"))),
        (TypeError, lambda: c.insert(["x"], 1, toks(a), 2.0)),
        (TypeError, lambda: c.prefix(5)),
        (OverflowError, lambda: c.insert([2**64], 1, toks(a), 2.0)),
        (TypeError, lambda: c.lock(a, 2**70, 2.0)),
        (ValueError, lambda: c.reserve(2**60)),
        (TypeError, lambda: c.apply_hints(HintDelta(["x"], []))),  # type: ignore[list-item]
        (ValueError, lambda: NodeCache(0, P, P, True, events.append)),
        (ValueError, lambda: NodeCache(P, -1, P, True, events.append)),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
        c.check_invariants()
    c.unlock(a, 2, 3.0)
    assert c.insert(a + [5], 5, toks(a + [5]), 4.0) == (5, 0, 1)
    c.check_invariants()


def test_bad_orders_and_arrangements_raise_or_are_ignored() -> None:
    o = HostEvictionOrder()
    o.touch_all([1, 2, 3])
    for error, call in [(TypeError, lambda: o.touch_all(5)),
                        (TypeError, lambda: o.touch_all(["x"])),
                        (OverflowError, lambda: o.remove_all([2**63])),
                        (ZeroDivisionError, lambda: o.apply_hints(HintDelta([1], []),
                                                                  lambda b: 1 // 0))]:
        with pytest.raises(error):
            call()
        o.check_invariants()
    assert list(o.victims()) == [2, 3, 1]  # the failed arrangement's batch moved as hinted
    # An arrangement that names blocks the batch does not hold (or one twice) moves only
    # the batch's own blocks, once.
    o.apply_hints(HintDelta([2, 3], []), lambda b: [3, 3, 99, 2])
    assert list(o.victims()) == [1, 3, 2]
    assert "x" not in o and "x" not in o.positive and 2**70 not in o
    o.check_invariants()


def test_python_code_run_inside_a_native_call_cannot_call_back_in() -> None:
    c = NodeCache(P, 6 * P, 12 * P, True, lambda e: None)
    c.insert([1, 2], 2, toks([1, 2]), 1.0)

    class Sneaky:  # a block hash whose conversion clears the cache mid-call
        def __index__(self) -> int:
            c.clear()
            return 3

    with pytest.raises(RuntimeError):
        c.insert([1, 2, Sneaky()], 3, toks([1, 2, 3]), 2.0)
    c.check_invariants()
    o = HostEvictionOrder()
    o.touch_all([1, 2])
    with pytest.raises(RuntimeError):
        o.apply_hints(HintDelta([1, 2], []), lambda b: o.touch_all([5]) or b)
    o.check_invariants()
    assert list(o.victims()) == [1, 2] and 5 not in o
