"""The driver contract's event rule, for both drivers: an engine's answer to a command of the
control plane is delivered after the command returns, never inside it (``core/bus.py``).

The fake engines answer at once on the simulator's clock; the SGLang driver answers some
commands at once (a refusal, ``Withdrawn``) and the rest from its I/O tasks. Either way the
service's code after a driver call must see the world as it was before the engine answered,
so the simulator measures the event order ``serve`` has. Each test drives the public
``Service`` and records, for every event on the bus, the driver command running when it
arrived (None: none).
The SGLang half uses the scripted HTTP stand-in of ``test_sglang_driver_shell.py``; it lives
here to share it.
"""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
from aiohttp import web

from evinfra.config import parse_config
from evinfra.core import events as events_module
from evinfra.core.bus import Bus
from evinfra.core.clock import VirtualClock
from evinfra.core.contracts import Sampling
from evinfra.core.events import PrefillStarted, RequestDone, TokensOut, Withdrawn
from evinfra.control import Service, Submission
from test_sglang_driver_shell import FakeEngine, service_over, until

EVENT_TYPES = [t for t in vars(events_module).values()
               if isinstance(t, type) and issubclass(t, msgspec.Struct)
               and t.__module__ == events_module.__name__ and not t.__name__.startswith("_")]


class Probe:
    """Every event, with the driver command that was running when it was delivered."""

    COMMANDS = ("submit_prefill", "submit_decode", "withdraw", "abort", "switch_phase",
                "push_hints")

    def __init__(self, bus: Bus, drivers) -> None:
        self.running: str | None = None
        self.seen: list[tuple[str | None, object]] = []
        self.calls: list[str] = []
        for t in EVENT_TYPES:
            bus.subscribe(t, lambda ev: self.seen.append((self.running, ev)))
        for driver in drivers.values():
            for name in self.COMMANDS:
                setattr(driver, name, self._wrap(name, getattr(driver, name)))

    def _wrap(self, name, command):
        def run(*args):
            self.calls.append(name)
            outer, self.running = self.running, name
            try:
                command(*args)
            finally:
                self.running = outer
        return run

    def early(self) -> list[tuple[str, str]]:
        return [(c, type(ev).__name__) for c, ev in self.seen if c is not None]

    def of(self, t: type) -> list:
        return [ev for _, ev in self.seen if isinstance(ev, t)]


class Sink:
    def __init__(self) -> None:
        self.record: RequestDone | None = None
        self.error = None

    def tokens(self, tokens, logprobs) -> None:
        pass

    def prompt_logprobs(self, logprobs) -> None:
        pass

    def done(self, record, error) -> None:
        self.record, self.error = record, error


def request(rid: str, n: int = 64, max_tokens: int = 4) -> Submission:
    return Submission(np.arange(1, n + 1, dtype=np.uint32), Sampling(max_tokens=max_tokens),
                      branch=f"b-{rid}", request=rid)


def test_fake_engines_answer_after_the_command():
    config = parse_config({"planner": {"t_learn": 1.0}})
    clock = VirtualClock()
    service = Service.from_config(config, clock, stream="batched")
    probe = Probe(service.bus, service.drivers)
    asyncio.run(service.start())
    clock.run(until=2.0)  # past the warm-up: 6P3D
    prefill = service.router.split()[0]
    sinks = {rid: Sink() for rid in ("r0", "r1", "r2")}
    service.submit(request("r0"), sinks["r0"])
    # The idle node took it at once: the engine answered inside submit_prefill, and the
    # service saw it once its command was over.
    assert [ev.request for ev in probe.of(PrefillStarted)] == ["r0"]
    node = probe.of(PrefillStarted)[0].node
    service.submit(request("r1", n=4096), sinks["r1"])
    service.submit(request("r2", n=4096), sinks["r2"])
    withdrawn = service.cordon(node)
    service.abort("r1")
    service.force_split(prefill[:-1])
    clock.run(until=60.0)
    assert probe.early() == []
    assert {rid: s.record.status for rid, s in sinks.items()} == {
        "r0": "ok", "r1": "aborted", "r2": "ok"}
    # Controls: the commands did make the engines answer (the rule had something to defer).
    assert {"submit_prefill", "submit_decode", "abort", "switch_phase"} <= set(probe.calls)
    assert probe.of(TokensOut) and (not withdrawn or probe.of(Withdrawn))


async def test_sglang_engines_answer_after_the_command():
    engines = {"p": FakeEngine("prefill"), "d": FakeEngine("decode")}
    hold = asyncio.Event()

    async def slow(request, body):  # the prefill engine has not accepted it yet
        await hold.wait()
        return web.Response()

    engines["p"].generate = slow
    async with service_over(engines) as service:
        probe = Probe(service.bus, service.drivers)
        try:
            await until(lambda: service.router.routable("p") and service.router.routable("d"))
            sink = Sink()
            service.submit(request("r0", n=16), sink)
            await asyncio.sleep(0.1)
            # Withdrawn at once, inside the driver's withdraw, delivered after it.
            assert service.cordon("p", force=True) == ["r0"]  # the only prefill node
            await until(lambda: sink.record is not None)
            assert probe.early() == []
            assert [ev.request for ev in probe.of(Withdrawn)] == ["r0"]  # control
            assert sink.record.status == "NoNodeError"  # the only prefill node is cordoned
        finally:
            hold.set()
