"""The hint outbox: one merged message does what each delta sent in turn would."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from evinfra.core.contracts import HintDelta
from evinfra.directory.eviction import HostEvictionOrder
from evinfra.drivers.sglang.hints import HintOutbox
from evinfra.engine_patch.wire import CountHints


def engine_apply(positive: set[int], msg: CountHints | HintDelta) -> set[int]:
    """An engine's positive set after one message (the engine patch's semantics)."""
    order = HostEvictionOrder()
    order.reset_hints(positive)
    order.apply_hints(HintDelta(list(msg.positive), list(msg.zero), msg.replace))
    return set(order.positive)


def test_a_block_last_crossing_wins():
    box = HintOutbox()
    box.add(HintDelta([1, 2], [3]))
    box.add(HintDelta([3], [1]))
    assert not box.take().replace
    box.add(HintDelta([1, 2], [3]))
    box.add(HintDelta([3], [1]))
    msg = box.take()
    assert (sorted(msg.positive), msg.zero) == ([2, 3], [1])
    assert not box and box.take() == CountHints([], [])


def test_a_resync_supersedes_what_waits_and_takes_later_deltas():
    box = HintOutbox()
    box.add(HintDelta([1], [2]))
    box.add(HintDelta([5, 6], [], replace=True))
    box.add(HintDelta([7], [5]))
    assert box.take() == CountHints([6, 7], [], replace=True)


def test_a_failed_message_goes_back_before_what_came_since():
    box = HintOutbox()
    box.add(HintDelta([1, 2], []))
    failed = box.take()
    box.add(HintDelta([], [2]))
    box.put_back(failed)
    msg = box.take()
    assert (msg.positive, msg.zero) == ([1], [2])
    # A resync that came since supersedes the failed message.
    box.add(HintDelta([1], []))
    failed = box.take()
    box.add(HintDelta([4], [], replace=True))
    box.put_back(failed)
    assert box.take() == CountHints([4], [], replace=True)


deltas = st.lists(st.tuples(
    st.lists(st.integers(0, 12), unique=True), st.lists(st.integers(0, 12), unique=True),
    st.booleans(), st.sampled_from(["add", "send", "lost", "landed"])), max_size=40)


@given(deltas, st.sets(st.integers(0, 12)))
def test_sent_messages_leave_the_engine_as_every_delta_in_turn_would(steps, start):
    box = HintOutbox()
    want, got = set(start), set(start)
    for pos, zero, replace, then in steps:
        zero = [h for h in zero if h not in pos]
        delta = HintDelta(pos, [] if replace else zero, replace)
        want = engine_apply(want, delta)
        box.add(delta)
        if then == "send":
            got = engine_apply(got, box.take())
        elif then == "lost":  # failed on the way: it goes back
            box.put_back(box.take())
        elif then == "landed":  # applied, but the answer was lost: it goes back too
            msg = box.take()
            got = engine_apply(got, msg)
            box.put_back(msg)
    got = engine_apply(got, box.take())
    assert got == want
