"""The phase-split planner (paper 5.2, Algorithm E.3 lines 1, 15-29)."""

from __future__ import annotations

import itertools

import msgspec
import numpy as np
import pytest
from planner_fakes import OSWORLD, PUTNAM, TRUTH, Synth, Workload, heterogeneous, make_cluster

from evinfra.core.contracts import NodeLoad
from evinfra.core.events import NodeState
from evinfra.core.types import qk_pairs
from evinfra.errors import ConfigError
from evinfra.planner import Decision, NodeModel, Planner, PlannerConfig, SliceWork, Split, plan

CC = Workload(rate=3.0, t_uc=(2e3, 1.2e4), t_c=(2e4, 1.2e5), t_out=(300, 1500), q=160)
"""Coding agents between the two extremes: the best split is 3P6D on nine nodes."""


def homogeneous(n: int) -> list[NodeModel]:
    return [msgspec.structs.replace(TRUTH, node=f"n{i}", f=0.2) for i in range(n)]


def slice_of(requests: list[tuple[float, float, float]], q: float, start: float = 0.0,
             t_acc: float = 1.8, waiting: float = 0.0) -> SliceWork:
    """w̄, q̄, n̄ and the decode KV of a slice whose finished requests are ``[(t_uc, t_c,
    t_out), ...]``, with ``waiting`` requests waiting for or in prefill."""
    t_uc, t_c, t_out = np.array(requests, dtype=float).T
    return SliceWork(start=start, length=60.0, requests=len(requests), t_uc=float(t_uc.mean()),
                     A=float(qk_pairs(t_uc, t_c).mean()), t_c=float(t_c.mean()),
                     t_out=float(t_out.mean()), t_acc=t_acc, q=float(q), n=float(q + waiting),
                     kv=float(((t_uc + t_c + t_out) * t_out).sum() / t_out.sum()))


def theta(models: list[NodeModel], prefill: set[str], s: SliceWork) -> float:
    """Eq. 5 one node at a time, the decode side at the requests in flight, each node's batch
    at most what its GPU KV holds (the reference for the vectorized planner)."""
    decode = [x for x in models if x.node not in prefill]
    B = s.n / len(decode)  # noqa: N806

    def batch(x: NodeModel) -> float:
        return min(B, x.kv_tokens / s.kv) if x.kv_tokens and s.kv else B

    mu_p = sum(x.mu_p(s.t_uc, s.t_c, A=s.A) for x in models if x.node in prefill)
    return min(mu_p, sum(x.mu_d(s.t_out, s.t_acc, batch(x)) for x in decode))


def random_slices(rng: np.random.Generator, m: int = 10) -> list[SliceWork]:
    """A window of one workload (drawn at random) with slice-to-slice noise."""
    t_uc, t_c, t_out = rng.uniform(500, 20_000), rng.uniform(0, 150_000), rng.uniform(100, 4000)
    q, waiting = rng.uniform(10, 400), rng.uniform(0, 100)
    return [slice_of([(t_uc * rng.uniform(0.3, 1.7), t_c * rng.uniform(0.5, 1.5),
                       t_out * rng.uniform(0.5, 1.5)) for _ in range(30)],
                     q * rng.uniform(0.9, 1.1), 60.0 * i,
                     waiting=waiting * rng.uniform(0.9, 1.1)) for i in range(m)]


