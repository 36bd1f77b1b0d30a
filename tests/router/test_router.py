import numpy as np
import pytest

from evinfra.core.events import BlockStored, NodeState, PrefillItem
from evinfra.core.types import Phase
from evinfra.directory import Directory
from evinfra.router.router import DecodeBinding, Refusal, Route, Router, RouterConfig, Routing
from evinfra.router.strategy import TTFTStrategy
from evinfra.router.ttft import TTFTConfig

PAGE = 64
rng = np.random.default_rng(0)
FAMILY = rng.integers(0, 50_000, size=20_000, dtype=np.uint32)  # an agent family's prefix


def make(nodes=None) -> Router:
    nodes = nodes or {"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE, "D2": Phase.DECODE}
    return Router(Directory(nodes, PAGE), RouterConfig())


def hold(router: Router, node: str, tokens: np.ndarray) -> list[int]:
    path = router.directory.branches.hasher.hash(tokens).hashes
    for medium in ("GPU", "CPU_PINNED"):
        router.directory.apply(node, BlockStored(path, None, [], PAGE, medium=medium))
    return path


def req(rid: str, tokens, branch=None, parent=None, max_tokens=100) -> Routing:
    return Routing(rid, branch or rid, tokens, max_tokens, parent)


def load(router: Router, node: str, n: int, now: float = 0.0) -> None:
    """Queue n requests of 8K fresh tokens on ``node`` as if routed there earlier."""
    q = router._nodes[node].queue
    for i in range(n):
        q.add(f"load-{node}-{i}", 8192, 0, 0)


def test_loaded_prefix_holder_loses_to_an_idle_node_that_fetches() -> None:
    r = make()
    hold(r, "P1", FAMILY)
    load(r, "P1", 20)
    tokens = np.concatenate([FAMILY, rng.integers(0, 50_000, size=500, dtype=np.uint32)])
    route = r.route(req("q1", tokens, branch="fork-2"), now=0.0)
    assert isinstance(route, Route)
    assert route.node == "P2"
    p = route.prediction
    assert p.x == 19_968 and p.t_c == 19_968  # 312 full pages, all fetched
    assert [(f.peer, f.start, len(f.blocks)) for f in route.fetch] == [("P1", 0, 312)]
    assert route.fetch[0].blocks == route.path.hashes[:312]


def test_fetch_plan_takes_the_furthest_peer_then_fills_holes_from_any_holder() -> None:
    """Runs from the peer whose own prefix reaches furthest (the first such node on a tie),
    then, past every peer's own prefix, from whoever holds each block."""
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "P3": Phase.PREFILL,
              "P4": Phase.PREFILL, "D1": Phase.DECODE})
    tokens = rng.integers(0, 50_000, size=30 * PAGE + 100, dtype=np.uint32)
    path = r.directory.branches.hasher.hash(tokens).hashes
    for node, blocks in (("P1", path[:11] + path[12:30]), ("P2", path[:25]), ("P3", path[:25])):
        r.directory.apply(node, BlockStored(blocks, None, [], PAGE, medium="GPU"))
        load(r, node, 20)
    route = r.route(req("q1", tokens), now=0.0)
    assert route.node == "P4" and route.prediction.t_c == 30 * PAGE
    assert [(f.peer, f.start, f.blocks) for f in route.fetch] == [("P2", 0, path[:25]),
                                                                  ("P1", 25, path[25:30])]


def test_fetch_plan_skips_blocks_past_a_hole_the_chosen_node_holds_itself() -> None:
    """P1 holds blocks 0-9 and 11-29 (a hole at 10), P2 blocks 0-10: P2's queue sends the
    request to P1, which fetches block 10 from P2 and nothing it holds itself (the plan
    once asked a peer for block 11 on, which only P1 holds, and the route raised
    StopIteration after it had queued the request), after a run from P2 that backs P1's own
    blocks 0-9 should P1 evict them while the request waits."""
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    tokens = rng.integers(0, 50_000, size=30 * PAGE + 100, dtype=np.uint32)
    path = r.directory.branches.hasher.hash(tokens).hashes
    r.directory.apply("P1", BlockStored(path[:10] + path[11:30], None, [], PAGE, medium="GPU"))
    r.directory.apply("P2", BlockStored(path[:11], None, [], PAGE, medium="GPU"))
    load(r, "P2", 200)
    route = r.route(req("q1", tokens), now=0.0)
    assert route.node == "P1" and route.prediction.t_c == 30 * PAGE
    assert [(f.peer, f.start, f.blocks) for f in route.fetch] == [("P2", 0, path[:10]),
                                                                  ("P2", 10, path[10:11])]


