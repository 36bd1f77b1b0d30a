"""The contract between the control plane (the SGLang driver) and a patched engine (pure).

Six things cross it, each validated at the edge that receives it:

* **Count hints** (``POST /evinfra/hints``, the path the engine advertises in ``/server_info``
  as ``evinfra_count_hints``): ``{"positive": [...], "zero": [...]}``, the block hashes whose
  branch count on this node crossed zero (:class:`~evinfra.core.contracts.HintDelta`, same
  field names). A block never named positive counts as zero. With ``"replace": true`` the
  positive list is every positive block: the engine drops its other marks (a resync).
* **KV resyncs** (``POST /evinfra/kv_resync``, advertised as ``PatchInfo.kv_resync``, no
  body): the engine republishes its whole cache on its own KV event stream, in order with its
  other events: ``AllBlocksCleared``, then a ``BlockStored`` for every page it holds, in each
  medium (``GPU``; ``CPU_PINNED`` for completed host copies), parents first. The driver asks
  for one when its view of the node's stream broke (a gap the replay buffer no longer covers,
  say of a control plane started beside an engine that has long been running).
* **Iterations** (``GET /evinfra/iterations?after=N``, advertised as
  ``PatchInfo.iterations``): the engine's last forward passes, each timed and described as
  the planner fits them (:class:`IterationRecord`; numbered from 0, the ones after ``N``),
  with the number of the last one (:class:`IterationLog`). SGLang reports per-iteration
  times only through CUDA events; its cumulative counters cannot tell overlapping prefills
  apart.
* **Fetch plans**, inside SGLang's own per-request ``kv_hints`` envelope of ``/generate``
  (SGLang 0.5.23 carries it to the scheduler untouched; consumers ignore actions they do not
  know): one action ``{"action_type": "evinfra.fetch", "action_version": "1", "payload":
  {"page_size": P, "runs": [{"peer": "host:port", "start": i, "blocks": [...]}]}}``. ``peer``
  is the pool address the peer engine advertises (the driver translates node names), ``start``
  the index of the run's first block in the request's path, ``blocks`` the block hashes.
* **What the engine says about itself**: ``/server_info`` gains ``evinfra_engine_patch``
  (:class:`PatchInfo`) and ``evinfra_count_hints``. Their absence means stock SGLang.
* **What a prefill reused**: ``meta_info.cached_tokens_details`` gains ``evinfra_fetched``
  (tokens pulled from peers' host memory for the request) and ``evinfra_restored`` (tokens
  loaded from host to device memory for it while it was queued).

The engine-to-engine lease protocol of the shared pool (:class:`LeaseRequest` ...) is here too:
msgpack over ZMQ between two patched engines.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Mapping

import msgspec

__all__ = [
    "COUNT_HINTS_PATH", "DRAIN_TIMEOUT_S", "FETCH_ACTION", "FETCH_VERSION", "ITERATIONS_PATH",
    "KV_RESYNC_PATH", "STATUS_PATH", "CountHints", "FetchPlan", "FetchRunWire", "HostLayout",
    "IterationLog", "IterationRecord", "LeaseReply", "LeaseRequest", "PatchInfo", "Release",
    "Shard",
    "WireError", "decode_count_hints", "decode_iterations", "fetch_kv_hints", "find_fetch_plan",
    "fetch_seconds", "restored_tokens",
]

COUNT_HINTS_PATH = "/evinfra/hints"
STATUS_PATH = "/evinfra/status"
KV_RESYNC_PATH = "/evinfra/kv_resync"
ITERATIONS_PATH = "/evinfra/iterations"
FETCH_ACTION = "evinfra.fetch"
FETCH_VERSION = "1"
DRAIN_TIMEOUT_S = 300.0
"""Default drain limit of an in-place switch (``EVINFRA_DRAIN_TIMEOUT_S``); an engine
advertises its own in :attr:`PatchInfo.drain_timeout_s`."""

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Pos = Annotated[int, msgspec.Meta(gt=0)]


class WireError(ValueError):
    """A message that does not follow the contract (the receiver answers 400 or drops it)."""


# -- count hints -------------------------------------------------------------------------


class CountHints(msgspec.Struct, frozen=True):
    """Blocks whose count on this node became positive / zero since the previous hints; with
    ``replace``, every block whose count is positive (and ``zero`` empty)."""

    positive: list[Int64] = []
    zero: list[Int64] = []
    replace: bool = False


_hints = msgspec.json.Decoder(CountHints)


def decode_count_hints(body: bytes) -> CountHints:
    return _decoded(_hints, body, "count hints")


def _decoded(decoder: msgspec.json.Decoder, body: bytes, what: str):
    try:
        return decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"{what}: {exc}") from exc


# -- iterations --------------------------------------------------------------------------


class IterationRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """One forward pass: ``start`` (engine wall clock, s) and ``duration`` (launch, or the
    previous pass's result if later, to its result processed, s). A prefill (extend) pass
    lists ``[rid, t_uc, t_c, t_rst]`` per request in ``prefill`` (tokens computed, context
    before them, tokens loaded from host memory for it during the pass); a decode pass has
    ``batch`` requests fed ``t_fwd`` tokens each and ``accepted`` output tokens in all."""

    seq: NonNeg
    start: float
    duration: float
    prefill: list[tuple[str, NonNeg, NonNeg, NonNeg]] = []
    batch: NonNeg = 0
    t_fwd: Pos = 1
    accepted: NonNeg = 0


class IterationLog(msgspec.Struct, frozen=True):
    """``records`` after the asked number, oldest first; ``last``: the number of the
    engine's latest pass (-1: none yet). A ``last`` below the asked number is a new engine
    process, which numbers its passes from 0 again."""

    last: int
    records: list[IterationRecord] = []


_iterations = msgspec.json.Decoder(IterationLog)


def decode_iterations(body: bytes) -> IterationLog:
    return _decoded(_iterations, body, "iterations")


# -- fetch plans -------------------------------------------------------------------------


class FetchRunWire(msgspec.Struct, frozen=True):
    """Consecutive blocks of the request's path to pull from the pool server at ``peer``."""

    peer: str
    start: NonNeg
    blocks: list[Int64]

    def __post_init__(self) -> None:
        host, sep, port = self.peer.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"peer must be 'host:port', got {self.peer!r}")
        if not self.blocks:
            raise ValueError("a fetch run names at least one block")


