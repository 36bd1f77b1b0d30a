"""KV events in SGLang 0.5.23's wire schema, and their decoding at the edge.

An engine publishes ZMQ multipart messages ``[topic, seq, payload]``: ``seq`` is an 8-byte
big-endian signed sequence number, ``payload`` a msgpack array ``[ts, [events], dp_rank]``.
Each event is a msgpack map tagged by ``type`` (the class name); fields left at their default
are omitted (SGLang ``disaggregation/kv_events.py``: ``EventBatch``, ``KVCacheEvent``).

The fake engines publish these same structs (in memory, on the bus), so the directory applies
the same events from fake and real engines. Decoding validates; a batch with one bad event
keeps its good ones.
"""

from __future__ import annotations

from typing import Annotated, Sequence, Union

import msgspec
import numpy as np

from evinfra.errors import KVEventDecodeError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "END_SEQ",
    "IterationReport",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecoder",
    "NodeDown",
    "NodeKVEvents",
    "NodeKVViewLost",
    "NodeState",
    "NodeUp",
    "PhaseSwitched",
    "PrefillDone",
    "PrefillItem",
    "PrefillStarted",
    "RequestDone",
    "RequestFailed",
    "SplitChanged",
    "TokenLogprobs",
    "TokensOut",
    "Withdrawn",
    "encode_frames",
    "encode_payload",
]

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]

END_SEQ = -1
"""The sequence number that ends a replay answer."""


class _KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, frozen=True, gc=False):
    pass


class BlockStored(_KVCacheEvent):
    """Blocks stored on a node (in ``medium``), chained after ``parent_block_hash``."""

    block_hashes: list[Int64]
    parent_block_hash: Int64 | None
    token_ids: Sequence[TokenId]
    """A list when decoded from the wire; the fake engines pass a numpy view of the
    request's tokens (no copy: nothing in the control plane reads them)."""
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    lora_id: int | None = None
    medium: str | None = None


class BlockRemoved(_KVCacheEvent):
    """Blocks a node no longer holds in ``medium``."""

    block_hashes: list[Int64]
    medium: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    """The node dropped every block (stock SGLang does this on a role switch)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    ts: float
    events: list[KVEvent]
    attn_dp_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    attn_dp_rank: int | None = None


class KVEventDecoder:
    """Decodes payloads and frames; counts what it had to drop.

    ``decode`` returns the batch of valid events. A payload that is not a batch at all raises
    :class:`KVEventDecodeError`; single bad events inside a good batch are dropped and counted
    in ``dropped_events`` so one corrupt event never loses its neighbours.
    """

    def __init__(self) -> None:
        self._batch = msgspec.msgpack.Decoder(KVEventBatch)
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._event = msgspec.msgpack.Decoder(KVEvent)
        self.dropped_events = 0
        self.last_errors: list[str] = []

    def decode(self, payload: bytes) -> KVEventBatch:
        try:
            return self._batch.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        try:
            raw = self._raw.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise KVEventDecodeError(f"not a KV event batch: {exc}") from exc
        events: list[KVEvent] = []
        self.last_errors = []
        for item in raw.events:
            try:
                events.append(self._event.decode(item))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.dropped_events += 1
                self.last_errors.append(str(exc))
        return KVEventBatch(raw.ts, events, raw.attn_dp_rank)

    def decode_frames(self, frames: list[bytes]) -> tuple[bytes, int, KVEventBatch]:
        """``[topic, seq, payload]`` -> ``(topic, seq, batch)``."""
        if len(frames) != 3:
            raise KVEventDecodeError(f"expected 3 frames (topic, seq, payload), got {len(frames)}")
        topic, seq_bytes, payload = frames
        if len(seq_bytes) != 8:
            raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {len(seq_bytes)}")
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        return topic, seq, self.decode(payload)


def _array_to_list(obj: object) -> object:
    # Fake engines put numpy views of token ids in their events (``BlockStored``).
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_array_to_list)


def encode_payload(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def encode_frames(topic: bytes, seq: int, batch: KVEventBatch) -> list[bytes]:
    """The multipart message an SGLang publisher sends for ``batch``."""
    return [topic, seq.to_bytes(8, "big", signed=True), _encoder.encode(batch)]


# -- engine reports on the bus ---------------------------------------------------------------


class PrefillItem(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One request's share of a prefill iteration (one chunk of it under chunked prefill).

    ``t_uc`` tokens computed in this iteration, ``t_c`` tokens of context before them (cached
    prefix plus earlier chunks), ``t_rst`` tokens restored from host memory for it in this
    iteration. The iteration's query-key pairs are ``Σ t_uc·t_c + t_uc(t_uc+1)/2`` (Eq. 1).
    """

    request: str
    t_uc: int
    t_c: int
    t_rst: int = 0


class IterationReport(msgspec.Struct, tag=True, frozen=True, gc=False):
    """One forward pass of a node, as the engine measured it (the planner's fitting data).

    A prefill iteration lists its chunks in ``prefill``; a decode iteration has ``batch``
    running requests (``B`` of Eq. 2), each fed ``t_fwd`` tokens, and ``accepted`` output
    tokens in total (so ``t_acc = accepted / batch``).

    ``count`` > 1 summarises that many identical consecutive decode iterations (same batch,
    ``duration`` each, ``accepted`` in total): an engine that computes its next state change
    instead of waking every iteration (the simulator's fake engine) reports a run at once.
    """

    node: str
    start: float
    duration: float
    prefill: list[PrefillItem] = []
    batch: int = 0
    t_fwd: int = 1
    accepted: int = 0
    count: int = 1

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)


