"""Phase switches by ``Service.force_split`` in virtual time (paper 4.2): after the warm-up an
operator moves a node to the other phase; the node is no longer routed its old phase at once,
hands back its queued, unstarted prefills, finishes the work it is running, and only then
switches (``status()["split"]["switching"]`` empties, then the node serves its new phase);
no request is lost on the way: every one submitted before, during and after finishes ok.

Why virtual time: the drain is a race between the engines' running work and the switch.
On the VirtualClock the test submits a burst at one instant, forces the split at that same
instant, and steps the clock in milliseconds, so it sees each state the node passes through
(draining, drained, switched) in order and can compare those instants with the requests'
own times, identically on every run.
"""

from __future__ import annotations

import pytest

from evinfra.errors import RequestError
from tests.control.virtual import FAST, VSim, prompt

SWITCH_LATENCY = FAST["switch_latency"]
STEP = 0.001  # how finely the tests step the clock while a node switches


def watch(sim: VSim, node: str, dt: float = STEP):
    """Step the clock until ``node`` serves a settled phase again; returns the history of
    ``(time, switching, phase, draining_to, prefilling, decoding)`` at each step."""
    history = []

    def settled() -> bool:
        st = sim.service.status()
        v = st["nodes"][node]
        history.append((sim.now, dict(st["split"]["switching"]), v["phase"], v["draining_to"],
                        v["prefilling"], v["decoding"]))
        return v["draining_to"] is None

    sim.step_until(settled, dt=dt, limit=30.0)
    return history


def first(history, pred) -> float:
    return next(h[0] for h in history if pred(h))


def all_ok(sim: VSim, sinks) -> None:
    assert all(s.ok for s in sinks), [s.record for s in sinks if not s.ok]
    c = sim.counters()
    assert c["submitted"] == c["ok"] == len(sinks)
    assert c["failed"] == c["aborted"] == 0 and sim.service.in_flight() == 0


def test_a_decode_node_finishes_its_decodes_then_serves_prefill():
    sim = VSim()
    svc = sim.service
    running = [sim.submit(f"r{i}", prompt(1000, seed=i), max_tokens=3_000) for i in range(4)]
    sim.run_for(0.1)
    assert all(len(s.out) == 1 for s in running)  # decoding, ~1.8 virtual s to go
    assert sim.node("n2")["decoding"] == 2 and sim.node("n3")["decoding"] == 2
    before = svc.status()["directory"]["nodes"]["n2"]
    assert before["positive_count_blocks"] > 0

    # Leaving the collocated warm-up moved every node to a phase, and none of that counts.
    assert (sim.counters()["splits"], sim.counters()["switches"]) == (0, 0)
    t_force = sim.now
    split = svc.force_split(["n0", "n1", "n2"])
    assert (sim.counters()["splits"], sim.counters()["switches"]) == (1, 0)  # not served yet
    assert (split.prefill, split.decode) == (("n0", "n1", "n2"), ("n3",))
    st = svc.status()
    assert st["split"]["switching"] == {"n2": "prefill"}
    assert st["nodes"]["n2"]["phase"] == "decode" and st["nodes"]["n2"]["draining_to"] == "prefill"
    with pytest.raises(RequestError) as busy:  # one switch at a time
        svc.force_split(["n0"])
    assert busy.value.status == 409

    # While n2 drains it gets no work of either phase.
    during = [sim.submit(f"d{i}", prompt(1000, seed=10 + i), max_tokens=50) for i in range(4)]
    history = watch(sim, "n2")
    t_drained = first(history, lambda h: not h[1])
    t_switched = first(history, lambda h: h[2] == "prefill")
    on_n2 = [s for s in running if s.record.decode_node == "n2"]
    assert len(on_n2) == 2
    last_end = max(s.record.end for s in on_n2)
    # It decoded its requests to their end after the decision, then drained, then switched.
    assert all(s.ok and s.record.output_tokens == 3_000 for s in on_n2)
    assert t_force + 1.0 < last_end <= t_drained < t_switched
    assert t_switched >= last_end + SWITCH_LATENCY - 1e-9
    assert all(h[5] > 0 for h in history if h[0] < last_end)
    assert all(s.ok for s in during)
    assert {s.record.prefill_node for s in during} <= {"n0", "n1"}
    assert {s.record.decode_node for s in during} == {"n3"}

    st = svc.status()
    assert (st["split"]["prefill"], st["split"]["decode"], st["split"]["label"]) == (
        ["n0", "n1", "n2"], ["n3"], "3P1D")
    assert (st["counters"]["splits"], st["counters"]["switches"]) == (1, 1)
    after = st["directory"]["nodes"]["n2"]
    # D->P resets the node's counts (E.2 line 14); the in-place switch keeps its KV.
    assert after["phase"] == "prefill" and after["positive_count_blocks"] == 0
    assert after["blocks"] >= before["blocks"] > 0

    # It serves its new phase.
    burst = [sim.submit(f"a{i}", prompt(2000, seed=20 + i)) for i in range(6)]
    sim.run_for(5.0)
    assert "n2" in {s.record.prefill_node for s in burst}
    assert {s.record.decode_node for s in burst} == {"n3"}
    all_ok(sim, running + during + burst)