class FetchPlan(msgspec.Struct, frozen=True):
    page_size: Pos
    runs: list[FetchRunWire]

    def __post_init__(self) -> None:
        pos = None
        for r in self.runs:
            if pos is not None and r.start != pos:
                raise ValueError(f"fetch runs must be consecutive: run at block {r.start} "
                                 f"follows one that ends at {pos}")
            pos = r.start + len(r.blocks)

    @property
    def first_block(self) -> int:
        return self.runs[0].start if self.runs else 0

    @property
    def end_block(self) -> int:
        return self.runs[-1].start + len(self.runs[-1].blocks) if self.runs else 0


def fetch_kv_hints(plan: FetchPlan, message_id: str) -> dict[str, Any]:
    """The ``kv_hints`` envelope of a ``/generate`` body carrying ``plan``."""
    return {"protocol_version": "1", "message_id": message_id, "actions": [{
        "action_id": f"{message_id}-fetch", "action_type": FETCH_ACTION,
        "action_version": FETCH_VERSION, "payload": msgspec.to_builtins(plan)}]}


def find_fetch_plan(envelope: Any) -> FetchPlan | None:
    """The fetch plan in a request's ``kv_hints`` (SGLang's ``KvHintsEnvelope`` or its JSON
    form), or None when it carries none. Raises :class:`WireError` for a malformed plan of our
    action; actions of other types and versions are ignored, as SGLang's contract says."""
    if envelope is None:
        return None
    actions = _get(envelope, "actions") or []
    for a in actions:
        if _get(a, "action_type") != FETCH_ACTION or _get(a, "action_version") != FETCH_VERSION:
            continue
        try:
            return msgspec.convert(_get(a, "payload"), FetchPlan)
        except (msgspec.ValidationError, TypeError) as exc:
            raise WireError(f"fetch plan: {exc}") from exc
    return None


