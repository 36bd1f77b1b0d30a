"""Phase switches, withdrawals, aborts, crashes and stalls, and the driver surface."""

import asyncio

import pytest
from fake_harness import TEST_TIMING, Harness, path, tokens

from evinfra.core.bus import Bus
from evinfra.core.clock import WallClock
from evinfra.core.contracts import DecodeOrder, PrefillOrder, Sampling
from evinfra.core.events import (AllBlocksCleared, NodeDown, NodeState, NodeUp, PhaseSwitched,
                                 PrefillDone, PrefillStarted, RequestFailed, TokensOut, Withdrawn)
from evinfra.core.types import Phase, Tier
from evinfra.drivers.base import EngineDriver
from evinfra.drivers.fake import FakeCluster, FakeEngineConfig

CFG = FakeEngineConfig(**TEST_TIMING)


def test_a_switch_waits_for_running_requests_and_keeps_the_kv() -> None:
    h = Harness()
    t = tokens(5_000)
    h.submit("r", t, max_tokens=300)
    h.run(0.5)  # r is decoding on d0
    d0 = h.engines["d0"]
    d0.switch_phase(Phase.PREFILL)
    h.run(30)
    end = h.output("r")[2]
    switched = h.one(PhaseSwitched, node="d0")
    assert switched.phase == "prefill" and switched.time == pytest.approx(end + CFG.switch_latency)
    assert d0.phase is Phase.PREFILL
    assert not [e for e in h.kv("d0") if type(e) is AllBlocksCleared]
    assert d0.cache.l2_prefix(path(t)) == len(path(t))  # its KV stays in the pool
    states = h.of(NodeState, node="d0")
    assert states[-1].phase == "prefill"


def test_a_switch_to_prefill_waits_for_the_decode_batch_and_keeps_prefilling() -> None:
    h = Harness(nodes=[("c0", Phase.COLLOCATED)])
    h.submit("a", tokens(3_000), prefill="c0", decode="c0", max_tokens=100)
    h.run(0.2)
    h.engines["c0"].switch_phase(Phase.PREFILL)
    h.submit("b", tokens(3_000, seed=1), prefill="c0", decode="c0", max_tokens=5)
    h.run(30)
    switched = h.one(PhaseSwitched).time
    # The phase it keeps goes on; the phase it leaves starts nothing new until the switch.
    assert h.one(PrefillStarted, request="b").time < h.output("a")[2] < switched
    assert h.of(TokensOut, request="b")[0].time >= switched


def test_a_switch_to_prefill_drains_the_batch_under_an_endless_prefill_queue() -> None:
    h = Harness(nodes=[("c0", Phase.COLLOCATED)])
    h.submit("a", tokens(3_000), prefill="c0", decode="c0", max_tokens=60)
    h.run(0.2)
    h.engines["c0"].switch_phase(Phase.PREFILL)
    for i in range(40):  # prefill work for far longer than the batch needs to finish
        h.submit(f"q{i}", tokens(8_000, seed=i + 1), prefill="c0", decode="c0", max_tokens=1)
    h.run(120)
    switched = h.one(PhaseSwitched).time
    last_start = max(e.time for e in h.of(PrefillStarted) if e.request.startswith("q"))
    assert h.output("a")[2] < switched < last_start


def test_a_switch_to_decode_waits_only_for_the_chunked_prefill() -> None:
    h = Harness(nodes=[("c0", Phase.COLLOCATED)])
    h.submit("a", tokens(3_000), prefill="c0", decode="c0", max_tokens=400)
    h.run(0.2)
    h.engines["c0"].switch_phase(Phase.DECODE)
    h.submit("b", tokens(3_000, seed=1), prefill="c0", decode="c0", max_tokens=5)
    h.run(60)
    switched = h.one(PhaseSwitched).time
    assert switched < h.output("a")[2]  # its decode batch did not hold the switch
    assert h.one(PrefillStarted, request="b").time >= switched


