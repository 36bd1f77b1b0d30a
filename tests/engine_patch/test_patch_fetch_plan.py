"""Re-cutting the router's fetch plan against what the engine holds when the request arrives."""

from evinfra.core.hashing import block_hashes
from evinfra.engine_patch.fetch_plan import Segment, segments
from evinfra.engine_patch.wire import FetchPlan, FetchRunWire

TOKENS = list(range(10, 10 + 4 * 8))  # 8 pages of 4
PATH = block_hashes(TOKENS, 4)


def plan(*runs):
    return FetchPlan(4, [FetchRunWire(p, s, PATH[s:e]) for p, s, e in runs])


def test_the_plan_as_sent_when_the_engine_holds_its_own_prefix():
    segs, why = segments(plan(("a:1", 2, 5), ("b:1", 5, 7)), PATH, 2, 4)
    assert segs == [Segment("a:1", 2, 5), Segment("b:1", 5, 7)] and why == ""
    assert sum(s.pages for s in segs) == 5


def test_pages_held_meanwhile_are_not_fetched():
    segs, _ = segments(plan(("a:1", 2, 5), ("b:1", 5, 7)), PATH, 6, 4)
    assert segs == [Segment("b:1", 6, 7)]
    assert segments(plan(("a:1", 2, 5)), PATH, 5, 4) == ([], "already held")


def test_a_gap_makes_the_plan_useless():
    segs, why = segments(plan(("a:1", 3, 5)), PATH, 1, 4)
    assert segs == [] and why.startswith("gap")


def test_a_stale_plan_is_cut_where_it_stops_matching():
    bad = FetchPlan(4, [FetchRunWire("a:1", 2, PATH[2:4] + [12345] + PATH[5:6])])
    segs, why = segments(bad, PATH, 2, 4)
    assert segs == [Segment("a:1", 2, 4)] and "block 4" in why
    # A plan longer than the request's path ends with the path.
    assert segments(plan(("a:1", 6, 8)), PATH[:7], 6, 4)[0] == [Segment("a:1", 6, 7)]


def test_page_size_must_be_the_engines():
    assert segments(plan(("a:1", 0, 2)), PATH, 0, 16)[0] == []