def test_idle_prefix_holder_keeps_the_request() -> None:
    r = make()
    hold(r, "P1", FAMILY)
    tokens = np.concatenate([FAMILY, rng.integers(0, 50_000, size=500, dtype=np.uint32)])
    route = r.route(req("q1", tokens), now=0.0)
    assert route.node == "P1" and route.fetch == [] and route.prediction.x == 0


def test_the_queue_counts_requests_the_node_has_not_reported() -> None:
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    seen = [r.route(req(f"q{i}", rng.integers(0, 50_000, size=8000, dtype=np.uint32)), 0.0).node
            for i in range(6)]
    assert seen == ["P1", "P2", "P1", "P2", "P1", "P2"]


def test_stale_state_is_ignored() -> None:
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    # P1 launched a long iteration at t=0 (800K-token context: seconds of attention).
    r.on_state(NodeState("P1", 0.0, "prefill", launched=[PrefillItem("x", 8192, 800_000)]))
    toks = rng.integers(0, 50_000, size=1000, dtype=np.uint32)
    assert r.route(req("a", toks), now=1.0).node == "P2"
    r2 = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    r2.on_state(NodeState("P1", 0.0, "prefill", launched=[PrefillItem("x", 8192, 800_000)]))
    r2.on_state(NodeState("P2", 0.0, "prefill", launched=[PrefillItem("y", 8192, 800_000)]))
    # Six seconds later both reports are stale: the tie goes to the node name.
    assert r2.route(req("a", toks), now=6.0).node == "P1"


def test_ties_go_to_the_longest_own_prefix() -> None:
    r = Router(Directory({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE}, PAGE),
               RouterConfig(ttft=TTFTConfig(kappa=0.0, fetch_base_s=0.0, fetch_s_per_token=0.0)))
    hold(r, "P2", FAMILY[:4096])
    hold(r, "P1", FAMILY[:2048])
    # Fetch is free and both nodes reach the same 4,096-token prefix: equal T̂; P2 owns more.
    route = r.route(req("a", FAMILY[:6000]), 0.0)
    assert route.node == "P2"


def test_decode_binding_needs_room_then_prefers_fewest_requests() -> None:
    r = make()
    toks = rng.integers(0, 50_000, size=1000, dtype=np.uint32)
    r.on_state(NodeState("D1", 0.0, "decode", kv_room=500))
    r.on_state(NodeState("D2", 0.0, "decode", kv_room=100_000))
    route = r.route(req("a", toks), 0.0)
    b = r.prefill_started("a", route.node, 0.1)
    assert b == DecodeBinding("a", "D2", route.node)
    assert r.prefill_started("a", route.node, 0.1) is None  # bound once
    r.on_state(NodeState("D1", 0.2, "decode", kv_room=100_000))
    route = r.route(req("b", toks), 0.2)
    assert r.prefill_started("b", route.node, 0.3).node == "D1"  # room, and fewer requests


def test_decode_room_counts_bindings_until_admitted_or_over() -> None:
    """A node's reported room less what the requests bound there and not admitted yet need
    (1,100 tokens each here: 1,000 in, 100 out)."""
    r = make()
    r.on_state(NodeState("D1", 0.0, "decode", kv_room=2000))
    r.on_state(NodeState("D2", 0.0, "decode", kv_room=100_000))

    def bind(rid: str, t: float) -> str:
        route = r.route(req(rid, rng.integers(0, 50_000, size=1000, dtype=np.uint32)), t)
        return r.prefill_started(rid, route.node, t).node

    assert bind("a", 0.1) == "D1"  # a tie on requests: by name
    assert bind("b", 0.2) == "D2"  # D1 has 900 left
    r.decode_admitted("a", "D1")
    assert bind("c", 0.3) == "D1"  # 1 request each, D1's room is whole again
    r.finished("c")
    assert bind("d", 0.4) == "D1"  # c gave its room back