def test_withdraw_takes_back_only_requests_whose_prefill_has_not_started() -> None:
    h = Harness()
    h.submit("running", tokens(20_000))
    h.submit("queued", tokens(5_000, seed=1))
    p0 = h.engines["p0"]
    p0.withdraw("running")
    p0.withdraw("queued")
    h.run(5)
    assert h.one(Withdrawn).request == "queued"
    assert not h.of(PrefillStarted, request="queued")
    assert h.output("running")[1] == "length"
    assert p0.cache.kv_room == CFG.l1_tokens
    h.check()


@pytest.mark.parametrize("when", [0.0, 0.1, 0.2105, 0.4])
def test_abort_frees_the_kv_wherever_the_request_is(when: float) -> None:
    h = Harness()
    h.submit("r", tokens(9_000), max_tokens=50)
    h.submit("other", tokens(3_000, seed=1), max_tokens=20)
    h.clock.call_at(when, h.engines["d0"].abort, "r")
    h.run(10)
    assert not [e for e in h.of(TokensOut, request="r") if e.finish]
    assert h.output("other")[1] == "length"
    for e in h.engines.values():
        assert e.cache.kv_room == CFG.l1_tokens and e.cache.reserved == 0
    assert not h.of(RequestFailed)
    h.check()


def test_a_crash_fails_in_flight_requests_and_later_orders() -> None:
    h = Harness(nodes=[("p0", Phase.PREFILL), ("p1", Phase.PREFILL), ("d0", Phase.DECODE)])
    h.submit("decoding", tokens(2_000), max_tokens=400)
    h.run(1)
    h.submit("prefilling", tokens(30_000, seed=1), prefill="p1")
    h.submit("queued", tokens(3_000, seed=2), prefill="p1")
    h.run(1.05)
    h.engines["p1"].crash("power")
    h.engines["d0"].crash("power")
    h.run(3)
    failed = {(e.request, e.node): e.started for e in h.of(RequestFailed)}
    # each dead node answers for what it held: "prefilling" was already bound to d0
    assert failed == {("decoding", "d0"): True, ("prefilling", "p1"): True,
                      ("prefilling", "d0"): True, ("queued", "p1"): False}
    assert {e.node for e in h.of(NodeDown)} == {"p1", "d0"}
    h.engines["p1"].submit_prefill(PrefillOrder("late", tokens(100), [], [], Sampling(4)))
    assert h.events[-1] == RequestFailed("late", "p1", 3.0, "node p1 is down", False)
    assert not h.engines["p1"].healthy() and h.engines["p0"].healthy()
    assert h.engines["p1"].cache.l2_used == 0
    n = len(h.events)
    h.run(10)
    assert not [e for e in h.events[n:] if getattr(e, "node", None) in ("p1", "d0")]


def test_a_restarted_engine_serves_again_empty_in_its_phase() -> None:
    """Crashed mid-prefill and mid-switch, then relaunched: ``NodeUp``, then its phase and
    state, heartbeats again, and serves."""
    h = Harness(nodes=[("p0", Phase.PREFILL), ("p1", Phase.PREFILL), ("d0", Phase.DECODE)])
    h.submit("lost", tokens(30_000), prefill="p1")
    h.run(1.02)
    h.engines["p1"].switch_phase(Phase.DECODE)
    h.engines["p1"].crash("power")
    h.run(1.5)
    n = len(h.events)
    h.engines["p1"].restart()
    assert [type(e) for e in h.events[n:n + 3]] == [NodeUp, PhaseSwitched, NodeState]
    assert h.events[n + 1] == PhaseSwitched("p1", "prefill", 1.5)
    assert h.engines["p1"].healthy() and h.engines["p1"].cache.l1_used == 0
    h.submit("again", tokens(3_000, seed=3), prefill="p1")
    h.run(10.2)
    assert h.output("again")[1] == "length" and h.one(PrefillDone, request="again").cached == 0
    assert len([e for e in h.of(NodeState, node="p1") if e.time > 1.5 and not e.launched]) >= 8
    h.check()

