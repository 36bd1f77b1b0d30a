import msgspec
import pytest

from evinfra.core.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                 KVEventDecoder, encode_frames)
from evinfra.errors import KVEventDecodeError

# A payload byte for byte as SGLang 0.5.23's publisher encodes it (msgspec, its own
# KVEventBatch / BlockStored / BlockRemoved / AllBlocksCleared definitions): array
# [ts, [events], dp_rank], events as maps tagged by "type" first, None-default fields omitted
# (medium), required Optional fields as nil (parent_block_hash, lora_id).
SGLANG_PAYLOAD = bytes.fromhex(
    "93cb41da13b8602000009386a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3f3e0"
    "813c89d0991fd38b02ac8104b6f59eb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739805"
    "06070809cd0b0a0b0caa626c6f636b5f73697a6504a76c6f72615f6964c082a474797065ac426c6f636b52656d6f"
    "766564ac626c6f636b5f68617368657391d38b02ac8104b6f59e81a474797065b0416c6c426c6f636b73436c6561"
    "72656400")


def _payload(events, ts=1.0, rank=0) -> bytes:
    return msgspec.msgpack.encode([ts, events, rank])


def test_decodes_real_sglang_bytes() -> None:
    batch = KVEventDecoder().decode(SGLANG_PAYLOAD)
    assert batch.attn_dp_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored([-873556230699706081, -8429985882354289250], None,
                                 [5, 6, 7, 8, 9, 2826, 11, 12], 4, None)
    assert removed == BlockRemoved([-8429985882354289250])
    assert cleared == AllBlocksCleared()


def test_frames_round_trip() -> None:
    batch = KVEventBatch(2.5, [BlockRemoved([1, -2], medium="CPU_PINNED")], 0)
    frames = encode_frames(b"kv", 41, batch)
    assert frames[1] == (41).to_bytes(8, "big")
    assert KVEventDecoder().decode_frames(frames) == (b"kv", 41, batch)


def test_one_bad_event_does_not_lose_its_neighbours() -> None:
    dec = KVEventDecoder()
    batch = dec.decode(_payload([
        {"type": "BlockRemoved", "block_hashes": [1]},
        {"type": "BlockTeleported", "block_hashes": [2]},
        {"type": "BlockRemoved", "block_hashes": ["x"]},
        {"type": "BlockRemoved", "block_hashes": [2**63]},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None,
         "token_ids": [-1], "block_size": 4, "lora_id": None},
        {"type": "AllBlocksCleared"},
    ]))
    assert batch.events == [BlockRemoved([1]), AllBlocksCleared()]
    assert dec.dropped_events == 4


@pytest.mark.parametrize("payload", [b"", b"\xc1", SGLANG_PAYLOAD[:-5], msgspec.msgpack.encode({"a": 1}),
                                     msgspec.msgpack.encode(["ts", [], 0])])
def test_malformed_payloads_raise_a_typed_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        KVEventDecoder().decode(payload)


def test_malformed_frames_raise_a_typed_error() -> None:
    dec = KVEventDecoder()
    with pytest.raises(KVEventDecodeError):
        dec.decode_frames([b"", SGLANG_PAYLOAD])
    with pytest.raises(KVEventDecodeError):
        dec.decode_frames([b"", b"\x00" * 7, SGLANG_PAYLOAD])
