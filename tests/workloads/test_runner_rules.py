"""The context rules of the agent model (``program.py``), as the runner applies them."""

from __future__ import annotations

import numpy as np
import pytest
from workload_fakes import INF, EchoBackend, output_ids, reference_ideal, scripted, u32

from evinfra.workloads import (
    Call, Compact, Fork, Join, Pause, Phase, Reset, Runner, Spawn,
)
from evinfra.workloads.tokens import EMPTY

S, T = u32(range(1000, 1010)), u32(range(2000, 2006))
A, B, C, D = u32([3001, 3002, 3003]), u32([3101, 3102]), u32([3201]), u32([3301, 3302])


def run(make, *, system=S, task=T, delay=1.0, fail=frozenset(), stop_at=None, page=4,
        agents=1, count=1):
    backend = EchoBackend(delay=delay, fail=fail)
    runner = Runner(backend, {"t": scripted(make, system, task, count)}, page_size=page,
                    stop_at=stop_at)
    runner.closed_loop([Phase(INF, {"t": agents})])
    backend.clock.run()
    return backend, runner


def test_append_and_visible_output_only():
    def program():
        yield Call(A, 5, keep=2)
        yield Pause(3.0)
        yield Call(B, 4)

    backend, runner = run(program)
    r1, r2 = backend.requests
    out1 = output_ids(r1.request_id, 5)
    assert np.array_equal(r1.tokens, u32(S, T, A))
    # Only the last ``keep`` output tokens (the visible part) are carried.
    assert np.array_equal(r2.tokens, u32(S, T, A, out1[-2:], B))
    assert (r1.request_id, r2.request_id) == ("t-0:0#1", "t-0:0#2")
    assert [r.final for r in (r1, r2)] == [False, True]
    assert [r.max_tokens for r in (r1, r2)] == [5, 4]
    assert backend.sent_at == [0.0, 1.0 + 3.0]
    assert [rec.status for rec in runner.records] == ["ok", "ok"]
    assert runner.stats.finished == 1


def test_fork_starts_on_the_same_context():
    def child():
        yield Call(C, 2)

    def program():
        yield Call(A, 3)
        yield Fork(child())
        yield Call(B, 2)

    backend, _ = run(program)
    reqs = backend.by_id()
    out1 = output_ids("t-0:0#1", 3)
    fork = reqs["t-0:0.0#1"]
    assert np.array_equal(fork.tokens, u32(S, T, A, out1, C))
    assert fork.parent_branch_id == "t-0:0" and fork.branch_id == "t-0:0.0" and fork.final
    parent2 = reqs["t-0:0#2"]
    assert np.array_equal(parent2.tokens, u32(S, T, A, out1, B))
    assert parent2.parent_branch_id is None and parent2.final
    assert reqs["t-0:0#1"].parent_branch_id is None and not reqs["t-0:0#1"].final


def test_sub_agent_fresh_context_and_join_appends_its_result():
    X, Y = u32([4001, 4002, 4003, 4004]), u32([4101])

    def sub():
        yield Call(C, 4, keep=2)
        yield Pause(10.0)
        yield Call(D, 3)

    def program():
        yield Call(A, 3)
        yield Spawn(sub(), X, Y)
        yield Join()
        yield Call(B, 2)

    backend, _ = run(program)
    reqs = backend.by_id()
    out1 = output_ids("t-0:0#1", 3)
    s1, s2 = reqs["t-0:0.0#1"], reqs["t-0:0.0#2"]
    assert np.array_equal(s1.tokens, u32(X, Y, C)) and s1.parent_branch_id == "t-0:0"
    assert np.array_equal(s2.tokens, u32(X, Y, C, output_ids(s1.request_id, 4)[-2:], D))
    assert s2.parent_branch_id is None and s2.final and not s1.final
    # The parent waits for the sub-agent, then appends its result (its last visible output).
    p2 = reqs["t-0:0#2"]
    assert np.array_equal(p2.tokens, u32(S, T, A, out1, output_ids(s2.request_id, 3), B))
    assert backend.sent_at[backend.requests.index(p2)] == 1 + 1 + 10 + 1


