"""``server.branch_idle_s`` in virtual time: the service ends a branch its harness forgot once
it has been idle for the limit, and releases its KV counts; never before, never while a
request of it is in flight, never one that is active more often than the limit, and never
one its harness ended (the final flag or ``end_branch``) a second time.

Why virtual time: against a wall-clock limit with sleeps (this file's predecessor in
tests/api used 0.3 s), the "not yet" and "already" checks are a scheduler hiccup away from
flaking, and they can only bracket the expiry loosely. On the simulator's VirtualClock the
sweep runs at exact instants (every ``branch_idle_s / 8``, from the start), so each test
looks at the branch a millisecond before the limit and right after the first sweep past it.
"""

from __future__ import annotations

import pytest

from evinfra.errors import UnknownBranchError
from tests.control.virtual import VSim, prompt

LIMIT = 8.0
SWEEP = LIMIT / 8  # the service sweeps its idle orders every eighth of the shortest limit
EPS = 1e-3


@pytest.fixture
def sim() -> VSim:
    return VSim(server={"branch_idle_s": LIMIT})


def expired(sim: VSim) -> int:
    return sim.counters()["branches_expired"]


def counted_blocks(sim: VSim) -> dict[str, int]:
    """Blocks with a positive count, per node, as ``status()`` reports them."""
    return {n: v["positive_count_blocks"]
            for n, v in sim.service.status()["directory"]["nodes"].items()}


def expires_between(sim: VSim, branch: str, idle_from: float) -> float:
    """Check ``branch`` is kept until just before ``idle_from + LIMIT`` and ended by the
    first sweep past it; the virtual time it was found gone."""
    sim.run_to(idle_from + LIMIT - EPS)
    assert sim.has_branch(branch), "ended before it was idle for the limit"
    gone = sim.step_until(lambda: not sim.has_branch(branch), dt=0.01, limit=2 * SWEEP)
    assert idle_from + LIMIT <= gone <= idle_from + LIMIT + SWEEP + 0.01
    return gone


def test_an_idle_branch_is_ended_after_the_limit_and_its_counts_released(sim):
    s = sim.submit("r0", prompt(640), branch="forgotten")  # ten pages of 64 tokens
    sim.run_for(1.0)
    assert s.ok
    counts = sim.service.branch_counts("forgotten")
    assert counts == {"n0": 10, "n2": 10}  # prefilled on n0, decoded on n2: counted on both
    assert counted_blocks(sim) == {"n0": 10, "n1": 0, "n2": 10, "n3": 0}

    sim.run_to(s.record.end + LIMIT - EPS)
    assert sim.service.branch_counts("forgotten") == counts  # idle, but not for long enough
    assert expired(sim) == 0

    expires_between(sim, "forgotten", s.record.end)
    with pytest.raises(UnknownBranchError):
        sim.service.branch_counts("forgotten")
    assert expired(sim) == 1
    assert counted_blocks(sim) == {"n0": 0, "n1": 0, "n2": 0, "n3": 0}
    assert sim.service.status()["directory"]["active_branches"] == 0

    # The harness comes back after all: the branch starts afresh and is served.
    again = sim.submit("r1", prompt(640), branch="forgotten")
    sim.run_for(1.0)
    assert again.ok and sim.has_branch("forgotten")
    assert expired(sim) == 1


def test_a_branch_with_a_request_in_flight_is_kept(sim):
    first = sim.submit("r0", prompt(640), branch="busy")
    sim.run_for(5.0)
    assert first.ok
    # The branch's next request decodes for ~12 virtual seconds: past the limit counted from
    # the end of the first one, and past the limit on its own.
    long = sim.submit("r1", prompt(700), branch="busy", max_tokens=20_000)
    sim.run_to(first.record.end + LIMIT + 3 * SWEEP)
    assert not long.finished and sim.service.in_flight() == 1
    assert sim.has_branch("busy") and expired(sim) == 0
    sim.step_until(lambda: long.finished, dt=0.5, limit=60.0)
    assert long.ok and long.record.end - long.record.arrival > LIMIT
    assert sim.has_branch("busy") and expired(sim) == 0
    # Idle from the end of its last request on.
    expires_between(sim, "busy", long.record.end)
    assert expired(sim) == 1


def test_a_branch_active_more_often_than_the_limit_is_kept(sim):
    tokens = prompt(2000)
    step = LIMIT * 0.6  # a new turn every 4.8 s: never idle for 8 s
    sinks = []
    for turn in range(6):
        if sinks:
            sim.run_to(sinks[-1].record.arrival + step - EPS)
            assert sim.has_branch("agent") and expired(sim) == 0
            sim.run_to(sinks[-1].record.arrival + step)
        sinks.append(sim.submit(f"r{turn}", tokens[: 640 + 128 * turn], branch="agent"))
        sim.run_for(0.5)
        assert sinks[-1].ok
    assert sinks[-1].record.end - sinks[0].record.arrival > 3 * LIMIT
    assert expired(sim) == 0
    # The context grew by two pages a turn: the branch counts all of it.
    assert sim.service.branch_counts("agent")["n0"] == (640 + 128 * 5) // 64
    expires_between(sim, "agent", sinks[-1].record.end)
    assert expired(sim) == 1


def test_an_aborted_request_leaves_its_branch_idle_from_the_abort(sim):
    s = sim.submit("r0", prompt(640), branch="gone", max_tokens=20_000)
    sim.run_for(3.0)
    assert not s.finished
    sim.service.abort("r0")
    assert s.finished and s.record.status == "aborted" and s.done_calls == 1
    assert sim.counters()["aborted"] == 1 and sim.counters()["failed"] == 0
    assert sim.service.in_flight() == 0
    expires_between(sim, "gone", s.done_at)
    assert expired(sim) == 1


def test_a_branch_ended_by_its_harness_is_not_expired_again(sim):
    # The final flag ends the branch with its last request.
    final = sim.submit("r0", prompt(640, seed=1), branch="final", final=True)
    # end_branch on an idle branch ends it at once.
    idle = sim.submit("r1", prompt(640, seed=2), branch="ended")
    # end_branch while a request runs ends it when that request is done.
    running = sim.submit("r2", prompt(640, seed=3), branch="running", max_tokens=5_000)
    sim.run_for(1.0)
    assert final.ok and idle.ok and not running.finished
    assert not sim.has_branch("final")
    assert sim.has_branch("ended")
    sim.service.end_branch("ended")
    assert not sim.has_branch("ended")
    sim.service.end_branch("running")
    assert sim.has_branch("running")  # its counts outlive the request in flight
    sim.step_until(lambda: running.finished, dt=0.1)
    assert running.ok and not sim.has_branch("running")
    assert counted_blocks(sim) == {"n0": 0, "n1": 0, "n2": 0, "n3": 0}

    sim.run_for(3 * LIMIT)
    assert expired(sim) == 0
    assert sim.service.status()["directory"]["active_branches"] == 0
    # Ending it again is a harness error (404 over HTTP), not a second end.
    with pytest.raises(UnknownBranchError):
        sim.service.end_branch("ended")
    assert expired(sim) == 0
