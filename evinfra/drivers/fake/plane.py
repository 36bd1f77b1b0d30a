"""What a fake engine sees of its cluster: the data plane between engines (paper 4.1, 4.2).

:class:`~evinfra.drivers.fake.cluster.FakeCluster` is the one implementation; the engine
knows it only through this protocol, so the engine does not import the cluster that builds
it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from evinfra.core.types import BlockHash, NodeId, RequestId
from evinfra.drivers.fake.outputs import OutputPlanner
from evinfra.drivers.fake.pages import OutputPages

__all__ = ["DataPlane"]


class DataPlane(Protocol):
    pages: OutputPages
    """The hashes of output pages, shared so every node names them alike."""
    outputs: OutputPlanner
    """Each request's output tokens and log-probabilities, the same on any node."""

    def peer_l2_prefix(self, peer: NodeId, path: Sequence[BlockHash], end: int) -> int:
        """Leading blocks of ``path[:end]`` that ``peer`` holds in host memory now."""

    def target(self, request: RequestId) -> NodeId | None:
        """The node that decodes ``request``, once bound."""

    def bind(self, request: RequestId, source: NodeId, target: NodeId) -> str | None:
        """``target`` will decode ``request`` from ``source``'s KV: the source's status for
        it (``"done"``, ``"running"``), None when it cannot serve it."""

    def prefill_done(self, request: RequestId, source: NodeId) -> None: ...

    def decode_reserved(self, request: RequestId, source: NodeId) -> None: ...

    def transfer_done(self, request: RequestId, source: NodeId) -> None: ...

    def drop(self, request: RequestId, origin: NodeId) -> None: ...

    def forget(self, request: RequestId) -> None: ...

    def node_down(self, node: NodeId) -> None: ...
