"""``FakeDriver``: the :class:`~evinfra.drivers.base.EngineDriver` of one fake node.

The engine runs on the injected clock and publishes on the injected bus by itself, so the
driver only forwards commands; ``start`` and ``stop`` have no I/O to do.
"""

from __future__ import annotations

from evinfra.core.contracts import DecodeOrder, HintDelta, PrefillOrder
from evinfra.core.types import Phase, RequestId
from evinfra.drivers.fake.engine import FakeEngine

__all__ = ["FakeDriver"]


class FakeDriver:
    constrains_output = False
    """Its outputs are drawn ids: no grammar holds them."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.node = engine.node
        self.stats: dict[str, int] = {}  # the engine runs in this process: no I/O to count

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        """In-flight requests fail and the node reports itself down."""
        self.engine.crash("driver stopped")

    def submit_prefill(self, order: PrefillOrder) -> None:
        self.engine.submit_prefill(order)

    def submit_decode(self, order: DecodeOrder) -> None:
        self.engine.submit_decode(order)

    def withdraw(self, request: RequestId) -> None:
        self.engine.withdraw(request)

    def abort(self, request: RequestId) -> None:
        self.engine.abort(request)

    def switch_phase(self, phase: Phase) -> None:
        self.engine.switch_phase(phase)

    def push_hints(self, delta: HintDelta) -> None:
        self.engine.push_hints(delta)

    def healthy(self) -> bool:
        return self.engine.healthy()
