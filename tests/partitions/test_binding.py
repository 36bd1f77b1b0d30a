"""Binding users to partitions (``evinfra/partitions/binding.py``)."""

from __future__ import annotations

import pytest

from evinfra.errors import ConfigError
from evinfra.partitions.binding import (Group, bind_arrivals, bind_groups, bind_schedule,
                                        partition_of)
from evinfra.workloads import Arrival, Phase


def test_hash_binding_spreads_every_user_once_and_keeps_them_across_phases():
    schedule = [Phase(100.0, {"cc": 400, "codex": 0}), Phase(100.0, {"cc": 200, "codex": 200})]
    per = bind_schedule(schedule, 8)
    for j, phase in enumerate(schedule):
        for w, n in phase.agents.items():
            assert sum(p[j].agents[w] for p in per) == n
    counts = [p[0].agents["cc"] for p in per]
    assert min(counts) > 30 and max(counts) < 70  # 400 users over 8: about 50 each
    # Phase 2 keeps cc users 0-199, each where it was: no partition gains cc users.
    assert all(p[1].agents["cc"] <= p[0].agents["cc"] for p in per)
    assert [partition_of(f"cc-{u}", 8) for u in range(5)] == [
        partition_of(f"cc-{u}", 8) for u in range(5)]  # stable
    assert len({partition_of(f"cc-{u}", 8) for u in range(50)}) == 8


def test_open_loop_arrivals_are_bound_by_their_rank():
    arrivals = [Arrival(float(t), "cc") for t in range(100)]
    per = bind_arrivals(arrivals, 4)
    assert sorted(a.time for p in per for a in p) == [a.time for a in arrivals]
    assert [len(p) for p in per] == [sum(partition_of(f"cc-{u}", 4) == i for u in range(100))
                                     for i in range(4)]


def test_groups_give_their_partitions_their_own_schedule():
    steady = Group(name="steady", partitions=3, schedule=[Phase(60.0, {"cc": 10})])
    shift = Group(name="shift", partitions=1,
                  schedule=[Phase(30.0, {"cc": 10}), Phase(30.0, {"codex": 10})])
    bound = bind_groups([steady, shift], 4)
    assert [g for g, _ in bound] == ["steady"] * 3 + ["shift"]
    assert bound[3][1] == shift.schedule
    with pytest.raises(ConfigError, match="hold 4 partitions, not the 5"):
        bind_groups([steady, shift], 5)
