"""The simulator: the real control plane, fake engines and agents on one virtual clock.

Nothing here decides anything the service does not decide in ``serve``: the same
:class:`~evinfra.control.Service` (bus, router, planner, directory) runs with the fake
engines in their ``batched`` streaming mode (they compute their next state change instead of
waking every decode iteration) on a :class:`~evinfra.core.clock.VirtualClock`, and the agents
of :mod:`evinfra.workloads` send it requests through :class:`SimBackend`. What a simulation
adds is only the clock, the workload injection and the measurements (``control.py``, and
:mod:`evinfra.workloads.summary`).

Two things differ from ``serve`` on purpose: request timeouts are off (a simulation measures
an overloaded split's latency instead of failing it), and the engines do not stream every
token (only the first and the rest at the finish: the metrics need no more).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import msgspec
import numpy as np

from evinfra.config import Config
from evinfra.core.bus import Bus
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import Sampling
from evinfra.core.events import RequestDone
from evinfra.errors import EvinfraError
from evinfra.control import Service, Submission
from evinfra.sim.control import ControlRecorder
from evinfra.workloads import (AgentRequest, Arrival, Outcome, Phase, RequestRecord, Runner,
                               RunnerStats, Workload)

__all__ = ["RunSpec", "SimBackend", "SimResult", "simulate"]


class _Sink:
    """One request's output, handed to the runner as an :class:`Outcome` at its end."""

    __slots__ = ("parts", "done_cb")

    def __init__(self, done_cb: Callable[[Outcome], None]) -> None:
        self.parts: list = []
        self.done_cb = done_cb

    def tokens(self, tokens, logprobs) -> None:
        self.parts.append(tokens)

    def prompt_logprobs(self, logprobs) -> None:
        pass  # simulated agents do not ask

    def done(self, record: RequestDone, error: EvinfraError | None) -> None:
        if error is not None:
            self.done_cb(Outcome(error=f"{type(error).__name__}: {error.message}"))
            return
        ids = (np.concatenate([np.asarray(p, dtype=np.uint32) for p in self.parts])
               if self.parts else np.empty(0, np.uint32))
        ttft = record.first_token - record.arrival if record.first_token is not None else None
        self.done_cb(Outcome(ids, ttft=ttft, cached_tokens=record.cached_tokens))


class SimBackend:
    """The :class:`~evinfra.workloads.Backend` of a simulation: requests go straight to the
    service, with a forced output length (``ignore_eos``), as the paper's replayer forces
    recorded lengths. Without ``hints`` they carry no branch hints, as from a harness that
    sends none: the service infers their branches (``server.infer_branches``)."""

    def __init__(self, service: Service, clock: VirtualClock, hints: bool = True) -> None:
        self.service = service
        self.clock = clock
        self.hints = hints

    def send(self, request: AgentRequest, done: Callable[[Outcome], None]) -> None:
        sampling = Sampling(request.max_tokens, ignore_eos=True)
        sub = (Submission(request.tokens, sampling, request.branch_id, request.parent_branch_id,
                          request.final, request.request_id) if self.hints
               else Submission(request.tokens, sampling, request=request.request_id))
        try:
            self.service.submit(sub, _Sink(done))
        except EvinfraError as exc:
            # Refused before anything was accepted: answer on the clock, never inside send.
            self.clock.call_later(0.0, done, Outcome(error=f"{type(exc).__name__}: {exc.message}"))


class RunSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to play: a closed-loop ``schedule`` or open-loop ``arrivals`` of ``workloads``,
    scored over ``[warmup, warmup + duration]`` of simulated time."""

    duration: float
    warmup: float
    schedule: list[Phase] | None = None
    arrivals: list[Arrival] | None = None
    max_active: int | None = None
    label: str = ""
    hints: bool = True
    """The agents send their branch hints (False: none; the service infers the branches)."""


class SimResult(msgspec.Struct):
    records: list[RequestRecord]
    control: ControlRecorder
    service: Service
    wall_seconds: float
    events: int
    """Clock callbacks run (the simulator's unit of work)."""
    stats: RunnerStats = msgspec.field(default_factory=RunnerStats)
    """The runner's counts: agents arrived, admitted, finished; requests sent, answered."""


def simulate(config: Config, workloads: dict[str, Workload], spec: RunSpec,
             progress: Callable[[float, float, int], None] | None = None,
             on_start: Callable[[Service], None] | None = None) -> SimResult:
    """Run one simulation to ``warmup + duration`` and return what it recorded.
    ``on_start`` sees the service before it starts (to subscribe extra recorders)."""
    # The workloads report every branch end; their engines do not stall.
    server = msgspec.structs.replace(config.server, first_token_timeout_s=None,
                                     token_timeout_s=None, branch_idle_s=None)
    config = msgspec.structs.replace(config, server=server)
    clock = VirtualClock()
    bus = Bus()
    service = Service.from_config(config, clock, bus, stream="batched")
    control = ControlRecorder(service, bus)
    if on_start is not None:
        on_start(service)
    asyncio.run(service.start())  # the fake drivers only schedule on the clock
    end = spec.warmup + spec.duration
    runner = Runner(SimBackend(service, clock, spec.hints), workloads,
                    page_size=config.cluster.page_size, stop_at=end)
    if spec.schedule is not None:
        runner.closed_loop(spec.schedule)
    elif spec.arrivals is not None:
        runner.open_loop(spec.arrivals, spec.max_active)
    else:
        raise ValueError("a run needs a schedule (closed loop) or arrivals (open loop)")
    t0 = time.perf_counter()
    step = max(end / 200, 1.0)
    now = 0.0
    while now < end:
        now = min(now + step, end)
        clock.run(until=now)
        if progress is not None:
            progress(now, end, runner.stats.answered)
    wall = time.perf_counter() - t0
    return SimResult(runner.records, control, service, wall, clock.steps, runner.stats)