def test_decode_ties_go_to_the_node_holding_the_prefix_in_gpu_memory() -> None:
    """Fig. 4d: a branch keeps its decode node while the nodes tie on requests, so each
    step sends only new KV; without a prefix anywhere, ties go by name."""
    r = make()
    for d in ("D1", "D2"):
        r.on_state(NodeState(d, 0.0, "decode", kv_room=100_000))
    r.directory.apply("D2", BlockStored(r.directory.branches.hasher.hash(FAMILY[:1024]).hashes,
                                        None, [], PAGE, medium="CPU_PINNED"))
    route = r.route(req("a", FAMILY[:2000]), 0.0)
    assert r.prefill_started("a", route.node, 0.1).node == "D1"  # D2's copy is host-only
    route = r.route(req("b", rng.integers(0, 50_000, size=2000, dtype=np.uint32)), 0.1)
    assert r.prefill_started("b", route.node, 0.2).node == "D2"  # fewer requests first
    hold(r, "D2", FAMILY[:1024])
    route = r.route(req("c", FAMILY[:2000]), 0.2)
    assert r.prefill_started("c", route.node, 0.3).node == "D2"  # 1 each: D2 holds 16 blocks
    route = r.route(req("d", FAMILY[:2000], branch="other"), 0.3)
    r.prefill_started("d", route.node, 0.4)
    route = r.route(req("e", rng.integers(0, 50_000, size=2000, dtype=np.uint32)), 0.4)
    assert r.prefill_started("e", route.node, 0.5).node == "D1"  # 2 each, no prefix: by name


def test_refusals_when_no_node_of_a_phase_is_left() -> None:
    r = make({"P1": Phase.PREFILL, "D1": Phase.DECODE})
    r.begin_switch("P1", Phase.DECODE)
    out = r.route(req("a", np.arange(100, dtype=np.uint32)), 0.0)
    assert isinstance(out, Refusal) and out.phase == "prefill"
    r2 = make({"P1": Phase.PREFILL, "D1": Phase.DECODE})
    r2.route(req("a", np.arange(100, dtype=np.uint32)), 0.0)
    r2.begin_switch("D1", Phase.PREFILL)
    out = r2.prefill_started("a", "P1", 0.0)
    assert isinstance(out, Refusal) and out.phase == "decode"


def test_drain_moves_queued_requests_and_lets_running_ones_finish() -> None:
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    held = hold(r, "P1", FAMILY)
    load(r, "P2", 40)  # P2 busy: everything goes to P1
    ids = [f"q{i}" for i in range(5)]
    for rid in ids:
        assert r.route(req(rid, rng.integers(0, 50_000, size=3000, dtype=np.uint32)), 0.0).node == "P1"
    r.prefill_started("q0", "P1", 0.1)
    r._nodes["P2"].queue = type(r._nodes["P2"].queue)()  # P2 drains its load meanwhile
    withdraw = r.begin_switch("P1", Phase.DECODE)
    assert withdraw == ["q1", "q2", "q3", "q4"]
    assert r.route(req("new", np.arange(500, dtype=np.uint32)), 0.2).node == "P2"
    for rid in withdraw:
        assert r.withdrawn(rid, "P1", 0.3).node == "P2"
    assert not r.drained("P1")
    r.prefill_done("q0", "P1")
    assert r.drained("P1")
    r.switched("P1", Phase.DECODE)
    # Every request sits in exactly one prefill queue; none was lost or duplicated.
    queued = {q: n for n in ("P1", "P2") for q in r._nodes[n].queue.requests()}
    assert sorted(queued) == sorted(["new", "q1", "q2", "q3", "q4"])
    assert set(queued.values()) == {"P2"}
    # P1's KV stays readable to every node after its switch.
    assert r.directory.match(held).own[r.directory.index("P1")] == len(held)
    assert r.split() == (["P2"], ["D1", "P1"])


def test_a_relaunch_drain_waits_until_decode_read_the_kv() -> None:
    """A relaunching engine (Dynamo) loses its KV, so its drain also waits for the decode
    nodes to take the prefills it finished; an in-place switch need not."""
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    load(r, "P2", 40)
    assert r.route(req("q", np.arange(3000, dtype=np.uint32)), 0.0).node == "P1"
    assert r.prefill_started("q", "P1", 0.1).node == "D1"
    r.begin_switch("P1", Phase.DECODE)
    r.prefill_done("q", "P1")
    assert r.drained("P1") and not r.drained("P1", handoffs=True)
    r.decode_admitted("q", "D1")
    assert r.drained("P1", handoffs=True)
    # A request that ends before decode admits it (failed, aborted) hands nothing off.
    r._nodes["P2"].queue = type(r._nodes["P2"].queue)()  # P2's load is done meanwhile
    assert r.route(req("q2", np.arange(4000, dtype=np.uint32)), 0.2).node == "P2"
    r.prefill_started("q2", "P2", 0.3)
    r.begin_switch("P2", Phase.DECODE)
    r.prefill_done("q2", "P2")
    assert not r.drained("P2", handoffs=True)
    r.finished("q2")
    assert r.drained("P2", handoffs=True)


