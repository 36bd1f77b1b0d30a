"""``Service.cordon`` in virtual time: cordoning a node withdraws its queued requests whose
prefill has not started and they complete on another node; what already runs there
finishes there; nothing new is routed to it (prefill or decode) while it is cordoned, though
its KV stays readable by its peers; uncordoned, it takes work again.

Why virtual time: tests/api/test_cordon.py has to poll the wall clock until the requests it
fired have reached the engines before it cordons, and can only say "at least 3 withdrawn".
Here six requests are submitted at one virtual instant, so exactly one is running and five
are queued when the node is cordoned, and every request's nodes and re-routes are known.
"""

from __future__ import annotations

import pytest

from evinfra.errors import NoNodeError, RequestError
from tests.control.virtual import FAST, VSim, prompt

SLOW_PREFILL = {"fake": {**FAST, "c1": 2e-4}}  # 0.3 s for a 1500-token prompt


def routed(sinks) -> list[tuple[str | None, str | None]]:
    return [(s.record.prefill_node, s.record.decode_node) for s in sinks]


def test_cordoning_a_node_sends_its_queued_prefills_elsewhere_and_all_finish():
    sim = VSim(**SLOW_PREFILL)
    svc = sim.service
    assert svc.cordon("n1") == []  # nothing queued there yet
    sinks = [sim.submit(f"r{i}", prompt(1500, seed=i)) for i in range(6)]
    view = sim.node("n0")
    assert (view["queued"], view["prefilling"]) == (6, 1)  # one runs, five wait behind it
    assert svc.cordon("n1", False) == []

    withdrawn = svc.cordon("n0")
    assert withdrawn == ["r1", "r2", "r3", "r4", "r5"]  # the running r0 stays
    n0, n1 = sim.node("n0"), sim.node("n1")
    assert n0["cordoned"] and (n0["queued"], n0["prefilling"]) == (1, 1)
    assert not n1["cordoned"] and n1["queued"] == 5  # routed again at once

    sim.run_for(5.0)
    assert all(s.ok for s in sinks)
    assert [s.record.prefill_node for s in sinks] == ["n0"] + ["n1"] * 5
    assert [s.record.reroutes for s in sinks] == [0] + [1] * 5
    c = sim.counters()
    assert (c["submitted"], c["ok"], c["failed"]) == (6, 6, 0)
    assert sim.service.in_flight() == 0


def test_nothing_is_routed_to_a_cordoned_node_until_it_is_uncordoned():
    sim = VSim(**SLOW_PREFILL)
    svc = sim.service
    svc.cordon("n0")  # a prefill node
    svc.cordon("n2")  # a decode node
    burst = [sim.submit(f"c{i}", prompt(1500, seed=i)) for i in range(6)]
    sim.run_for(5.0)
    assert all(s.ok for s in burst)
    assert routed(burst) == [("n1", "n3")] * 6
    status = sim.service.status()
    assert status["nodes"]["n0"]["cordoned"] and status["nodes"]["n2"]["cordoned"]
    # A cordoned node keeps its phase: the split is unchanged.
    assert (status["split"]["prefill"], status["split"]["decode"]) == (["n0", "n1"],
                                                                        ["n2", "n3"])

    svc.cordon("n0", False)
    svc.cordon("n2", False)
    assert not sim.node("n0")["cordoned"] and not sim.node("n2")["cordoned"]
    burst = [sim.submit(f"u{i}", prompt(1500, seed=10 + i)) for i in range(6)]
    sim.run_for(5.0)
    assert all(s.ok for s in burst)
    prefill, decode = zip(*routed(burst))
    assert set(prefill) == {"n0", "n1"} and set(decode) == {"n2", "n3"}


def test_a_cordoned_node_finishes_its_running_work_and_peers_still_read_its_kv():
    sim = VSim(**SLOW_PREFILL)
    svc = sim.service
    t = prompt(4000)
    first = sim.submit("a", t[:2000], branch="agent", max_tokens=2_000)
    sim.step_until(lambda: bool(first.token_times))
    assert not first.finished
    svc.cordon("n0")  # where "agent"'s KV was prefilled
    svc.cordon("n2")  # where "a" is decoding
    assert sim.node("n2")["decoding"] == 1
    sim.run_for(5.0)
    assert first.ok and routed([first]) == [("n0", "n2")]
    assert first.record.output_tokens == 2_000  # decoded to the end on the cordoned node

    second = sim.submit("b", t[:3000], branch="agent")
    sim.run_for(5.0)
    assert second.ok and routed([second]) == [("n1", "n3")]
    # The 31 pages of "a"'s prompt came from n0's host memory, not recomputed.
    assert second.record.cached_tokens == second.record.fetched_tokens == 31 * 64


