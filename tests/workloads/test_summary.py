"""The client-side summary's reuse by wait and by tag, on records made by hand."""

from __future__ import annotations

import pytest

from evinfra.workloads.summary import summarise
from evinfra.workloads import RequestRecord


def rec(rid: str, branch: str, send: float, done: float | None, ideal: int, cached: int | None,
        status: str = "ok", tag: str = "") -> RequestRecord:
    return RequestRecord(rid, "a", "w", branch, None, tag, False, send, 1000, 10, ideal,
                         status=status, done_time=done, cached_tokens=cached)


def test_each_request_is_filed_under_the_wait_since_its_branch_last_answered():
    records = [
        rec("a1", "a", 10.0, 20.0, 0, 0),            # warm-up: only the previous of a2
        rec("a2", "a", 25.0, 30.0, 800, 800),        # 5 s after a1's answer
        rec("a3", "a", 90.0, 95.0, 900, 600),        # 60 s: the next bucket's lower bound
        rec("b1", "b", 50.0, 52.0, 400, 100),        # first of its branch
        rec("b2", "b", 60.0, None, 0, None, "pending"),
        rec("b3", "b", 700.0, 710.0, 1000, 400),     # 640 s after b2's send (no answer)
        rec("c1", "c", 200.0, 300.0, 0, 0, "error"),
        rec("c2", "c", 320.0, 330.0, 500, 500),      # 20 s after a failed request
    ]
    s = summarise(records, 22.0, 1000.0)
    by = s.reuse_by_wait
    got = {label: (x.requests, x.ideal_cached, x.cached) for label, x in by.items()}
    assert got == {"<10s": (1, 800, 800),       # a2
                   "10s-1m": (1, 500, 500),     # c2
                   "1-10m": (1, 900, 600),      # a3: 60 s is a minute, not under one
                   ">=10m": (1, 1000, 400),     # b3
                   "first": (1, 400, 100)}      # b1
    assert by["first"].lost_kv_reuse == pytest.approx(0.75)
    assert by["<10s"].lost_kv_reuse == 0
    lost = 300 + 300 + 600  # a3, b1, b3
    assert by[">=10m"].share_of_lost == pytest.approx(600 / lost)
    assert sum(x.share_of_lost for x in by.values()) == pytest.approx(1)
    assert s.requests == 5


def test_nothing_to_reuse_reads_zero():
    s = summarise([rec("a1", "a", 1.0, 2.0, 0, 0)], 0.0, 10.0)
    assert s.reuse_by_wait["first"].lost_kv_reuse == 0
    assert s.reuse_by_wait["first"].share_of_lost == 0
    assert summarise([], 0.0, 10.0).reuse_by_wait == {}


def test_each_tag_gets_the_share_of_its_prompts_an_unlimited_cache_holds_and_its_wait():
    """Fig. 2c's quantities: after a sub-agent call the prompt is mostly the parent's kept
    context; after a compaction only the system prompt matches. Untagged requests are not
    listed; what the cache actually reused does not enter (a workload property)."""
    records = [
        rec("t1", "p", 0.0, 10.0, 0, 0, tag="tool"),
        rec("s1", "p", 370.0, 380.0, 980, 0, tag="subagent"),   # 360 s after t1's answer
        rec("k1", "p", 400.0, 412.0, 900, 900, tag="compact"),  # a 12-s compaction call
        rec("r1", "p", 412.0, 420.0, 140, 140, tag="resume"),   # just after it
        rec("x1", "q", 5.0, 6.0, 500, 500),
    ]
    by = summarise(records, 0.0, 1000.0).reuse_by_tag
    assert set(by) == {"tool", "subagent", "compact", "resume"}
    assert (by["subagent"].ideal_share, by["subagent"].mean_wait) == (0.98, 360.0)
    assert (by["resume"].ideal_share, by["resume"].mean_wait) == (0.14, 0.0)
    assert by["compact"].mean_e2e == 12.0 and by["tool"].requests == 1
    records[1] = rec("s1", "p", 370.0, 380.0, 500, 0, tag="subagent")  # control
    assert summarise(records, 0.0, 1000.0).reuse_by_tag["subagent"].ideal_share == 0.5
