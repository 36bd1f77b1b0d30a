"""The engine's log of forward passes (``engine_patch/iterations.py``): numbered from 0, the
last ``capacity`` kept, timed without overlapping passes counting their shared time twice,
host loads charged to a request's first chunk only, and what the route serves as JSON."""

import msgspec

from evinfra.engine_patch.iterations import IterationRecorder
from evinfra.engine_patch.wire import IterationLog, IterationRecord, decode_iterations


def test_passes_are_numbered_and_the_last_ones_kept():
    log = IterationRecorder(capacity=3)
    assert log.since(-1) == IterationLog(-1, [])
    for i in range(5):
        log.decode(10.0 + i, 10.02 + i, 110.02 + i, batch=i + 1, t_fwd=1, accepted=i + 1)
    assert [r.seq for r in log.since(-1).records] == [2, 3, 4]
    assert [r.batch for r in log.since(3).records] == [5]
    assert log.since(4) == IterationLog(4, []) and log.since(0).last == 4


def test_a_pass_launched_before_the_previous_result_starts_when_that_ends():
    """Without overlap a pass runs from its launch; with it (launched while the previous one
    still ran) from the previous result, so back-to-back passes add up to the time taken."""
    log = IterationRecorder()
    log.decode(0.0, 0.03, 1000.03, batch=2, t_fwd=1, accepted=2)  # alone
    log.decode(0.10, 0.13, 1000.13, batch=2, t_fwd=1, accepted=2)  # after an idle gap
    log.decode(0.12, 0.16, 1000.16, batch=2, t_fwd=1, accepted=2)  # launched at 0.12 < 0.13
    log.decode(0.15, 0.19, 1000.19, batch=2, t_fwd=1, accepted=2)
    got = [(round(r.start, 6), round(r.duration, 6)) for r in log.since(-1).records]
    assert got == [(1000.0, 0.03), (1000.1, 0.03), (1000.13, 0.03), (1000.16, 0.03)]


def test_a_host_load_counts_in_the_first_chunk_only():
    log = IterationRecorder()
    log.prefill(1.0, 1.5, 101.5, [("a", 8192, 100, 64)])   # a's first chunk: its load
    log.prefill(1.5, 1.9, 101.9, [("a", 1000, 8292, 64), ("b", 50, 0, 32)])  # a continues
    got = [r.prefill for r in log.since(-1).records]
    assert got == [[("a", 8192, 100, 64)], [("a", 1000, 8292, 0), ("b", 50, 0, 32)]]


def test_the_wire_form_round_trips():
    log = IterationRecorder()
    log.prefill(0.0, 0.5, 1.5, [("r-p1", 40, 8, 0)])
    log.decode(1.0, 1.25, 2.25, batch=4, t_fwd=2, accepted=6)
    body = msgspec.json.encode(log.since(-1))
    assert decode_iterations(body) == IterationLog(1, [
        IterationRecord(0, 1.0, 0.5, prefill=[("r-p1", 40, 8, 0)]),
        IterationRecord(1, 2.0, 0.25, batch=4, t_fwd=2, accepted=6)])
    assert b'"batch"' not in msgspec.json.encode(log.since(-1).records[0])  # defaults left out