def test_cordoning_every_prefill_node_refuses_new_requests_and_an_unknown_node_is_404():
    sim = VSim()
    svc = sim.service
    with pytest.raises(RequestError) as unknown:
        svc.cordon("zz")
    assert unknown.value.status == 404
    svc.cordon("n0")
    svc.cordon("n1", force=True)  # the last prefill node: only when forced (below)
    with pytest.raises(NoNodeError, match="cordoned"):
        sim.submit("r0", prompt(640))
    c = sim.counters()
    assert (c["refused"], c["submitted"], c["failed"]) == (1, 0, 0)
    svc.cordon("n1", False)
    s = sim.submit("r1", prompt(640))
    sim.run_for(1.0)
    assert s.ok and s.record.prefill_node == "n1"


def test_cordoning_the_last_prefill_node_is_refused_and_loses_no_queued_request():
    """Issue 41, item 3: cordoning the last routable node of a phase would withdraw its
    queued, healthy requests with nowhere to route them (they failed) and refuse every new
    one until an uncordon or the planner's next window. It is refused (409, with the
    reason) and changes nothing, unless forced."""
    sim = VSim(**SLOW_PREFILL)
    svc = sim.service
    svc.cordon("n0")
    sinks = [sim.submit(f"r{i}", prompt(1500, seed=i)) for i in range(4)]
    assert sim.node("n1")["queued"] == 4
    with pytest.raises(RequestError, match="no routable prefill node") as refused:
        svc.cordon("n1")  # maintenance on both prefill nodes
    assert (refused.value.status, refused.value.code) == (409, "last_routable_node")
    assert not sim.node("n1")["cordoned"] and sim.node("n1")["queued"] == 4
    sim.run_for(1.0)
    svc.cordon("n0", False)
    sim.run_for(5.0)
    assert sim.counters()["failed"] == 0
    assert all(s.ok for s in sinks)


def test_the_last_node_of_each_phase_is_guarded_and_force_cordons_it():
    sim = VSim(**SLOW_PREFILL)
    svc = sim.service
    svc.cordon("n2")  # a decode node; n3 is the last one
    with pytest.raises(RequestError, match="no routable decode node"):
        svc.cordon("n3")
    svc.cordon("n0")
    assert svc.cordon("n0") == []  # already out of routing: nothing to guard
    # Control: forced, the old behaviour: n1's queued requests have nowhere to go.
    sinks = [sim.submit(f"r{i}", prompt(1500, seed=i)) for i in range(3)]
    assert svc.cordon("n1", force=True) == ["r1", "r2"]
    sim.run_for(5.0)
    assert [s.record.status for s in sinks] == ["ok", "NoNodeError", "NoNodeError"]


def test_a_decode_order_bound_at_submit_is_aborted_when_its_prefill_cannot_go_anywhere():
    """SGLang PD binds the decode node when it routes (``static-sglang``). The prefill node
    dies before the prefill starts and the only other prefill node is cordoned: the request
    fails, and the decode node's order is aborted too (the router let that node go before
    the lifecycle learnt the request could not be routed again)."""
    sim = VSim(policy={"name": "static-sglang"})
    svc = sim.service
    aborted = []
    for node in ("n2", "n3"):
        driver = svc.drivers[node]
        abort = driver.abort
        driver.abort = lambda rid, node=node, abort=abort: (aborted.append((node, rid)),
                                                            abort(rid))
    svc.cordon("n1")
    sim.submit("big", prompt(60_000, seed=1), max_tokens=4)  # n0 prefills it for a while
    s = sim.submit("r0", prompt(640), max_tokens=4)  # queued behind it, not started
    decode = svc.ledger.get("r0").decode
    assert decode in ("n2", "n3")  # bound at submit
    sim.engines["n0"].crash("gone")
    assert s.finished and s.record.status == "EngineError"  # node n0 down, nowhere else
    assert (decode, "r0") in aborted
