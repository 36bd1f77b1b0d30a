"""The fake engines of one cluster and the data plane between them (paper 4.1, 4.2).

Engines never call each other. Reading a peer's memory is a plain read (an RDMA read does not
involve the peer's scheduler, so it works while the peer is stalled); every message that
changes another engine's state is posted on the clock at the current time, so one engine's
step never runs inside another's. The cluster also remembers which node prefills and which
decodes each request (``bind``), so a prefill that finishes finds its decode node and an
abort on one side reaches the other.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from evinfra.core.bus import Bus
from evinfra.core.clock import Clock
from evinfra.core.types import BlockHash, NodeId, Phase, RequestId
from evinfra.drivers.fake.config import FakeEngineConfig
from evinfra.drivers.fake.driver import FakeDriver
from evinfra.drivers.fake.engine import FakeEngine
from evinfra.drivers.fake.outputs import OutputPlanner
from evinfra.drivers.fake.pages import OutputPages

__all__ = ["FakeCluster"]


class FakeCluster:
    """All fake engines of a cluster, deterministic for ``seed``."""

    def __init__(self, nodes: Iterable[tuple[NodeId, Phase]], config: FakeEngineConfig,
                 clock: Clock, bus: Bus, seed: int = 0) -> None:
        self.config = config
        self.clock = clock
        self.pages = OutputPages(config.page_size)
        self.outputs = OutputPlanner(seed, config.output_vocab)
        self.engines: dict[NodeId, FakeEngine] = {
            node: FakeEngine(node, phase, config, clock, bus, self, seed) for node, phase in nodes}
        self._pairs: dict[RequestId, tuple[NodeId, NodeId]] = {}  # request -> (source, target)

    def driver(self, node: NodeId) -> FakeDriver:
        return FakeDriver(self.engines[node])

    def drivers(self) -> dict[NodeId, FakeDriver]:
        return {node: FakeDriver(engine) for node, engine in self.engines.items()}

    def record_prefill(self) -> None:
        """Every engine logs its prefill iterations from now on (``FakeEngine.prefill_log``,
        for :func:`~evinfra.drivers.fake.idle.prefill_idle`): runs of bounded length only."""
        for engine in self.engines.values():
            engine.prefill_log = []

    def start(self) -> None:
        """Start every engine's heartbeat (what ``FakeDriver.start`` does, synchronously)."""
        for engine in self.engines.values():
            engine.start()

    # -- reads --------------------------------------------------------------------------------

    def peer_l2_prefix(self, peer: NodeId, path: Sequence[BlockHash], end: int) -> int:
        """Leading blocks of ``path[:end]`` that ``peer`` holds in host memory now."""
        engine = self.engines.get(peer)
        if engine is None or engine.down:
            return 0
        return engine.cache.l2_prefix(path[:end])

    def target(self, request: RequestId) -> NodeId | None:
        pair = self._pairs.get(request)
        return pair[1] if pair else None

    # -- P -> D pairing -----------------------------------------------------------------------

    def bind(self, request: RequestId, source: NodeId, target: NodeId) -> str | None:
        """``target`` will decode ``request`` from ``source``'s KV. Returns the source's
        status for it (``"done"``, ``"running"``) or None when the source cannot serve it."""
        engine = self.engines.get(source)
        status = engine.kv_status(request) if engine is not None else None
        if status is not None:
            self._pairs[request] = (source, target)
        return status

    def prefill_done(self, request: RequestId, source: NodeId) -> None:
        target = self.target(request)
        if target is not None:
            self._post(target, "source_ready", request)

    def decode_reserved(self, request: RequestId, source: NodeId) -> None:
        """The decode node preallocated the request's KV: its source may start the prefill
        (``decode_prealloc``, SGLang PD's handshake, paper D.1)."""
        self._post(source, "decode_reserved", request)

    def transfer_done(self, request: RequestId, source: NodeId) -> None:
        """The KV landed on the decode node: the source may let go of it."""
        self._post(source, "release_source", request)

    def drop(self, request: RequestId, origin: NodeId) -> None:
        """``request`` was dropped on ``origin``: drop it on the other end of its pair."""
        pair = self._pairs.pop(request, None)
        for node in pair or ():
            if node != origin:
                self._post(node, "drop", request)

    def forget(self, request: RequestId) -> None:
        self._pairs.pop(request, None)

    def node_down(self, node: NodeId) -> None:
        """Peers drop their side of the dead node's requests: it reported them failed. (A
        pair whose both ends died stays here; a crash is rare and an entry is small.)"""
        for other in self.engines:
            if other != node:
                self._post(other, "peer_down", node)

    def _post(self, node: NodeId, method: str, *args: object) -> None:
        engine = self.engines.get(node)
        if engine is not None:
            self.clock.call_at(self.clock.now(), getattr(engine, method), *args)