def test_collocated_nodes_take_their_new_phase_at_once() -> None:
    r = make({"N1": Phase.COLLOCATED, "N2": Phase.COLLOCATED})
    route = r.route(req("a", np.arange(300, dtype=np.uint32)), 0.0)
    assert r.prefill_started("a", route.node, 0.0).node == route.node  # decodes where it prefilled
    assert r.begin_switch("N1", Phase.PREFILL) == []
    assert r.phase("N1") is Phase.PREFILL and r.draining("N1") is None


def test_a_failure_before_prefill_routes_again() -> None:
    r = make({"P1": Phase.PREFILL, "P2": Phase.PREFILL, "D1": Phase.DECODE})
    route = r.route(req("a", np.arange(300, dtype=np.uint32)), 0.0)
    r.node_down(route.node)
    again = r.failed("a", route.node, started=False, now=0.1)
    assert isinstance(again, Route) and again.node != route.node
    assert r.failed("a", again.node, started=True, now=0.2) is None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pool", [True, False])
def test_the_all_node_loop_is_eq7_on_each_node(seed: int, pool: bool) -> None:
    """The router's one loop over the prefill nodes (what every route runs) gives, per node,
    E.3 lines 6-9's inputs and exactly the floats of ``ttft.estimate`` on them, over random
    queues, reports, models and prefixes, and again after they change (the loop caches
    what no request changes). Asked for the nodes near the least T̂ only, it skips nodes by
    a lower bound that holds, and only nodes outside the margin."""
    from evinfra.planner.itermodel import NodeModel
    from evinfra.router.router import _View
    from evinfra.router.ttft import estimate

    g = np.random.default_rng(seed)
    nodes = {f"P{i}": Phase.PREFILL for i in range(7)} | {"D1": Phase.DECODE}
    r = Router(Directory(nodes, PAGE), RouterConfig(), pool=pool)
    tokens = g.integers(0, 50_000, size=int(g.integers(100, 30_000)), dtype=np.uint32)
    for i in g.choice(7, size=3, replace=False):
        hold(r, f"P{i}", tokens[: int(g.integers(0, tokens.size + 1))])
    r.set_models([NodeModel(node=f"P{i}", c0=g.random() * 0.03, c1=g.random() * 1e-4,
                            c2=g.random() * 1e-9, c3=g.random() * 1e-6, d0=0.01, d1=0.01,
                            d2=1e-4, k_over_e=1.0, t_fwd=1.0, t_bar=4096.0, f=0.5)
                  for i in range(0, 7, 2)])
    for i in range(7):
        q = r._nodes[f"P{i}"].queue
        for j in range(int(g.integers(0, 12))):
            q.add(f"bg{i}.{j}", int(g.integers(1, 20_000)), int(g.integers(0, 30_000)),
                  int(g.integers(0, 5_000)))
        if g.random() < 0.7:
            t = float(g.random() * 8)
            r.on_state(NodeState(f"P{i}", t, "prefill",
                                 launched=[PrefillItem(f"bg{i}.0", 100, 0, 0)] if len(q) else []))
    step = r.directory.step("b", tokens)
    match = r.directory.match(step.path.hashes)
    eligible = r._prefill_nodes()
    cfg = r.config.ttft

    def routed() -> Routing:
        q = Routing("q", "b", tokens, 0)
        q.path, q.t_in = step.path, int(tokens.size)
        return q

    def check(now: float) -> None:
        got = r._estimates(routed(), eligible, match, now)
        for n, (t_hat, own, w_hat, t_uc, t_c, t_rst, x) in zip(eligible, got):
            i = r.directory.index(n.name)
            assert own == min(match.own[i] * PAGE, tokens.size - 1)
            reach = min(match.union * PAGE, tokens.size - 1) - own if pool else 0
            assert x == (reach if reach >= cfg.fetch_min_tokens else 0)
            assert (t_c, t_uc) == (own + x, tokens.size - own - x)
            assert t_rst == own - min(match.own_l1[i] * PAGE, own) + x
            assert (t_hat, w_hat) == estimate(n.queue, r.coefficients(n.name), r._t_rem(n, now),
                                              t_uc, t_c, t_rst, x, cfg, r.tau)
        view = _View(r, routed(), eligible, match, now)
        assert view.t_hats() == [e[:2] for e in got]
        assert [view.predict(n).t_hat for n in view.nodes] == [e[0] for e in got]
        # Each node's floor bounds its T̂ from below, so the nodes a bound rules out are
        # never within the margin of the least T̂; those computed are the same rows.
        for n, e in zip(eligible, got):
            assert r._t_rem(n, now) + n.row.floor <= e[0]
        lo = min(e[0] for e in got)
        for margin in (0.0, 2e-9, 0.01, 0.1):
            near = r._estimates(routed(), eligible,
                                match, now, margin)
            for e, full in zip(near, got):
                assert e == full or (e is None and full[0] - lo > margin)
            skipped.append(near.count(None))
        # Evinfra's choice is the argmin of every node's T̂ (ties: longest own prefix, least
        # recently chosen, name), though it computes only the nodes near the minimum.
        least = round(lo, 9)
        ref = min((i for i, e in enumerate(got) if round(e[0], 9) == least),
                  key=lambda i: (-got[i][1], view.last_chosen(view.nodes[i]), view.nodes[i]))
        view = _View(r, routed(), eligible, match, now)
        assert TTFTStrategy().choose(view).node == view.nodes[ref]

    skipped: list[int] = []
    check(float(g.random() * 10))
    # Each node's cached inputs follow every change of its queue, report or model.
    r._nodes["P1"].queue.add("late", 5_000, 1_000, 10)
    r._nodes["P2"].queue.remove("bg2.0")
    r.on_state(NodeState("P3", 9.0, "prefill"))
    r.set_models([NodeModel(node="P5", c0=0.02, c1=2e-5, c2=3e-10, c3=1e-7, d0=0.01, d1=0.01,
                            d2=1e-4, k_over_e=1.0, t_fwd=1.0, t_bar=4096.0, f=0.5)])
    check(float(g.random() * 10))
    assert sum(skipped) > 0  # the bound did rule nodes out


