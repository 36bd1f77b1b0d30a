"""Dynamo: the KV router's cost, the load planner's thresholds and rebalances, and the
relaunch that takes a switched node out of service and drops its KV (paper A.1, A.3, C.1)."""

from types import SimpleNamespace

import pytest
from baseline_harness import Sim, config, merged, raw_config, tokens

from evinfra.baselines.dynamo import KVRouter, KVRouterConfig, LoadPlanner, LoadPlannerConfig
from evinfra.config import parse_config
from evinfra.core.contracts import NodeLoad
from evinfra.core.events import PhaseSwitched, SplitChanged
from evinfra.planner.planner import Split

PAGE = 64


def view(t_in, own, own_l1, nodes=("a", "b")):
    return SimpleNamespace(nodes=list(nodes), t_in=t_in, own=lambda n: own[n],
                           own_l1=lambda n: own_l1[n], last_chosen=lambda n: 0,
                           predict=lambda n: SimpleNamespace(node=n))


def test_kv_router_cost_credits_gpu_hits_fully_and_host_hits_at_three_quarters() -> None:
    r = KVRouter(KVRouterConfig(), PAGE)
    v = view(100 * PAGE, own={"a": 40, "b": 40}, own_l1={"a": 40, "b": 0})
    # prefill = 100 - credit; decode = 100 (no active requests).
    assert r.score(v, "a")[0] == pytest.approx(60 + 100)
    assert r.score(v, "b")[0] == pytest.approx(100 - 0.75 * 40 + 100)
    assert r.choose(v).node == "a"
    r.routed("q1", "a", v)  # a is now busy with 60 new blocks of 100
    assert r.score(v, "a")[0] == pytest.approx(60 + 60 + 100 + 100)
    assert r.choose(v).node == "b"
    r.prefill_done("q1", "a")  # the first token ends its activity on a prefill worker
    assert r.score(v, "a")[0] == pytest.approx(160)


def loads(**by):
    return [NodeLoad(n, ph, q, 0.0, d, cap) for n, (ph, q, d, cap) in by.items()]


def planner(prefill=("a", "b"), nodes=("a", "b", "c", "d")) -> LoadPlanner:
    p = LoadPlanner(LoadPlannerConfig(), list(nodes), prefill, start=0.0, context_length=1000)
    p.finish_warmup(0.0)
    return p


def test_thresholds_and_only_opposing_rebalances() -> None:
    p = planner()
    # Prefill queue at the context length, decode KV below 60 %: one decode node moves.
    p.observe_loads(0.0, loads(a=("prefill", 1000, 0, 10), b=("prefill", 0, 0, 10),
                               c=("decode", 0, 5, 10), d=("decode", 0, 5, 10)))
    assert p.proposal() == (1, -1)
    d = p.decide(0.0)
    assert d.chosen == Split.of("abcd", "abd") and "d relaunches" in d.reason
    # The decision is the planner's new split, d relaunching until it is drained.
    assert p.split == d.chosen and p.draining == {"d"} and d.split == Split.of("abcd", "ab")
    # Both pools want more: the full budget admits no change.
    p = planner()
    p.observe_loads(0.0, loads(a=("prefill", 1000, 0, 10), b=("prefill", 0, 0, 10),
                               c=("decode", 0, 11, 10), d=("decode", 0, 5, 10)))
    assert p.proposal() == (1, 1) and p.decide(0.0) is None
    # Decode KV over 100 %, all prefill queues under a tenth: a prefill node moves.
    p = planner()
    p.observe_loads(0.0, loads(a=("prefill", 99, 0, 10), b=("prefill", 0, 0, 10),
                               c=("decode", 0, 11, 10), d=("decode", 0, 5, 10)))
    assert p.decide(0.0).chosen == Split.of("abcd", "a")
    # In between: nothing.
    p = planner()
    p.observe_loads(0.0, loads(a=("prefill", 500, 0, 10), b=("prefill", 0, 0, 10),
                               c=("decode", 0, 8, 10), d=("decode", 0, 8, 10)))
    assert p.proposal() == (0, 0) and p.decide(0.0) is None