# -- Θ, candidates and the choice (pure) -----------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_theta_and_gains_match_the_per_node_reference(seed):
    """Heterogeneous nodes (±30 %, some with a GPU KV capacity that caps their decode batch,
    some unreported): the vectorized Θ of every candidate (the decode side bounded or summed)
    equals Eq. 5 summed node by node, and each candidate changes exactly |p − |P|| nodes."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    models = [heterogeneous(f"n{i}", rng, 0.3) for i in range(n)]
    models = [msgspec.structs.replace(x, t_bar=rng.uniform(2000, 8192), f=rng.uniform(0, 0.5),
                                      kv_tokens=int(rng.choice([0, rng.uniform(5e5, 5e6)])))
              for x in models]
    names = [x.node for x in models]
    split = Split.of(names, rng.choice(names, int(rng.integers(1, n)), replace=False))
    slices = random_slices(rng)
    d = plan(models, split, slices, at=0.0)
    current = [theta(models, set(split.prefill), s) for s in slices]
    # The decode sums run in float32 (planner._inverse_iter_sums): ~1e-7 relative.
    np.testing.assert_allclose(d.theta, current, rtol=1e-6)
    tol = 1e-6 * max(current)
    assert set(d.order[:len(split.prefill)]) == set(split.prefill)
    for c in d.candidates:
        prefill = set(d.order[:c.prefill])
        assert len(prefill ^ set(split.prefill)) == c.moved == abs(c.prefill - len(split.prefill))
        want = [theta(models, prefill, s) - t for s, t in zip(slices, current)]
        np.testing.assert_allclose(c.gains, want, rtol=1e-6, atol=tol)
        assert c.threshold == pytest.approx(2 * np.std(want, ddof=1) / np.sqrt(len(slices)),
                                            rel=1e-4, abs=tol)
        assert c.qualified == (c.mean > c.threshold)


def test_chosen_split_is_the_brute_force_argmax_whenever_it_qualifies():
    """(d): over all 2^N − 2 splits of a homogeneous cluster, computed node by node."""
    rng = np.random.default_rng(7)
    models = homogeneous(7)
    names = [x.node for x in models]
    splits = [set(c) for k in range(1, 7) for c in itertools.combinations(names, k)]
    qualified = 0
    for _ in range(40):
        slices = random_slices(rng)
        split = Split.of(names, rng.choice(names, int(rng.integers(1, 7)), replace=False))
        table = np.array([[theta(models, s, w) for w in slices] for s in splits])
        best = int(np.argmax(table.mean(axis=1)))
        now = [theta(models, set(split.prefill), w) for w in slices]
        gains = table[best] - now
        d = plan(models, split, slices, at=0.0)
        if gains.mean() > 2 * gains.std(ddof=1) / np.sqrt(len(slices)):
            qualified += 1
            assert d.chosen is not None
            got = np.mean([theta(models, set(d.chosen.prefill), w) for w in slices])
            assert got == pytest.approx(table[best].mean(), rel=1e-9)
        if d.chosen is not None:
            assert any(c.qualified and c.prefill == len(d.chosen.prefill) for c in d.candidates)
    assert qualified >= 10


def test_nodes_move_by_relative_advantage_then_by_name():
    models = homogeneous(6)
    models[4] = msgspec.structs.replace(models[4], c1=TRUTH.c1 / 2)  # a decode node good at prefill
    models[1] = msgspec.structs.replace(models[1], c1=TRUTH.c1 * 2)  # a prefill node bad at it
    names = [x.node for x in models]
    slices = [slice_of([(4000, 30_000, 1000)], 100, 60.0 * i) for i in range(4)]
    d = plan(models, Split.of(names, ["n0", "n1", "n2"]), slices, at=0.0)
    # n1 leaves prefill first, then n0 before n2 (name); n4 joins first, then n3 before n5.
    assert d.order == ["n2", "n0", "n1", "n4", "n3", "n5"]
    d = plan(homogeneous(6), Split.of(names, ["n0", "n1", "n2"]), slices, at=0.0)
    assert d.order == ["n2", "n1", "n0", "n3", "n4", "n5"]


def test_a_one_slice_burst_that_pulls_the_mean_up_does_not_qualify():
    """(c), the statistics: eight sub-agents reading 100K fresh tokens each in one slice make
    4P5D the better split for that slice and lift its mean gain above 0, but one outlier of m
    gives ḡ ≈ x/m against 2σ/√m ≈ 2x/m."""
    names = [f"n{i}" for i in range(9)]
    steady = [(9700, 70_000, 900)] * 180
    slices = [slice_of(steady, 160, 60.0 * i) for i in range(10)]
    split = Split.of(names, names[:3])
    calm = plan(homogeneous(9), split, slices, at=600.0)
    assert calm.chosen is None and all(c.mean < 0 for c in calm.candidates)
    slices[4] = slice_of(steady + [(1e5, 2000, 800)] * 8, 168, 240.0)
    d = plan(homogeneous(9), split, slices, at=600.0)
    four = next(c for c in d.candidates if c.prefill == 4)
    assert four.gains[4] > 2 and 0 < four.mean < four.threshold and not four.qualified
    assert d.chosen is None and "no candidate's mean gain exceeds 2σ/√m" in d.reason


def prefill_bound(waiting: float, seed: int = 0) -> tuple[list[NodeModel], Split, list[SliceWork]]:
    """Nine nodes at 1P8D serving screenshot-sized prefills (OSWorld, 6.1) as fast as the
    one prefill node completes them, with ``waiting`` requests queued for it: the decode
    population is only what that node feeds, q̄ = λ·(t_out/t_acc)·T_D^iter(q̄/8) (Little's
    law: the rate times a request's time in decode)."""
    rng = np.random.default_rng(seed)
    models = homogeneous(9)
    names = [x.node for x in models]
    split = Split.of(names, ["n0"])
    slices = []
    for i in range(10):
        t_uc, t_c, t_out = 2e4 * rng.uniform(0.9, 1.1), 6e4 * rng.uniform(0.9, 1.1), 300.0
        rate = float(models[0].mu_p(t_uc, t_c))
        q = 1.0
        for _ in range(100):
            q = rate * t_out / 1.8 * float(models[0].t_d_iter(q / 8))
        slices.append(slice_of([(t_uc, t_c, t_out)] * round(rate * 60), q, 60.0 * i,
                               waiting=waiting * rng.uniform(0.9, 1.1)))
    return models, split, slices


def test_a_prefill_bound_split_moves_toward_prefill():
    """Θ's decode side at the requests in flight, not in decode (planner README: where we
    depart from Eq. 5): with 60 requests waiting for the one prefill node the planner adds
    prefill nodes. The control is the paper's q̄ (nothing counted as waiting): there the
    current decode side is the rate served, every move toward prefill loses, and 1P8D holds
    for ever; the old code planned on q̄ and held it."""
    models, split, slices = prefill_bound(waiting=60)
    d = plan(models, split, slices, at=600.0)
    assert d.chosen is not None and len(d.chosen.prefill) >= 2, d.reason
    models, split, slices = prefill_bound(waiting=0)
    paper = plan(models, split, slices, at=600.0)
    assert paper.chosen is None
    assert all(c.mean < 0 for c in paper.candidates), [c.mean for c in paper.candidates]
    assert paper.theta == pytest.approx([s.requests / s.length for s in slices], rel=0.02)


@pytest.mark.parametrize("t_c", [60_000, 80_000])
def test_a_decode_node_runs_only_the_requests_its_gpu_kv_holds(t_c):
    """Fig. 7's mixed hour (planner README: the second departure from Eq. 5): 216 requests
    in flight at 7P2D, screenshot-sized prefills, a 78-97K-token context per request in
    decode. Eq. 5 credits one decode node with all 216 and predicts 8P1D to serve more; a
    GB300 node's 2.06M tokens of GPU KV run 21-26 of them, so 8P1D is predicted to lose and
    7P2D holds. The control is a cluster that reports no capacity: Eq. 5 as written, and
    8P1D is chosen."""
    rng = np.random.default_rng(0)
    names = [f"n{i}" for i in range(9)]
    slices = [slice_of([(2e4 * rng.uniform(0.9, 1.1), t_c * rng.uniform(0.9, 1.1), 300)] * 30,
                       216 * rng.uniform(0.95, 1.05), 60.0 * i) for i in range(10)]
    split = Split.of(names, names[:7])
    unbounded = plan(homogeneous(9), split, slices, at=600.0)
    assert unbounded.chosen is not None and unbounded.chosen.label == "8P1D"
    gb300 = [msgspec.structs.replace(x, kv_tokens=2_060_000) for x in homogeneous(9)]
    d = plan(gb300, split, slices, at=600.0)
    eight = next(c for c in d.candidates if c.prefill == 8)
    assert d.chosen is None and eight.mean < -eight.threshold, d.reason


def test_slices_without_finished_requests_are_left_out():
    names = [f"n{i}" for i in range(3)]
    empty = SliceWork(start=0.0, length=60.0, requests=0, t_uc=0, A=0, t_c=0, t_out=0,
                      t_acc=1.8, q=5, n=5)
    work = slice_of([(4000, 30_000, 1000)], 100)
    d = plan(homogeneous(3), Split.of(names, ["n0"]), [work, empty, work], at=0.0)
    assert all(len(c.gains) == 2 for c in d.candidates)
    d = plan(homogeneous(3), Split.of(names, ["n0"]), [work, empty, empty], at=0.0)
    assert d.chosen is None and "only 1 of 3 slices" in d.reason and not d.candidates


def test_no_requests_in_decode_gives_zero_throughput_not_nan():
    names = [f"n{i}" for i in range(4)]
    idle = [slice_of([(4000, 30_000, 1000)], 0.0, 60.0 * i) for i in range(3)]
    d = plan(homogeneous(4), Split.of(names, ["n0"]), idle, at=0.0)
    assert d.theta == [0.0] * 3 and all(c.gains == [0.0] * 3 for c in d.candidates)
    assert d.chosen is None


def test_decision_is_json():
    names = [f"n{i}" for i in range(5)]
    d = plan(homogeneous(5), Split.of(names, ["n0", "n1"]),
             random_slices(np.random.default_rng(1)), at=1.0)
    assert msgspec.json.decode(msgspec.json.encode(d), type=Decision) == d
    assert Split.of(names, ["n3"]).label == "1P4D"


# -- the planner over time -------------------------------------------------------------------


def test_stationary_decode_heavy_work_converges_to_few_prefill_nodes_then_holds():
    """(a): Putnam from the prefill-heavy 6P3D (6.1)."""
    cluster = make_cluster()
    cluster.warmup()
    assert all(r.usable for r in cluster.planner.fits.values())
    for _ in range(5):
        cluster.window([PUTNAM] * 10)
    switches = [d for d in cluster.decisions if d.chosen is not None]
    assert len(switches) == 1 and switches[0] is cluster.decisions[0]
    assert len(cluster.planner.split.prefill) <= 2


def test_a_shift_to_prefill_heavy_work_moves_the_split_within_one_window():
    """(b): Putnam, then OSWorld from the fourth slice of a window on (6.3's shift)."""
    cluster = make_cluster()
    cluster.warmup()
    for _ in range(2):
        cluster.window([PUTNAM] * 10)
    before = len(cluster.planner.split.prefill)
    shift = cluster.planner.window_end - cluster.planner.config.t_win + 3 * 60.0
    d = cluster.window([PUTNAM] * 3 + [OSWORLD] * 7)
    assert d.at <= shift + cluster.planner.config.t_win
    assert d.chosen is not None and len(d.chosen.prefill) > before + 2


@pytest.mark.parametrize("seed", range(3))
def test_a_sub_agent_burst_in_one_slice_does_not_switch(seed):
    """(c), end to end: the burst makes another split better on its slice only."""
    cluster = make_cluster(seed=seed)
    cluster.warmup()
    for _ in range(2):
        cluster.window([CC] * 10)
    assert cluster.planner.split.label == "3P6D"
    d = cluster.window([CC] * 10, bursts={4: 8})
    assert max(c.gains[4] for c in d.candidates) > 1  # a planner of that slice would switch
    assert d.chosen is None and cluster.planner.split.label == "3P6D"


def test_no_decision_inside_the_hold_off_or_while_draining():
    """(e): E.3 line 16."""
    cluster = make_cluster()
    cluster.warmup()
    p = cluster.planner
    first = cluster.window([PUTNAM] * 10, drain=False)
    assert first.chosen is not None
    assert p.draining == set(first.split.prefill) - set(first.chosen.prefill)
    for now in (first.at + 1, first.at + 119):
        d = p.decide(now)
        assert d.chosen is None and "hold-off" in d.reason and not d.candidates
    assert p.window_end == first.at + 120 + 600  # the hold-off is not part of the next window
    assert "window ends at" in p.decide(first.at + 121).reason
    # OSWorld would move the split, but the nodes that left prefill still run decode requests.
    d = cluster.window([OSWORLD] * 10, drain=False)
    assert d.chosen is None and "still draining" in d.reason and p.split == first.chosen
    for node in sorted(p.draining):
        p.drained(node, d.at + 1)
    d = cluster.window([OSWORLD] * 10)
    assert d.chosen is not None and len(d.chosen.prefill) > len(first.chosen.prefill)


# -- warmup and bad input --------------------------------------------------------------------


def test_warmup_is_collocated_until_t_learn():
    p = Planner(PlannerConfig(), ["a", "b"], ["a"], start=10.0)
    assert p.warming_up and not p.ready(1809.0) and p.ready(1810.0) and p.window_end == 1810.0
    d = p.decide(1810.0)
    assert d.chosen is None and "warming up" in d.reason


def test_a_degenerate_warmup_decides_with_stand_ins_and_says_which():
    """One node's records tie c0 and c1, another node reported nothing: the planner still
    decides (a reduced fit for the one, its peers' coefficients for the other), names the
    stand-ins in its reason, and replaces them once the node's own records identify it."""
    cluster = make_cluster()
    p, synth = cluster.planner, cluster.synth
    for node, truth in cluster.truths.items():
        if node == "n6":  # every prefill the same size: c0 and c1 cannot be told apart
            for k in range(40):
                p.observe_iteration(synth.prefill(node, [(4096, 1000 * k, 0)], k, truth))
                p.observe_iteration(synth.decode(node, 1 + k, k + 0.5, truth))
        elif node != "n7":  # n7 reports nothing at all
            for r in synth.busy_node(node, 60.0, truth):
                p.observe_iteration(r)
    reports = {r.node: r for r in p.finish_warmup(60.0)}
    assert {n for n, r in reports.items() if not r.usable} == {"n7"}
    assert reports["n6"].model.reduced == ("c0",)
    assert p.models["n7"].pooled == ("c0", "c1", "c2", "c3", "d0", "d1", "d2")
    d = cluster.window([PUTNAM] * 10)
    assert d.chosen is not None and d.candidates
    # n7 decoded in the window, one batch size: its own reduced decode fit replaced the pool.
    assert "stand-in models: n6: c0 fixed at 0 (reduced fit); n7: d1, d2 fixed at 0 (reduced " \
           "fit) and c0, c1, c2, c3 pooled from peers" in d.reason
    # n7 serves and reports from now on: its own fit replaces the pooled one at a window end.
    for r in synth.busy_node("n7", 60.0, cluster.truths["n7"], start=d.at + 121):
        p.observe_iteration(r)
    for node in sorted(p.draining):
        p.drained(node, d.at + 1)
    d = cluster.window([PUTNAM] * 10)
    assert p.fits["n7"].usable and not p.models["n7"].stand_in
    assert "n7" not in d.reason.partition("stand-in models")[2]


def test_a_phase_no_node_identified_keeps_the_split_and_says_why():
    cluster = make_cluster()
    p, synth = cluster.planner, cluster.synth
    for node, truth in cluster.truths.items():
        for r in synth.busy_node(node, 60.0, truth):
            if r.prefill:  # nobody decoded in the warm-up
                p.observe_iteration(r)
    p.finish_warmup(60.0)
    d = p.decide(p.window_end)  # a window in which nothing decoded either
    assert d.chosen is None and p.split.label == "6P3D"
    assert "no usable model, from its own records or its peers', for n0: d0, d1, d2 " \
           "unidentifiable: no decode iterations recorded" in d.reason
    # The decode nodes keep fitting in the phase they serve: the next window decides.
    d = cluster.window([PUTNAM] * 10)
    assert d.chosen is not None and "d1, d2 fixed at 0 (reduced fit)" in d.reason


def test_a_node_without_decode_records_is_refitted_once_it_has_them():
    cluster = make_cluster()
    p, synth = cluster.planner, cluster.synth
    for node, truth in cluster.truths.items():
        for r in synth.busy_node(node, 60.0, truth):
            if node != "n8" or r.prefill:
                p.observe_iteration(r)
    assert not {r.node: r for r in p.finish_warmup(60.0)}["n8"].usable
    for k, B in enumerate(range(4, 100, 4)):  # noqa: N806 - n8 decodes after warmup
        p.observe_iteration(synth.decode("n8", B, 60.0 + k, cluster.truths["n8"]))
    d = cluster.window([PUTNAM] * 10)
    assert p.fits["n8"].usable and d.chosen is not None


def test_config_defaults_are_the_papers_and_typos_are_rejected():
    c = PlannerConfig()
    assert (c.t_learn, c.t_win, c.m, c.hold_off, c.k_over_e) == (1800, 600, 10, 120, 8 / 256)
    with pytest.raises(msgspec.ValidationError, match="t_windw"):
        msgspec.convert({"t_windw": 300}, PlannerConfig)
    with pytest.raises(msgspec.ValidationError, match="cannot exceed"):
        msgspec.convert({"experts_per_token": 9, "routed_experts": 8}, PlannerConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"m": 1}, PlannerConfig)
    with pytest.raises(ConfigError):
        Planner(c, ["a", "b"], ["a", "b"], start=0.0)
    with pytest.raises(ConfigError):
        Planner(c, ["a", "b"], ["c"], start=0.0)


