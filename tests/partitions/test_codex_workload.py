"""The ``codex`` generator (``evinfra/workloads/codex.py``): deterministic, the documented
shape (tool results cut at the CLI's 10 KiB, no sub-agents, compaction past 90 % of 272K),
and unlike ``cc`` (more, smaller steps on shorter instructions)."""

from __future__ import annotations

import numpy as np

from evinfra.workloads import CC, Call, Compact, Pause, Spawn, make_workload
from evinfra.workloads.codex import COMPACT_AT, KEPT_USER, Codex


def ops(agent):
    return list(agent.root.program)


def calls(agent) -> list[Call]:
    return [op for op in ops(agent) if isinstance(op, Call)]


def test_same_seed_same_agents_and_another_seed_others():
    a, b, c = Codex(5).agent(3), Codex(5).agent(3), Codex(6).agent(3)
    assert np.array_equal(a.root.system, b.root.system)
    sa, sb, sc = calls(a), calls(b), calls(c)
    assert [(x.append.size, x.output, x.keep) for x in sa] == [
        (x.append.size, x.output, x.keep) for x in sb]
    assert [(x.append.size, x.output) for x in sa] != [(x.append.size, x.output) for x in sc]
    assert make_workload("codex", 5).agent(3).agent_id == "codex-3"


def test_the_documented_shape():
    w = Codex(1)
    steps, results, pauses = [], [], []
    for i in range(40):
        agent = w.agent(i)
        assert 3_000 <= agent.root.system.size <= 10_000
        body = ops(agent)
        assert not any(isinstance(op, Spawn) for op in body)  # no sub-agents
        cs = [op for op in body if isinstance(op, Call)]
        steps.append(len(cs))
        results += [c.append.size for c in cs if c.tag == "tool"]
        pauses += [op.seconds for op in body if isinstance(op, Pause)]
        assert all(c.keep is not None and c.keep <= c.output for c in cs if c.tag != "compact")
    assert max(results) == 2_560 and 0.1 < np.mean(np.array(results) == 2_560) < 0.4  # cut
    assert np.median(steps) > 20  # 5-60 steps a turn, 1-4 turns
    assert np.median(pauses) < 10


def test_compaction_past_the_limit_keeps_the_user_messages_only():
    for i in range(300):
        agent = Codex(2).agent(i)
        context = agent.root.system.size + agent.root.task.size
        body = ops(agent)
        for j, op in enumerate(body):
            if isinstance(op, Call):
                if op.tag == "compact":
                    assert context + op.append.size > COMPACT_AT - 3_000
                    kept = body[j + 1]
                    assert isinstance(kept, Compact) and kept.append.size <= KEPT_USER
                    return
                context += op.append.size + (op.keep or 0)
    raise AssertionError("no codex agent of 300 compacted")


def steps_per_turn(agent) -> float:
    cs = calls(agent)
    return len(cs) / sum(c.tag == "user" for c in cs)


def test_codex_takes_more_smaller_steps_than_cc():
    # Per user turn: a cc session may run for many more turns than a codex one (its turns
    # are heavy-tailed), each of fewer steps.
    assert np.mean([steps_per_turn(Codex(1).agent(i)) for i in range(30)]) > 2 * np.mean(
        [steps_per_turn(CC(1).agent(i)) for i in range(30)])
    assert np.mean([Codex(1).agent(i).root.system.size for i in range(30)]) < np.mean(
        [CC(1).agent(i).root.system.size for i in range(30)])
