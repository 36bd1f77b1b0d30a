"""Fake symmetric engines: a deterministic simulated engine per node (paper 4.1, 4.2, 5.1).

Used by ``evinfra serve`` (wall clock) and by the simulator (virtual clock) in place of SGLang
engines; the control plane cannot tell them apart (same events, same KV event bytes).

Public API::

    FakeEngineConfig(**fields)                      msgspec config, paper defaults
    FakeCluster(nodes: Iterable[tuple[NodeId, Phase]], config: FakeEngineConfig,
                clock: Clock, bus: Bus, seed: int = 0)
        .engines: dict[NodeId, FakeEngine]          one engine per node, in the given order
        .driver(node) -> FakeDriver                 .drivers() -> dict[NodeId, FakeDriver]
        .start() -> None                            first NodeState + heartbeats (sync)
    FakeDriver(engine: FakeEngine)                  implements drivers.base.EngineDriver
        .node  async .start() / .stop()             stop = the node goes down (requests fail)
        .submit_prefill(order) .submit_decode(order) .withdraw(request) .abort(request)
        .switch_phase(phase) .push_hints(delta) .healthy()
    FakeEngine                                      (fault injection and inspection, tests)
        .crash(reason="crashed")   .restart()   .stall()   .resume()
        .kv.drop_next(n=1)   .kv.duplicate_next(n=1)   .kv.reorder_next(n=1)
        .cache: NodeCache (.check_invariants(), .l1_used, .l2_used, .kv_room)
        .phase  .down  .stalled
        .prefill_log: list[PrefillIteration] | None prefill iterations in the prefill phase,
                                                    after FakeCluster.record_prefill()
    prefill_idle(logs, start, end) -> PrefillIdle   D.6's idle GPU time of prefill nodes

Everything an engine says goes on the bus: ``NodeKVEvents``, ``IterationReport``,
``NodeState``, ``PrefillStarted``, ``PrefillDone``, ``TokensOut``, ``RequestFailed``,
``Withdrawn``, ``PhaseSwitched``, ``NodeDown``, ``NodeUp`` (``core/events.py``). The
engines heartbeat forever: run a ``VirtualClock`` with ``until``.
"""

from evinfra.drivers.fake.cluster import FakeCluster
from evinfra.drivers.fake.config import FakeEngineConfig
from evinfra.drivers.fake.driver import FakeDriver
from evinfra.drivers.fake.engine import FakeEngine
from evinfra.drivers.fake.idle import PrefillIdle, prefill_idle
from evinfra.drivers.fake.records import PrefillIteration

__all__ = ["FakeCluster", "FakeDriver", "FakeEngine", "FakeEngineConfig", "PrefillIdle",
           "PrefillIteration", "prefill_idle"]