def test_join_waits_for_the_listed_children_in_order():
    def sub(tokens, pause):
        def program():
            yield Pause(pause)
            yield Call(tokens, 2)
        return program()

    def program():
        yield Call(A, 1)
        yield Spawn(sub(C, 5.0), task=C)
        yield Spawn(sub(D, 1.0), task=D)
        yield Join((1,))
        yield Call(B, 1)
        yield Join()
        yield Call(B, 1)

    backend, _ = run(program)
    reqs = backend.by_id()
    r0, r1 = output_ids("t-0:0.0#1", 2), output_ids("t-0:0.1#1", 2)
    base = u32(S, T, A, output_ids("t-0:0#1", 1))
    p2 = reqs["t-0:0#2"]
    assert np.array_equal(p2.tokens, u32(base, r1, B))
    assert np.array_equal(reqs["t-0:0#3"].tokens,
                          u32(base, r1, B, output_ids(p2.request_id, 1), r0, B))
    assert backend.sent_at[backend.requests.index(p2)] == 1 + 1 + 1


def test_compact_rewrites_the_context():
    R = u32([5001, 5002, 5003])

    def program():
        yield Call(A, 3)
        yield Call(B, 4, tag="compact")
        yield Compact(R)
        yield Call(C, 2, tag="resume")

    backend, runner = run(program)
    r3 = backend.requests[2]
    summary = output_ids(backend.requests[1].request_id, 4)
    assert np.array_equal(r3.tokens, u32(S, summary, R, C))
    assert [rec.tag for rec in runner.records] == ["", "compact", "resume"]


def test_reset_sets_the_context():
    Z = u32(range(7000, 7009))

    def program():
        yield Call(A, 2)
        yield Reset(Z)
        yield Call(EMPTY, 2, keep=0)
        yield Call(B, 1)

    backend, _ = run(program)
    assert np.array_equal(backend.requests[1].tokens, Z)
    assert np.array_equal(backend.requests[2].tokens, u32(Z, B))  # keep=0: no output stays


def test_final_flag_with_trailing_ops_and_multiple_branches():
    def child():
        yield Call(C, 1)
        yield Pause(2.0)

    def program():
        yield Call(A, 1)
        yield Spawn(child(), task=C)
        yield Call(B, 1)
        yield Join()
        yield Pause(1.0)

    backend, runner = run(program)
    finals = {r.request_id: r.final for r in backend.requests}
    assert finals == {"t-0:0#1": False, "t-0:0.0#1": True, "t-0:0#2": True}
    assert runner.stats.finished == 1


def test_a_failed_call_continues_with_no_output():
    def program():
        yield Call(A, 3)
        yield Call(B, 2)
        yield Call(C, 2)

    backend, runner = run(program, fail=frozenset({"t-0:0#2"}))
    r2, r3 = backend.requests[1:]
    assert np.array_equal(r3.tokens, u32(r2.tokens, C))
    rec = runner.records[1]
    assert (rec.status, rec.error, rec.output_tokens) == ("error", "injected failure", 0)
    assert runner.stats.errors == 1 and r3.final


def test_stop_time_ends_requests_and_agents():
    def program():
        for _ in range(10):
            yield Call(A, 1)
            yield Pause(2.0)

    backend, runner = run(program, stop_at=7.5, agents=2, count=100)
    assert max(backend.sent_at) < 7.5
    assert len(backend.requests) == 2 * 3  # sends at 0, 3, 6 for each of the two agents
    assert all(rec.status == "ok" for rec in runner.records)  # in flight at stop: answered
    assert runner.stats.arrived == 2


def test_join_of_an_unknown_child_is_an_error():
    def program():
        yield Call(A, 1)
        yield Join((0,))

    with pytest.raises(IndexError):
        run(program)


def test_ideal_reuse_matches_the_reference_with_forks_and_outputs():
    def child(tokens):
        def program():
            yield Call(tokens, 6)
            yield Call(tokens, 3, keep=1)
        return program()

    def program():
        yield Call(u32(range(3000, 3013)), 9)
        yield Fork(child(C))
        yield Fork(child(D))
        yield Call(B, 7, keep=3)
        yield Join()
        yield Call(A, 5)
        yield Compact(A)
        yield Call(B, 2)

    backend, runner = run(program, agents=2, count=3, page=4)
    expected = reference_ideal(backend.events, 4)
    assert {rec.request_id: rec.ideal_cached for rec in runner.records} == expected
    assert sum(expected.values()) > 0