def test_fetch_plan_reads_the_branchs_prefill_copy_before_the_decode_nodes() -> None:
    """The branch's last prefill ran on P1 (it counts blocks 0-19 there), D1 decoded it and
    holds the prompt and the output (0-29). A request that P1's queue sends to P2 reads 0-19
    from P1, the source of the branch's move, and only 20-29 from D1, whose copies of every
    branch it decoded may outgrow its host memory. Controls: with P1 a decode node, or with
    P1's copy one the branch does not count (another branch's, evicted first), D1 reaching
    furthest serves it all, as before."""
    def plan(p1: Phase, counted: bool):
        r = make({"P1": p1, "P2": Phase.PREFILL, "P3": Phase.PREFILL, "D1": Phase.DECODE})
        tokens = rng.integers(0, 50_000, size=30 * PAGE + 100, dtype=np.uint32)
        path = r.directory.branches.hasher.hash(tokens).hashes
        r.directory.apply("P1", BlockStored(path[:20], None, [], PAGE, medium="CPU_PINNED"))
        r.directory.apply("D1", BlockStored(path[:30], None, [], PAGE, medium="CPU_PINNED"))
        if counted:
            r.directory.step("b", tokens[:20 * PAGE])
            r.directory.place("b", "P1")
        for node in ("P1", "P3"):
            load(r, node, 20)
        route = r.route(req("q1", tokens, branch="b"), now=0.0)
        assert route.node == "P2" and route.prediction.t_c == 30 * PAGE
        return [(f.peer, f.start, f.blocks) for f in route.fetch], path

    fetch, path = plan(Phase.PREFILL, counted=True)
    assert fetch == [("P1", 0, path[:20]), ("D1", 20, path[20:30])]
    for p1, counted in ((Phase.DECODE, True), (Phase.PREFILL, False)):
        fetch, path = plan(p1, counted)
        assert fetch == [("D1", 0, path[:30])]