def _get(obj: Any, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def restored_tokens(details: Mapping[str, Any] | None) -> tuple[int, int]:
    """``(fetched, restored)`` from a response's ``cached_tokens_details``: tokens pulled from
    peers, and tokens loaded from host into device memory (the patch's own count, plus
    SGLang's ``host`` hits loaded during the prefill)."""
    if not details:
        return 0, 0
    fetched = details.get("evinfra_fetched", 0)
    restored = details.get("evinfra_restored", 0)
    host = details.get("host", 0)
    as_int = [x if isinstance(x, int) and x > 0 else 0 for x in (fetched, restored, host)]
    return as_int[0], as_int[1] + as_int[2]


def fetch_seconds(details: Mapping[str, Any] | None) -> float:
    """Seconds the engine's read of a fetch from peers took (``evinfra_fetch_s``), 0 when it
    fetched nothing or reports no valid time: the observation ``PrefillDone.fetch_s`` carries
    to the router's fetch-time model (Eq. 7's tau)."""
    s = details.get("evinfra_fetch_s") if details else None
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < math.inf:
        return 0.0
    return float(s)


# -- what the engine advertises ----------------------------------------------------------


class PatchInfo(msgspec.Struct, frozen=True):
    """``/server_info``'s ``evinfra_engine_patch`` block."""

    version: str
    switch_in_place: bool
    """``/pd_role_switch`` drains by itself and keeps the cache (no ``AllBlocksCleared``)."""
    count_hints: str | None = None
    """Path of the count-hint call (also top-level ``evinfra_count_hints``)."""
    fetch_action: str | None = None
    """``"evinfra.fetch/1"`` when the engine honours fetch plans (prefill role)."""
    pool: str | None = None
    """``host:port`` of this engine's pool server (peers lease its host KV there)."""
    host_tier: bool = False
    """HiCache host tier on (write-through in both roles)."""
    kv_resync: str | None = None
    """Path of the call that makes the engine republish its whole cache as KV events."""
    iterations: str | None = None
    """Path of the engine's log of forward passes (:class:`IterationLog`)."""
    drain_timeout_s: float | None = None
    """The longest an in-place switch drains before it fails (the engine's
    ``EVINFRA_DRAIN_TIMEOUT_S``): a driver waits for a switch at least this long."""


# -- the pool's lease protocol (engine to engine) ------------------------------------------


class HostLayout(msgspec.Struct, frozen=True):
    """Where a host KV slot lives in an engine's (Mooncake-registered) host buffer.

    Byte address of token slot ``s`` of layer ``l`` in plane ``kv`` (0 = K, 1 = V)::

        base + kv * kv_stride + l * layer_stride + (s // page) * page_stride
             + (s % page) * slot_stride

    which covers SGLang's host layouts ``layer_first`` (page_stride = page * slot_stride),
    ``page_first`` and ``page_first_direct``. ``token_bytes`` is one layer's K (or V) of one
    token. ``planes`` is 2 for MHA (K and V) and 1 for MLA (one latent per token and layer,
    ``kv_stride`` unused). Two engines exchange KV only when their layout name, planes,
    ``token_bytes``, ``layers`` and ``page_size`` match (:meth:`geometry`).
    """

    name: str
    base: int
    kv_stride: int
    layer_stride: int
    page_stride: int
    slot_stride: int
    token_bytes: int
    layers: int
    page_size: int
    slots: int
    planes: int = 2

    def geometry(self) -> tuple:
        return (self.name, self.planes, self.token_bytes, self.layers, self.page_size)


class LeaseRequest(msgspec.Struct, tag="lease", frozen=True):
    """Pin the host copies of pages ``[start_page, end_page)`` of ``tokens`` for a read.

    ``tokens`` are the request's tokens up to ``end_page`` (the peer matches them in its own
    radix tree); ``hashes`` the block hashes of those pages, which the peer checks."""

    tokens: list[int]
    start_page: NonNeg
    end_page: NonNeg
    hashes: list[Int64] = []
    ttl_s: float = 30.0
    key: str = ""
    """Names the lease across the asking engine's TP ranks: each rank asks for the same
    pages with the same key and gets the same lease (one pin, its slots); ``""``: a lease of
    its own."""
    ranks: Pos = 1
    """The asking engine's TP size: how many ranks read (and release) the lease. It must
    equal the peer's: rank i reads the peer's shard i."""


class Release(msgspec.Struct, tag="release", frozen=True):
    lease: int


class Shard(msgspec.Struct, frozen=True):
    """One TP rank's part of an engine's host pool: its Mooncake session and the layout of
    its host buffer (with TP each rank holds its KV heads of every token; an MLA latent is
    whole on every rank). The same slot holds the same token on every rank: SGLang keeps the
    ranks' radix trees in step."""

    session: str
    layout: HostLayout


class LeaseReply(msgspec.Struct, tag="reply", frozen=True):
    """``pages`` leading pages of the asked range are pinned on host (maybe fewer than asked:
    the rest is not in the peer's host memory); ``slots`` are their host slots, one per
    token, the same on every rank; ``shards`` the peer's ranks, in rank order."""

    ok: bool
    reason: str = ""
    lease: int = -1
    shards: list[Shard] = []
    pages: int = 0
    slots: list[int] = []


PoolMessage = LeaseRequest | Release | LeaseReply
pool_encoder = msgspec.msgpack.Encoder()
pool_decoder = msgspec.msgpack.Decoder(PoolMessage)
