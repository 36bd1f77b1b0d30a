"""The config validates at the edge and carries the paper's numbers."""

import msgspec
import pytest

from evinfra.drivers.fake import FakeEngineConfig


def test_defaults_are_the_papers() -> None:
    c = FakeEngineConfig()
    assert (c.l1_tokens, c.l2_tokens, c.chunk_tokens) == (2_060_000, 8_250_000, 8192)  # D.5, E.3
    assert c.fetch_s_per_token == pytest.approx(1.05e-6, rel=0.01)  # 54.6 KB at 52 GB/s, D.6
    assert c.switch_latency == 0.7  # paper 3


def test_config_decodes_from_plain_data_and_rejects_typos() -> None:
    c = msgspec.convert({"streaming": "batched", "output_vocab": [0, 256]}, FakeEngineConfig)
    assert c.streaming == "batched" and c.output_vocab == (0, 256)
    with pytest.raises(msgspec.ValidationError, match="l1_token"):
        msgspec.convert({"l1_token": 5}, FakeEngineConfig)
    with pytest.raises(msgspec.ValidationError, match="t_acc"):
        msgspec.convert({"t_acc": 2.5}, FakeEngineConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kv_drop": 1.5}, FakeEngineConfig)
