"""KV events in SGLang 0.5.23's wire schema, and their decoding at the edge.

An engine publishes ZMQ multipart messages ``[topic, seq, payload]``: ``seq`` is an 8-byte
big-endian signed sequence number, ``payload`` a msgpack array ``[ts, [events], dp_rank]``.
Each event is a msgpack map tagged by ``type`` (the class name); fields left at their default
are omitted (SGLang ``disaggregation/kv_events.py``: ``EventBatch``, ``KVCacheEvent``).

The fake engine encodes these same structs, so the directory is fed the same bytes by fake and
real engines. Decoding validates; a batch with one bad event keeps its good ones.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from evinfra.errors import KVEventDecodeError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecoder",
    "encode_frames",
    "encode_payload",
    "END_SEQ",
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
    token_ids: list[TokenId]
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


_encoder = msgspec.msgpack.Encoder()


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
    """

    node: str
    start: float
    duration: float
    prefill: list[PrefillItem] = []
    batch: int = 0
    t_fwd: int = 1
    accepted: int = 0

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)