def test_no_decision_while_a_switch_is_in_progress_and_every_interval() -> None:
    p = planner()
    assert p.adapts and p.window_end == 5.0  # the first interval gathers metrics
    p.decide(5.0)
    assert p.window_end == 10.0
    p.observe_loads(5.0, loads(a=("prefill", 1000, 0, 10), b=("prefill", 0, 0, 10),
                               c=("decode", 0, 1, 10), d=("decode", 0, 1, 10)))
    assert p.decide(10.0).chosen == Split.of("abcd", "abd")
    # The same loads again (the relaunch has not changed them yet): no second decision.
    assert p.decide(15.0) is None  # d still relaunching: observe only
    p.observe_loads(700.0, loads(a=("prefill", 1000, 0, 10), b=("prefill", 0, 0, 10),
                                 c=("decode", 0, 1, 10), d=("prefill", 0, 0, 10)))
    p.drained("d", 700.0)
    assert p.decide(705.0) is None  # one decode node left: nothing to give


def test_the_load_planner_relaunches_a_node_once_and_the_switch_completes() -> None:
    """In the service, on its own decisions: a pressure that persists through the relaunch
    (700-800 s) moves one decode node, once, and the relaunch finishes. (A planner that kept
    its old split re-decided the same move every interval and restarted the relaunch.)"""
    pressure = {"prefill_scale_up": 1e-6, "decode_scale_down": 1.0}
    sim = Sim(parse_config(merged(raw_config("dynamo"), {
        "fake": {"noise": 0.0}, "policy": {"dynamo_planner": pressure}})))
    switched, splits = [], []
    sim.bus.subscribe(PhaseSwitched, switched.append)
    sim.bus.subscribe(SplitChanged, splits.append)
    for i in range(400):  # prefill queues throughout; decode KV never near full
        sim.clock.call_at(3.0 * i, lambda i=i: sim.submit(f"r{i}", tokens(20_000, i),
                                                          max_tokens=4))
    sim.run(1200.0)
    (split,) = splits
    assert (split.prefill, split.decode) == (["n0", "n1", "n3"], ["n2"])
    (ev,) = [e for e in switched if e.time > split.time]  # (not the warm-up's end)
    assert ev.node == "n3" and ev.phase == "prefill" and 666.0 <= ev.time - split.time <= 831.0


def test_a_relaunch_takes_the_node_out_of_service_and_drops_its_kv() -> None:
    sim = Sim(config("dynamo", fake={"noise": 0.0, "d0": 0.05}))
    switched = []
    sim.bus.subscribe(PhaseSwitched, switched.append)
    sim.run(1.0)
    assert sim.service.router.split() == (["n0", "n1"], ["n2", "n3"])
    sinks = [sim.submit(f"r{i}", tokens(5000, i), max_tokens=2000) for i in range(6)]
    sim.run(3.0)  # prefills done, decoding under way on n2 and n3
    directory = sim.service.directory
    held = len(directory.tree.blocks_on(directory.index("n2")))
    assert held > 0
    switched.clear()
    decided = sim.clock.now()
    sim.service.force_split(["n0", "n1", "n2"])  # n2: decode -> prefill, by relaunch
    sim.run(400.0)
    # A.1: the worker is terminated without waiting: n2's decodes fail at the decision (no
    # migration, Dynamo's default), n3's finish.
    on_n2 = [s for s in sinks if s.record.decode_node == "n2"]
    assert on_n2 and all(s.record.status == "EngineError" and s.record.end == pytest.approx(decided)
                         for s in on_n2)
    assert all(s.record.status == "ok" for s in sinks if s not in on_n2)
    assert "relaunching as prefill" in on_n2[0].record.error
    assert len(directory.tree.blocks_on(directory.index("n2"))) == 0  # its KV is gone
    assert not sim.engines["n2"].cache.blocks(1)
    assert not switched  # still relaunching
    assert sim.service.router.draining("n2").value == "prefill"  # out of service meanwhile
    assert sim.service.router.node_view("n2")["decoding"] == 0
    sim.run(1300.0)
    (ev,) = switched
    # Table C.1's switch time runs from the decision to the new worker ready: 666-831 s.
    assert ev.node == "n2" and ev.phase == "prefill" and 666.0 <= ev.time - decided <= 831.0


def test_an_in_place_switch_keeps_the_kv() -> None:
    sim = Sim(config("evinfra", planner={"adapt": False}))
    sim.run(40.0)  # the collocated warm-up is over
    for i in range(4):
        sim.submit(f"r{i}", tokens(5000, i), max_tokens=50)
    sim.run(60.0)
    directory = sim.service.directory
    held = len(directory.tree.blocks_on(directory.index("n3")))
    assert held > 0
    sim.service.force_split(["n0", "n1", "n3"])
    sim.run(70.0)
    assert sim.service.router.phase("n3").value == "prefill"
    assert len(directory.tree.blocks_on(directory.index("n3"))) == held
