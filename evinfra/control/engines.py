"""The partition's engines as the control plane orders them: one driver per node
(``drivers/base.py``), and the count marks the directory owes them."""

from __future__ import annotations

from typing import Iterable, Mapping

from evinfra.core.types import NodeId, RequestId
from evinfra.directory import Directory
from evinfra.drivers.base import EngineDriver

__all__ = ["Engines"]


class Engines:
    def __init__(self, drivers: Mapping[NodeId, EngineDriver], directory: Directory) -> None:
        self.drivers = dict(drivers)
        self.directory = directory

    def __getitem__(self, node: NodeId) -> EngineDriver:
        return self.drivers[node]

    def flush_hints(self) -> None:
        """Push each node the blocks whose count crossed zero since the last push."""
        for node, delta in self.directory.take_all_hints():
            self.drivers[node].push_hints(delta)

    def resync_hints(self, node: NodeId) -> None:
        """Give ``node`` the directory's marks in full (an engine that may hold marks of an
        earlier control plane, or of counts released while it was away)."""
        self.drivers[node].push_hints(self.directory.full_hints(node))

    def abort(self, request: RequestId, nodes: Iterable[NodeId]) -> None:
        for node in nodes:
            self.drivers[node].abort(request)
