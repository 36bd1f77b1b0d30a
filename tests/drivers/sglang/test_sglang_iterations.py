"""A patched engine's log of forward passes as the planner's reports
(``drivers/sglang/iterations.py``): each new pass once, moved onto the control plane's
clock; passes the engine no longer kept counted as missed; a new engine process read from
its first pass."""

from evinfra.core.events import IterationReport, PrefillItem
from evinfra.drivers.sglang.iterations import IterationTracker
from evinfra.engine_patch.wire import IterationLog, IterationRecord


def prefill(seq, start=100.0):
    return IterationRecord(seq, start, 0.5, prefill=[(f"r{seq}", 40, 8, 2)])


def test_new_passes_become_reports_once():
    t = IterationTracker("n0")
    got = t.take(IterationLog(1, [prefill(0, 100.0), IterationRecord(1, 101.0, 0.02, batch=3,
                                                                      accepted=3)]),
                 now=50.0, wall_now=102.0)
    assert got == [IterationReport("n0", 48.0, 0.5, [PrefillItem("r0", 40, 8, 2)]),
                   IterationReport("n0", 49.0, 0.02, batch=3, t_fwd=1, accepted=3)]
    assert t.after == 1 and t.missed == 0
    assert t.take(IterationLog(1, [prefill(1)]), 50.0, 102.0) == []  # seen already


def test_passes_gone_before_they_were_read_are_missed():
    t = IterationTracker("n0")
    t.take(IterationLog(9, [prefill(7), prefill(8), prefill(9)]), 0.0, 0.0)  # history
    assert (t.after, t.missed) == (9, 0)
    assert len(t.take(IterationLog(20, [prefill(18), prefill(20)]), 0.0, 0.0)) == 2
    assert (t.after, t.missed) == (20, 8 + 1)
    t.take(IterationLog(25, []), 0.0, 0.0)
    assert (t.after, t.missed) == (25, 14)


def test_a_restarted_engine_is_read_from_its_first_pass():
    t = IterationTracker("n0")
    t.take(IterationLog(40, [prefill(40)]), 0.0, 0.0)
    assert t.take(IterationLog(2, [prefill(0), prefill(1), prefill(2)]), 0.0, 0.0) == []
    assert t.after == -1
    assert len(t.take(IterationLog(2, [prefill(0), prefill(1), prefill(2)]), 0.0, 0.0)) == 3