def test_a_prefill_node_hands_back_its_queue_finishes_its_prefill_then_serves_decode():
    sim = VSim(fake={**FAST, "c1": 2e-4})  # 0.3 s per 1500-token prefill: queues build
    svc = sim.service
    sinks = [sim.submit(f"r{i}", prompt(1500, seed=i)) for i in range(8)]
    assert [(sim.node(n)["queued"], sim.node(n)["prefilling"]) for n in ("n0", "n1")] == [
        (4, 1), (4, 1)]  # each runs one, three wait

    svc.force_split(["n0"])
    st = svc.status()
    assert st["split"]["switching"] == {"n1": "decode"}
    n1 = st["nodes"]["n1"]
    assert (n1["phase"], n1["draining_to"], n1["queued"], n1["prefilling"]) == (
        "prefill", "decode", 1, 1)  # its three waiting prefills went back to n0 at once
    assert st["nodes"]["n0"]["queued"] == 7

    history = watch(sim, "n1")
    t_drained = first(history, lambda h: not h[1])
    t_switched = first(history, lambda h: h[2] == "decode")
    # Its running prefill held the switch back: drained only once it was done.
    assert all(h[4] == 1 for h in history if h[0] < t_drained)
    assert t_drained > history[0][0]
    assert t_switched - t_drained >= SWITCH_LATENCY - STEP  # the switch, after the drain

    sim.run_for(5.0)
    stayed = [s for s in sinks if s.record.prefill_node == "n1"]
    moved = [s for s in sinks if s.record.reroutes]
    assert len(stayed) == 1 and stayed[0].record.reroutes == 0
    assert stayed[0].record.prefill_start < t_drained
    assert len(moved) == 3 and {s.record.prefill_node for s in moved} == {"n0"}

    assert svc.status()["split"]["label"] == "1P3D"
    burst = [sim.submit(f"a{i}", prompt(1500, seed=20 + i)) for i in range(6)]
    sim.run_for(5.0)
    assert {s.record.prefill_node for s in burst} == {"n0"}
    assert "n1" in {s.record.decode_node for s in burst}  # it serves decode now
    all_ok(sim, sinks + burst)


def test_a_split_forced_during_the_warm_up_ends_it_without_a_drain():
    sim = VSim(warm=False)
    svc = sim.service
    sim.run_to(0.5)
    assert svc.status()["warming_up"] and svc.status()["split"]["label"] == "4C"
    sinks = [sim.submit(f"r{i}", prompt(1000, seed=i), max_tokens=500) for i in range(4)]
    sim.run_for(0.01)
    svc.force_split(["n0"])
    st = svc.status()
    # Collocated nodes serve both phases already: each takes its phase at once.
    assert not st["warming_up"] and st["split"]["switching"] == {}
    assert (st["split"]["prefill"], st["split"]["decode"]) == (["n0"], ["n1", "n2", "n3"])
    sim.run_for(5.0)
    later = [sim.submit(f"l{i}", prompt(1000, seed=10 + i)) for i in range(4)]
    sim.run_for(5.0)
    assert {s.record.prefill_node for s in later} == {"n0"}
    assert "n0" not in {s.record.decode_node for s in later}
    all_ok(sim, sinks + later)


def test_force_split_refuses_a_split_the_cluster_cannot_take():
    sim = VSim()
    svc = sim.service
    for bad in (["zz"], ["n0", "n1", "n2", "n3"], []):
        with pytest.raises(RequestError):
            svc.force_split(bad)
    st = svc.status()
    assert st["split"]["label"] == "2P2D" and st["split"]["switching"] == {}
    assert (st["counters"]["splits"], st["counters"]["switches"]) == (0, 0)  # (the warm-up's end)