def test_the_gpu_kv_each_node_reports_reaches_its_model():
    """NodeState.l1_capacity (the fake engine's L1, SGLang's max_total_num_tokens) is what
    bounds Θ's decode batch on the node from the next window on; a report without it (0)
    leaves the last one, and a node that never reported has no bound."""
    cluster = make_cluster()
    cluster.warmup()
    p = cluster.planner
    assert all(x.kv_tokens == 0 for x in p.models.values())
    for k, node in enumerate(p.nodes[:-1]):
        p.observe_state(NodeState(node, p.warmup_end, "decode", l1_capacity=1_000_000 + k))
    p.observe_state(NodeState("n0", p.warmup_end + 1, "decode"))
    cluster.window([PUTNAM] * 10)
    assert [p.models[n].kv_tokens for n in p.nodes] == [1_000_000 + k for k in range(8)] + [0]


def test_unknown_nodes_are_ignored():
    p = Planner(PlannerConfig(t_learn=1.0), ["a", "b"], ["a"], start=0.0)
    p.observe_iteration(Synth(0).decode("zz", 4))
    assert all(r.decode_records == 0 for r in p.finish_warmup(1.0))


def test_exported_names():
    import types

    import evinfra.planner as package

    public = {n for n, v in vars(package).items()
              if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert set(package.__all__) == public


def out_of_service(p: Planner, *nodes: str) -> None:
    """The router's loads before a decision: ``nodes`` down or cordoned."""
    p.observe_loads(0.0, [NodeLoad(n, "prefill" if n in p.split.prefill else "decode", 0, 0.0,
                                   0, None, n not in nodes) for n in p.nodes])


def test_nodes_out_of_service_keep_their_phase_and_the_rest_are_split():
    """A down or cordoned node gives no capacity: the candidates split the nodes that serve,
    as a cluster of those alone would be split, and it keeps its phase for when it is back."""
    cluster = make_cluster()
    cluster.warmup()
    p = cluster.planner
    out_of_service(p, "n0", "n1", "n2")
    d = cluster.window([PUTNAM] * 10)
    assert d.chosen is not None and {"n0", "n1", "n2"} <= set(d.chosen.prefill)
    assert "n0, n1, n2 out of service" in d.reason and len(d.order) == 6
    assert d.split.label == "6P3D" and p.split == d.chosen
    live = [n for n in p.nodes if n not in ("n0", "n1", "n2")]
    same = plan([p.models[n] for n in live], Split.of(live, ["n3", "n4", "n5"]), d.slices,
                at=d.at)
    assert set(d.chosen.prefill) - {"n0", "n1", "n2"} == set(same.chosen.prefill)
    # Every decode node out: no split of the rest has both phases, so nothing moves.
    out_of_service(p, *p.split.decode)
    d = cluster.window([OSWORLD] * 10)
    assert d.chosen is None and "no phase may be left without a node" in d.reason
    out_of_service(p)  # all back: the whole cluster is split again
    d = cluster.window([OSWORLD] * 10)
    assert "out of service" not in d.reason and len(d.order) == 9
