"""The shift schedule, schedules as data, and the package's exported names."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from workload_fakes import EchoBackend

import evinfra.workloads as workloads
from evinfra.errors import ConfigError
from evinfra.workloads import (
    OSWorld, Phase, Putnam, Runner, paper_shift, schedule_from_data,
)


def test_paper_shift():
    phases = paper_shift()
    assert [p.duration for p in phases] == [5400.0, 3600.0, 3600.0]
    assert [p.agents for p in phases] == [
        {"putnam": 288}, {"putnam": 144, "osworld": 72}, {"osworld": 144}]
    assert paper_shift(0)[0].duration == 3600.0


def test_schedule_from_data():
    phases = schedule_from_data([[600, {"putnam": 4}], [300.5, {"putnam": 1, "osworld": 2}]])
    assert phases == [Phase(600.0, {"putnam": 4}), Phase(300.5, {"putnam": 1, "osworld": 2})]
    for bad in ([], [[0, {"putnam": 1}]], [[10, {"putnam": -1}]], [{"duration": 1}]):
        with pytest.raises(ConfigError):
            schedule_from_data(bad, source="cluster.toml")


def test_shift_runs_both_generators():
    backend = EchoBackend(delay=1.0, keep=False)
    runner = Runner(backend, {"putnam": Putnam(0), "osworld": OSWorld(0)}, stop_at=400.0)
    runner.closed_loop(schedule_from_data([[200, {"putnam": 4}], [200, {"osworld": 3}]]))
    backend.clock.run(until=400.0)
    early = {r.workload for r in runner.records if r.send_time < 200}
    late_new = {r.workload for r in runner.records
                if r.send_time > 200 and r.request_id.endswith(":0#1")}
    assert early == {"putnam"} and late_new == {"osworld"}


def test_exported_names():
    assert sorted(workloads.__all__) == sorted(set(workloads.__all__))
    for name in workloads.__all__:
        assert hasattr(workloads, name), name
    for info in pkgutil.iter_modules(workloads.__path__):
        module = importlib.import_module(f"evinfra.workloads.{info.name}")
        for name in getattr(module, "__all__", ()):
            assert getattr(module, name) is not None
