"""The book the drivers of one cluster share to pair a prefill with its decode.

SGLang PD pairs the two halves of a request by ``bootstrap_room``; the control plane pairs
them by request id and the prefill node (``DecodeOrder.source``). The prefill driver opens a
room when it submits; the decode driver bound to the same request finds the room and the
prefill engine's bootstrap address here. The book also tells the decode driver when the prefill
half is over, so a request's ``PrefillDone`` (with the cached-token count the client's
``usage`` reports) is published before its last ``TokensOut`` closes it. With the engine patch
it also holds each engine's pool address, which a fetch plan names for a peer node.

A leg ends its own room only (``room``): a prefill that failed before its engine accepted it
is routed again from inside its failure's event, maybe to the same node, so a new room for
the same (request, node) is open before the failed leg has ended.
"""

from __future__ import annotations

import asyncio

from evinfra.core.types import NodeId, RequestId
from evinfra.drivers.sglang.requests import Bootstrap, new_room

__all__ = ["PairBook"]


class _Pair:
    __slots__ = ("bootstrap", "prefill_over", "opened")

    def __init__(self, bootstrap: Bootstrap, opened: float) -> None:
        self.bootstrap = bootstrap
        self.prefill_over = asyncio.Event()
        self.opened = opened


class PairBook:
    """Rooms by (request, prefill node); bootstrap addresses by node."""

    STALE_S = 3600.0

    def __init__(self) -> None:
        self._bootstrap: dict[NodeId, tuple[str, int]] = {}
        self._pools: dict[NodeId, str] = {}
        self._pairs: dict[tuple[RequestId, NodeId], _Pair] = {}

    def register_engine(self, node: NodeId, host: str, port: int, pool: str | None = None
                        ) -> None:
        self._bootstrap[node] = (host, port)
        if pool is not None:
            self._pools[node] = pool
        else:
            self._pools.pop(node, None)

    def pool(self, node: NodeId) -> str | None:
        """The pool server of ``node``'s engine (engine patch), if it has one."""
        return self._pools.get(node)

    def open(self, request: RequestId, prefill: NodeId, now: float) -> Bootstrap:
        """A new room for ``request`` prefilled on ``prefill`` (a re-dispatch gets a new one)."""
        if len(self._pairs) > 1024:  # pairs whose decode never came (refused binding, crash)
            for key in [k for k, p in self._pairs.items() if now - p.opened > self.STALE_S]:
                del self._pairs[key]
        host, port = self._bootstrap[prefill]
        pair = _Pair(Bootstrap(host, port, new_room()), now)
        self._pairs[(request, prefill)] = pair
        return pair.bootstrap

    def find(self, request: RequestId, prefill: NodeId) -> Bootstrap | None:
        pair = self._pairs.get((request, prefill))
        return pair.bootstrap if pair is not None else None

    def _pair(self, request: RequestId, prefill: NodeId, room: int) -> _Pair | None:
        pair = self._pairs.get((request, prefill))
        return pair if pair is not None and pair.bootstrap.room == room else None

    def prefill_over(self, request: RequestId, prefill: NodeId, room: int) -> None:
        """The prefill half in ``room`` ended (done, failed or aborted)."""
        pair = self._pair(request, prefill, room)
        if pair is not None:
            pair.prefill_over.set()

    async def wait_prefill(self, request: RequestId, prefill: NodeId, room: int,
                           timeout: float) -> bool:
        pair = self._pair(request, prefill, room)
        if pair is None:
            return True
        try:
            await asyncio.wait_for(pair.prefill_over.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self, request: RequestId, prefill: NodeId, room: int) -> None:
        if self._pair(request, prefill, room) is not None:
            del self._pairs[(request, prefill)]

    def __len__(self) -> int:
        return len(self._pairs)
