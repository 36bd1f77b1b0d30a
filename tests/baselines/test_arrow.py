"""Arrow: routing by TTFT predicted from the full input (cache ignored), SLO-reactive
resizing with a cooldown, KV private to each node (paper 3.1, 3.2, A.1)."""

import numpy as np
from baseline_harness import Sim, config, tokens

from evinfra.baselines.arrow import ArrowConfig, SLOPlanner
from evinfra.core.contracts import NodeLoad
from evinfra.core.events import BlockStored, RequestDone
from evinfra.planner.itermodel import NodeModel
from evinfra.planner.planner import PlannerConfig, Split
from evinfra.router.router import Route, Routing


def test_arrow_routes_by_full_input_and_ignores_the_cached_prefix() -> None:
    sim = Sim(config("arrow"))
    sim.run(40.0)  # after the collocated warm-up (its fit stands in for Arrow's profile)
    router = sim.service.router
    toks = tokens(20000, 3)
    path = sim.service.directory.branches.hasher.hash(toks).hashes
    for medium in ("GPU", "CPU_PINNED"):
        sim.service.directory.apply("n0", BlockStored(path, None, [], 64, medium=medium))
    router._nodes["n0"].queue.add("x", 2000, 0, 0)  # n0 a little busier, but holds the prefix
    route = router.route(Routing("q", "q", np.concatenate([toks, tokens(100, 4)]), 8), 40.0)
    assert isinstance(route, Route)
    assert route.node == "n1" and route.fetch == []  # TTFT routing would keep it on n0
    assert route.prediction.t_c == 0 and route.prediction.t_uc == 20100  # booked at full length


def model(node: str) -> NodeModel:
    return NodeModel(node=node, c0=0.02, c1=2e-5, c2=1e-10, c3=0.0, d0=0.008, d1=0.014,
                     d2=3.6e-4, k_over_e=8 / 256, t_fwd=2, t_bar=8192.0, f=0.0)


def arrow(nodes="abcd", prefill="ab", **cfg) -> SLOPlanner:
    p = SLOPlanner(ArrowConfig(**cfg), PlannerConfig(t_learn=10.0), list(nodes), prefill,
                   start=0.0)
    p._inner.models = {n: model(n) for n in nodes}  # the warm-up fit, done
    return p


def done(end: float, t_in: int, tpot: float) -> RequestDone:
    return RequestDone("r", "b", end - 5.0, end, "ok", t_in, 101, first_token=end - 100 * tpot)


def waits(p: SLOPlanner, wait: float) -> list[NodeLoad]:
    return [NodeLoad(n, "prefill" if n in p.split.prefill else "decode", 0, wait, 100, 10**6)
            for n in p.nodes]


def test_a_predicted_ttft_over_the_slo_moves_a_decode_node_then_waits_the_cooldown() -> None:
    p = arrow(prefill="a")
    p.observe_done(done(100.0, 40_000, 0.02))
    p.observe_loads(100.0, waits(p, 6.0))
    ttft, tpot = p.signals(100.0)
    assert ttft > 6.0 and abs(tpot - 0.02) < 1e-9  # the wait plus a 40K-token full prefill
    d = p.decide(100.0)
    assert d.chosen == Split.of("abcd", "ab")
    # The decision is the planner's new split; b moves until it is drained.
    assert p.split == d.chosen and p.draining == {"b"}
    p.observe_done(done(101.0, 40_000, 0.02))
    assert p.decide(101.0) is None  # b still moving: no second decision
    p.drained("b", 101.0)
    p.observe_done(done(120.0, 40_000, 0.02))
    p.observe_loads(120.0, waits(p, 6.0))
    assert p.decide(120.0) is None  # the cooldown (60 s)
    p.observe_done(done(161.0, 40_000, 0.02))
    p.observe_loads(161.0, waits(p, 6.0))
    assert p.decide(161.0).chosen == Split.of("abcd", "abc")


def test_a_tpot_over_the_slo_moves_a_prefill_node_and_a_pool_never_empties() -> None:
    p = arrow(prefill="abc")
    p.observe_done(done(100.0, 1000, 0.08))
    p.observe_loads(100.0, waits(p, 0.0))
    assert p.decide(100.0).chosen == Split.of("abcd", "bc")  # the least queued prefill node
    q = arrow(prefill="abc")
    q.observe_done(done(100.0, 40_000, 0.02))
    q.observe_loads(100.0, waits(q, 60.0))
    assert q.decide(100.0) is None  # a single decode node is never taken
    r = arrow()
    r.observe_done(done(100.0, 1000, 0.02))
    r.observe_loads(100.0, waits(r, 0.1))
    assert r.decide(100.0) is None  # both SLOs met