def test_a_crashed_decode_node_releases_the_prefill_side() -> None:
    h = Harness()
    h.submit("r", tokens(30_000), max_tokens=10)
    h.clock.call_at(0.05, h.engines["d0"].crash)  # bound, prefill still running
    h.run(5)
    assert h.one(RequestFailed).node == "d0" and not h.of(PrefillDone)
    assert h.engines["p0"].cache.kv_room == CFG.l1_tokens


def test_a_stalled_engine_is_silent_until_resumed() -> None:
    h = Harness()
    h.submit("r", tokens(20_000), max_tokens=5)
    h.clock.call_at(0.1, h.engines["p0"].stall)
    h.run(5)
    assert not h.of(PrefillDone) and h.engines["p0"].healthy()
    assert not [e for e in h.events if getattr(e, "node", None) == "p0" and e.time > 0.1]
    h.engines["p0"].resume()
    h.run(10)
    assert h.one(PrefillDone).time > 5 and h.output("r")[1] == "length"


async def test_fake_driver_serves_on_the_wall_clock() -> None:
    bus = Bus()
    cluster = FakeCluster([("p0", Phase.PREFILL), ("d0", Phase.DECODE)],
                          FakeEngineConfig(**TEST_TIMING), WallClock(), bus)
    drivers = cluster.drivers()
    assert all(isinstance(d, EngineDriver) for d in drivers.values())
    for d in drivers.values():
        await d.start()
    done = asyncio.get_running_loop().create_future()
    out: list[int] = []

    def collect(e: TokensOut) -> None:
        out.extend(e.tokens)
        if e.finish and not done.done():
            done.set_result(e.finish)

    t = tokens(1_000)
    s = Sampling(max_tokens=8, ignore_eos=True)
    bus.subscribe(TokensOut, collect)
    bus.subscribe(PrefillStarted, lambda e: drivers["d0"].submit_decode(
        DecodeOrder(e.request, "p0", t, path(t), s)))
    drivers["p0"].submit_prefill(PrefillOrder("r", t, path(t), [], s))
    assert await asyncio.wait_for(done, 5) == "length" and len(out) == 8
    for d in drivers.values():
        await d.stop()
    assert not drivers["p0"].healthy()
    assert cluster.engines["d0"].cache.blocks(Tier.L2) == set()


def test_state_comes_at_every_launch_and_as_a_heartbeat_otherwise() -> None:
    h = Harness(streaming="batched")
    h.submit("r", tokens(2_000), max_tokens=400)  # a long decode run on d0, woken rarely
    h.run(12.5)
    for node in ("p0", "d0"):
        times = [s.time for s in h.of(NodeState, node=node)]
        assert times[0] == 0.0 and max(b - a for a, b in zip(times, times[1:])) <= 1.0 + 1e-9
        assert times[-1] > 11.5
    launched = [s for s in h.of(NodeState, node="p0") if s.launched]
    assert [(i.request, i.t_uc) for s in launched for i in s.launched] == [("r", 2_000)]
    busy = [s for s in h.of(NodeState, node="d0") if s.decoding]
    assert busy and busy[0].kv_room < CFG.l1_tokens and busy[0].l1_used > 2_000


def test_a_source_crash_during_the_transfer_frees_the_decode_side() -> None:
    h = Harness()
    h.submit("r", tokens(60_000), max_tokens=10)
    # the transfer to d0 takes 60K x pd_s_per_token, about 16 ms: crash p0 halfway
    h.bus.subscribe(PrefillDone, lambda e: h.clock.call_later(0.008, h.engines["p0"].crash))
    h.run(5)
    assert [(e.node, e.started) for e in h.of(RequestFailed)] == [("p0", True)]
    assert not h.of(TokensOut)
    d0 = h.engines["d0"]
    assert d0.cache.kv_room == CFG.l1_tokens and d0.cache.reserved == 0
    assert h.of(NodeState, node="d0")[-1].decoding == 0
    h.check()
