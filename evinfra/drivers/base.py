"""The EngineDriver protocol: the only door between the control plane and an engine.

Commands go in as plain method calls that return at once (``submit_prefill``,
``submit_decode``, ``withdraw``, ``abort``, ``switch_phase``, ``push_hints``); everything an
engine has to say comes back as events on the bus (``core/events.py``): KV events, iteration
reports, node state at each iteration launch, prefill started / done, output tokens,
failures, withdrawals, phase switches, node loss. A driver for a remote engine does its I/O
in its own tasks; the fake driver runs a simulated engine on the clock. Nothing else in the
control plane knows what an engine is.

**Events and commands.** A driver may publish an engine's answer from inside a command (a
refusal, ``Withdrawn``, a fake engine's first iteration) or later from its own tasks; either
way the control plane sees it after the command returns: the bus runs every handler and
every command of the service to completion and delivers what it caused afterwards, in order
(``core/bus.py``). A driver publishes on the bus only; it never calls the control plane.

The data plane (KV moving between engines: peer fetches, prefill-to-decode transfers) is the
engines' business: orders name the peer, and the engines move the bytes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from evinfra.core.contracts import DecodeOrder, HintDelta, PrefillOrder
from evinfra.core.types import NodeId, Phase, RequestId

__all__ = ["EngineDriver"]


@runtime_checkable
class EngineDriver(Protocol):
    """One node's engine, as the control plane sees it."""

    node: NodeId
    stats: dict[str, int]
    """Counters of what the driver did with its engine (status and ``/metrics``)."""

    @property
    def constrains_output(self) -> bool:
        """The engine holds an output to a grammar (``Sampling.json_schema``, ``regex``,
        ``ebnf``)."""

    async def start(self) -> None:
        """Connect (or launch) and begin publishing the engine's events on the bus."""

    async def stop(self) -> None:
        """Stop publishing and release connections; in-flight requests fail."""

    def submit_prefill(self, order: PrefillOrder) -> None: ...

    def submit_decode(self, order: DecodeOrder) -> None: ...

    def withdraw(self, request: RequestId) -> None:
        """Take back a queued request. The engine answers ``Withdrawn`` if it had not started
        the prefill yet; otherwise the request runs on (``PrefillStarted`` tells)."""

    def abort(self, request: RequestId) -> None:
        """Stop a request wherever it is (the client went away); no event follows."""

    def switch_phase(self, phase: Phase) -> None:
        """Serve ``phase`` from now on; ``PhaseSwitched`` follows. Called once the router has
        drained the node's old-phase work."""

    def push_hints(self, delta: HintDelta) -> None:
        """Blocks whose branch count crossed zero (count-aware host eviction)."""

    def healthy(self) -> bool: ...