class NodeKVEvents(msgspec.Struct, frozen=True, gc=False):
    """A batch of KV events from ``node``'s engine, with its publisher sequence number."""

    node: str
    seq: int
    batch: KVEventBatch


class NodeKVViewLost(msgspec.Struct, frozen=True, gc=False):
    """``node``'s driver lost track of its KV event stream (a gap no replay fills): what the
    directory lists on the node can no longer be trusted. Not an eviction: the engine most
    likely still holds those blocks (its resync lists them again), so the branches' counts
    there stay (Algorithm E.2 line 20 zeroes the counts of blocks a node *evicted*)."""

    node: str
    reason: str


class NodeState(msgspec.Struct, frozen=True, gc=False):
    """A node's state, reported at every iteration launch (paper E.3 "Parameters").

    ``launched`` are the prefill chunks of the iteration starting at ``time`` (empty for a
    decode iteration or an idle node). ``kv_room`` is GPU KV the node could give a new decode
    request now (free plus evictable tokens).
    """

    node: str
    time: float
    phase: str
    launched: list[PrefillItem] = []
    queued: int = 0
    prefilling: int = 0
    decoding: int = 0
    kv_room: int = 0
    l1_used: int = 0
    l1_capacity: int = 0
    l2_used: int = 0
    l2_capacity: int = 0


class PrefillStarted(msgspec.Struct, frozen=True, gc=False):
    """The first chunk of ``request`` launched on ``node``: time to bind its decode node."""

    request: str
    node: str
    time: float


class TokenLogprobs(msgspec.Struct, frozen=True, gc=False):
    """Log-probabilities of a run of tokens, one entry per token: the token's (the sampled
    one, for output), and the most likely tokens at its position as ``(id, logprob)``, most
    likely first (empty lists when none were asked for)."""

    sampled: list[float]
    top: list[list[tuple[int, float]]]


class PrefillDone(msgspec.Struct, frozen=True, gc=False):
    """``request`` finished prefill on ``node``. ``cached`` input tokens were reused (of which
    ``fetched`` came from peers), ``computed`` were prefilled. ``prompt_logprobs``: those of
    the prompt's tokens but the first, when the request asked (``Sampling.prompt_logprobs``);
    they come before the request's first ``TokensOut``."""

    request: str
    node: str
    time: float
    cached: int
    fetched: int
    computed: int
    prompt_logprobs: TokenLogprobs | None = None
    fetch_s: float = 0.0
    """Seconds the peer fetch of the ``fetched`` tokens took, from its start to the KV in
    this node's host memory (0: no fetch, or not measured): the router fits τ to these."""


class TokensOut(msgspec.Struct, frozen=True, gc=False):
    """New output tokens of ``request``; ``finish`` is None until the last batch.

    ``tokens`` is a list of ids or a uint32 numpy array (the fake engines hand out slices of
    the output they planned, so a simulation never converts them). ``logprobs`` are theirs
    when the request asked for them (``Sampling.logprobs``), else None."""

    request: str
    node: str
    time: float
    tokens: Sequence[int]
    finish: str | None = None
    logprobs: TokenLogprobs | None = None


class RequestFailed(msgspec.Struct, frozen=True, gc=False):
    """``request`` failed on ``node``. ``started`` says whether its prefill had begun: a
    request whose prefill had not started may be routed again."""

    request: str
    node: str
    time: float
    error: str
    started: bool
    rejected: bool = False
    """The engine refused the request itself (a JSON schema its grammar cannot compile, a
    token id past its vocabulary): no node would serve it, so it is the client's error and
    is not routed again."""


class Withdrawn(msgspec.Struct, frozen=True, gc=False):
    """A queued request was taken back from ``node`` before its prefill started (drain)."""

    request: str
    node: str
    time: float


class PhaseSwitched(msgspec.Struct, frozen=True, gc=False):
    """``node`` serves ``phase`` from ``time`` on."""

    node: str
    phase: str
    time: float


class NodeDown(msgspec.Struct, frozen=True, gc=False):
    """``node``'s engine is gone (crash, lost connection): its KV and its work are lost."""

    node: str
    time: float
    reason: str


class NodeUp(msgspec.Struct, frozen=True, gc=False):
    """``node``'s engine serves again after a ``NodeDown`` (restarted: its KV is empty); its
    phase follows (``PhaseSwitched``)."""

    node: str
    time: float


class RequestDone(msgspec.Struct, frozen=True, gc=False):
    """What the service knows of a request once it is over (metrics and reports read it).

    Times are on the service clock; ``first_token`` and ``prefill_node``/``decode_node`` are
    None when the request never got that far. ``status`` is ``"ok"`` or the error class.
    """

    request: str
    branch: str
    arrival: float
    end: float
    status: str
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    fetched_tokens: int = 0
    first_token: float | None = None
    prefill_start: float | None = None
    prefill_node: str | None = None
    decode_node: str | None = None
    error: str = ""
    reroutes: int = 0
    finish: str | None = None
    """``"stop"`` or ``"length"`` for a request that finished."""


class SplitChanged(msgspec.Struct, frozen=True, gc=False):
    """The service started moving to a new split (planner decision or operator)."""

    time: float
    prefill: list[str]
    decode: list[str]
    reason: str
