"""The fake engine's bookkeeping for one request on one node, prefill side and decode side.

Plain mutable records with ``__slots__``; the engine owns every transition. A request that is
prefilled and decoded on the same node (collocated, or a decode order naming the node itself)
has one record of each kind.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

from evinfra.core.clock import Timer
from evinfra.core.contracts import DecodeOrder, PrefillOrder
from evinfra.core.hashing import as_tokens

__all__ = ["DecodeRecord", "DecodeState", "PrefillIteration", "PrefillRecord", "Run"]


class PrefillIteration(NamedTuple):
    """One prefill iteration of a prefill node, for the idle time of paper D.6: the GPU
    waited ``waited`` seconds before ``start`` while the node had prefill requests to serve
    (none ready: fetching, awaiting their decode reservation, or short of room), then
    ``load`` seconds of its ``duration`` loading fetched KV before the forward
    (``peer_fetch = "prefill_start"``)."""

    start: float
    duration: float
    waited: float
    load: float


class PrefillRecord:
    """A prefill order: queued (``started`` False), prefilling, then done and holding its KV
    for the decode side (the engine's ``_handoff``) until the transfer lands.

    ``locked`` blocks of the path are pinned; ``reserved`` GPU tokens are held outside the
    tree (the uncomputed input, then the input's partial last page)."""

    __slots__ = ("order", "request", "tokens", "path", "n_in", "fetch", "fetching", "awaiting",
                 "started", "aborted", "locked", "reserved", "cached", "fetched", "restored",
                 "done", "load_s", "fetch_s", "ahead", "timer")

    def __init__(self, order: PrefillOrder, page: int, fetch: bool, awaiting: bool) -> None:
        self.order = order
        self.request = order.request
        self.tokens: np.ndarray = as_tokens(order.tokens)
        self.n_in = int(self.tokens.size)
        self.path = order.path[: self.n_in // page]
        self.fetch = fetch  # the peer fetch of the order is still to be done
        self.fetching = False  # ... and is under way while the request waits
        self.awaiting = awaiting  # its decode node has not reserved its KV yet (D.1)
        self.started = False
        self.aborted = False
        self.locked = 0
        self.reserved = 0
        self.cached = 0  # tokens of KV reused (own prefix plus fetched)
        self.fetched = 0  # blocks that arrived from peers
        self.restored = 0  # blocks loaded into L1 for it: fetched plus own host copies (t_rst)
        self.done = 0  # input tokens whose KV exists
        self.load_s: float | None = None  # a fetch at prefill start: its transfer seconds
        self.fetch_s = 0.0  # seconds the peer fetch took, reported in PrefillDone
        self.ahead = 0  # tokens its started fetch counts against the engine's fetch_ahead
        self.timer: Timer | None = None

    @property
    def ready(self) -> bool:
        """May be packed: no fetch under way, no decode reservation awaited."""
        return not self.fetching and not self.awaiting


class DecodeState(enum.Enum):
    PREALLOC = "prealloc"  # waits for GPU room to reserve before the prefill (D.1)
    WAIT_KV = "wait_kv"  # the source is still prefilling
    WAIT_ROOM = "wait_room"  # the KV is ready at the source; no GPU room here yet
    TRANSFER = "transfer"
    READY = "ready"  # joins the batch at the next iteration boundary
    RUNNING = "running"


class DecodeRecord:
    """A decode order: its output is fixed on arrival (``out``, ``finish``), and so is
    ``need``, the decode iterations that produce it; ``iters`` iterations run so far, ``made``
    tokens produced by them (the first token included), ``emitted`` tokens streamed."""

    __slots__ = ("order", "request", "source", "tokens", "path", "n_in", "out", "finish",
                 "state", "locked", "reserved", "need", "iters", "made", "emitted", "timer")

    def __init__(self, order: DecodeOrder, page: int, out: list[int], finish: str,
                 need: int) -> None:
        self.order = order
        self.request = order.request
        self.source = order.source
        self.tokens: np.ndarray = as_tokens(order.tokens)
        self.n_in = int(self.tokens.size)
        self.path = order.path[: self.n_in // page]
        self.out = out
        self.finish = finish
        self.state = DecodeState.WAIT_KV
        self.locked = 0
        self.reserved = 0
        self.need = need
        self.iters = 0
        self.made = min(len(out), 1)
        self.emitted = 0
        self.timer: Timer | None = None


class Run:
    """Consecutive decode iterations with one batch and one duration ``d``: iteration ``i``
    ends at ``start + i * d`` in both streaming modes, so they compute the same floats."""

    __slots__ = ("start", "d", "batch", "B", "done", "planned")

    def __init__(self, start: float, d: float, batch: list[DecodeRecord]) -> None:
        self.start = start
        self.d = d
        self.batch = batch
        self.B = len(batch)  # noqa: N815 - Eq. 2's B, fixed for the run even if one aborts
        self.done = 0  # iterations accounted for
        self.planned = 0  # iterations until the scheduled wake-up
