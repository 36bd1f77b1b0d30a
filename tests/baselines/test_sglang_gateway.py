"""The SGLang Model Gateway's cache-aware rule (0.3 / 64 / 1.5) and round-robin decode."""

from types import SimpleNamespace

from evinfra.baselines.sglang import ApproximateTree, CacheAware, CacheAwareConfig, RoundRobin
from evinfra.router.strategy import DecodeOption

PAGE = 64
PATH = list(range(1000, 1100))  # 100 pages: a 6,400-token request


def view(nodes, path=PATH, t_in=None, now=0.0):
    return SimpleNamespace(nodes=nodes, path=SimpleNamespace(hashes=path),
                           t_in=t_in if t_in is not None else len(path) * PAGE, now=now)


def gateway(**kw) -> CacheAware:
    return CacheAware(CacheAwareConfig(**kw), PAGE)


def test_imbalance_needs_both_thresholds() -> None:
    g = gateway()
    g._tree("a").insert(PATH, 0.0)  # a holds the whole prefix
    g.load = {"a": 200, "b": 120}  # diff 80 > 64 and 200 > 1.5 * 120: imbalanced
    assert g.select(view(["a", "b"])) == "b" and g.last_rule == "imbalanced"
    g.load = {"a": 300, "b": 210}  # diff 90 > 64 but 300 < 1.5 * 210: balanced
    assert g.select(view(["a", "b"])) == "a" and g.last_rule == "match"
    g.load = {"a": 60, "b": 0}  # 60 > 1.5 * 0 but diff 60 <= 64: balanced
    assert g.select(view(["a", "b"])) == "a" and g.last_rule == "match"


def test_match_above_the_threshold_goes_to_the_owner_else_to_the_smallest_tree() -> None:
    g = gateway()
    g._tree("a").insert(PATH[:31], 0.0)  # 31 % of the request
    g._tree("b").insert(list(range(5000, 5050)), 0.0)  # 50 unrelated pages
    assert g.select(view(["a", "b", "c"])) == "a" and g.last_rule == "match"
    g2 = gateway()
    g2._tree("a").insert(PATH[:30], 0.0)  # exactly 30 %: not above the threshold
    g2._tree("b").insert(list(range(5000, 5010)), 0.0)
    assert g2.select(view(["a", "b"])) == "b" and g2.last_rule == "smallest"  # 10 < 30 pages
    assert g2.select(view(["a", "b", "c"])) == "c"  # an empty tree is the smallest


def test_the_selected_worker_learns_the_request_and_carries_its_load() -> None:
    g = gateway()
    v = view(["a", "b"])
    g.routed("r1", "b", v)
    assert g.load == {"b": 1} and g.trees["b"].match(PATH) == 100
    g.routed("r1", "a", v)  # routed again (withdrawn): the load moves
    assert g.load == {"a": 1, "b": 0}
    g.prefill_done("r1", "a")
    assert g.load["a"] == 1  # the gateway's load lasts until the response completes
    g.finished("r1", 1.0)
    assert g.load["a"] == 0


def test_the_approximate_tree_evicts_lru_deeper_first_on_its_interval() -> None:
    t = ApproximateTree(PAGE)
    t.insert(PATH[:10], 0.0)
    t.insert(PATH[:4] + [7, 8], 5.0)
    t.evict_to(6 * PAGE)
    assert t.match(PATH) == 4 and t.match(PATH[:4] + [7, 8]) == 6
    g = gateway(eviction_interval_s=120.0, max_tree_size=4 * PAGE)
    g._tree("a").insert(PATH[:10], 0.0)
    g.select(view(["a"], now=0.0))  # arms the interval
    g.select(view(["a"], now=100.0))
    assert g.trees["a"].size == 10 * PAGE
    g.select(view(["a"], now=120.0))
    assert g.trees["a"].size == 4 * PAGE


def test_round_robin_decode_binds_at_submit_in_turn() -> None:
    rr = RoundRobin()
    opts = [DecodeOption("d0", None, 9), DecodeOption("d1", 0, 0), DecodeOption("d2", 5, 1)]
    assert rr.at_submit
    assert [rr.choose(10, opts) for _ in range(5)] == ["d0", "d1", "d2", "d0", "d1"]
