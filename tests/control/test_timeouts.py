"""Request timeouts in virtual time: a request on a stalled fake engine fails on its sink with a
timeout error (``EngineError.timeout``) exactly when ``server.first_token_timeout_s`` (no
first token) or ``server.token_timeout_s`` (no further output) runs out, not a moment
before, counted in ``timeouts``; the stalled engine, resumed, neither answers the failed
request late nor keeps it. ``stop()`` fails what is still in flight the same way.

Why virtual time: tests/api/test_faults.py waits out a 0.5 s wall-clock limit and can only
check that the 504 came "within 3 s". Here the service's timer and the stalled engine run
on one VirtualClock, so a test checks the sink a millisecond before the limit and at the
limit itself, and the failure time is an exact number.

The fake engines run in ``batched`` streaming (the simulator's mode): they stream the first
token and then the rest at the finish, so a decode longer than ``token_timeout_s`` would
look stalled. Decodes here are kept well under it.
"""

from __future__ import annotations

import asyncio

import pytest

from evinfra.errors import EngineError, NoNodeError
from tests.control.virtual import Sink, VSim, prompt

EPS = 1e-3
PREFILL, DECODE = ("n0", "n1"), ("n2", "n3")


def stall(sim: VSim, nodes) -> None:
    for n in nodes:
        sim.engines[n].stall()


def resume(sim: VSim, nodes) -> None:
    for n in nodes:
        sim.engines[n].resume()


def test_no_first_token_from_a_stalled_prefill_node_fails_at_the_limit():
    sim = VSim(server={"first_token_timeout_s": 5.0, "token_timeout_s": 2.0})
    stall(sim, PREFILL)
    t0 = sim.now
    s = sim.submit("r0", prompt(640))
    sim.run_to(t0 + 5.0 - EPS)
    assert not s.finished and sim.service.in_flight() == 1
    assert sim.counters()["timeouts"] == 0
    sim.run_to(t0 + 5.0)
    assert s.done_calls == 1 and s.done_at == pytest.approx(t0 + 5.0, abs=1e-9)
    assert isinstance(s.error, EngineError) and s.error.timeout
    assert s.error.node == s.record.prefill_node in PREFILL
    assert "no first token within 5 s" in s.error.message
    assert s.record.status == "EngineError" and s.record.first_token is None
    assert s.out == []
    c = sim.counters()
    assert (c["timeouts"], c["failed"], c["ok"], c["submitted"]) == (1, 1, 0, 1)
    assert sim.service.in_flight() == 0

    # The engine comes back: the failed request stays failed (it was aborted there), the
    # node holds nothing of it, and it serves the next request.
    resume(sim, PREFILL)
    sim.run_for(1.0)
    assert s.done_calls == 1 and s.out == []
    nodes = sim.service.status()["nodes"]
    assert all(v["queued"] == v["prefilling"] == v["decoding"] == 0 for v in nodes.values())
    # The engine's own report: no KV kept for the request (not aborted, it would prefill
    # it on resume and hold it for a decode node that never comes).
    assert nodes[s.record.prefill_node]["l1_used"] == 0
    nxt = sim.submit("r1", prompt(640, seed=1))
    sim.run_for(1.0)
    assert nxt.ok and sim.counters()["timeouts"] == 1


def test_a_first_token_just_inside_the_limit_is_no_timeout():
    sim = VSim(server={"first_token_timeout_s": 5.0, "token_timeout_s": 2.0})
    stall(sim, PREFILL)
    t0 = sim.now
    s = sim.submit("r0", prompt(640))
    sim.run_to(t0 + 4.9)
    resume(sim, PREFILL)  # everything that came due while stalled happens now
    sim.run_for(1.0)
    assert s.ok and t0 + 4.9 <= s.record.first_token < t0 + 5.0
    assert sim.counters()["timeouts"] == 0 and sim.counters()["failed"] == 0


def stall_decoders_at_first_token(sim: VSim):
    def on_tokens(sink: Sink) -> None:
        if len(sink.token_times) == 1:
            stall(sim, DECODE)
    return on_tokens


def test_no_output_after_the_first_token_fails_at_the_token_limit():
    # token_timeout_s > first_token_timeout_s here; the next test has the other order.
    sim = VSim(server={"first_token_timeout_s": 2.0, "token_timeout_s": 3.0})
    s = sim.submit("r0", prompt(640), max_tokens=500, on_tokens=stall_decoders_at_first_token(sim))
    sim.step_until(lambda: bool(s.token_times), dt=EPS)
    first = s.token_times[0]
    sim.run_to(first + 3.0 - EPS)
    assert not s.finished and len(s.out) == 1
    sim.run_to(first + 3.0)
    assert s.finished and s.done_at == pytest.approx(first + 3.0, abs=1e-9)
    assert isinstance(s.error, EngineError) and s.error.timeout
    assert s.error.node == s.record.decode_node in DECODE
    assert "no output within 3 s" in s.error.message
    assert s.record.first_token == pytest.approx(first) and s.record.output_tokens == 1
    assert sim.counters()["timeouts"] == 1 and sim.service.in_flight() == 0
    resume(sim, DECODE)
    sim.run_for(1.0)
    assert s.done_calls == 1 and len(s.out) == 1  # nothing comes after the failure


def test_the_token_limit_counts_from_the_first_token_when_it_is_the_shorter():
    """The timer armed at arrival for the first-token limit (5 s) is re-armed at the first
    token for the token limit (2 s): a stall right after the first token fails at
    first + 2 s, not at arrival + 5 s."""
    sim = VSim(server={"first_token_timeout_s": 5.0, "token_timeout_s": 2.0})
    s = sim.submit("r0", prompt(640), max_tokens=500, on_tokens=stall_decoders_at_first_token(sim))
    sim.step_until(lambda: bool(s.token_times), dt=EPS)
    first = s.token_times[0]
    sim.run_to(first + 2.0 - EPS)
    assert not s.finished
    sim.run_to(first + 2.0)
    assert s.finished and s.error is not None and s.error.timeout
    assert "no output within 2 s" in s.error.message
    assert sim.counters()["timeouts"] == 1


def test_stop_fails_what_is_in_flight_and_refuses_new_work():
    sim = VSim()
    ran = sim.submit("r0", prompt(640), max_tokens=5_000)
    sim.run_for(0.5)
    assert not ran.finished and len(ran.out) == 1
    asyncio.run(sim.service.stop())
    assert ran.done_calls == 1 and isinstance(ran.error, EngineError)
    assert "shutting down" in ran.error.message and not ran.error.timeout
    assert sim.service.in_flight() == 0
    c = sim.counters()
    assert (c["failed"], c["ok"], c["timeouts"]) == (1, 0, 0)
    with pytest.raises(NoNodeError):
        sim.submit("r1", prompt(640, seed=1))
    assert sim.counters()["submitted"] == 1
    sim.run_for(5.0)  # the crashed engines' late reports change nothing
    assert ran.done_calls == 1
