"""The models the paper serves (6.1), as one fake node's timing: GLM-5.2 and Kimi K2.6.

:class:`~evinfra.drivers.fake.config.FakeEngineConfig`'s coefficients are GLM-5.2's (Fig.
5's fit, the sweeps of Fig. 2a). The paper gives no iteration time for Kimi K2.6, which it
serves for OSWorld and for the shifting run, so :func:`serving` derives one from what
differs between the two models, each factor from a published size:

- attention per query-key pair (``c2``) x4: K2.6 has no sparse-attention indexer (A.5: its
  35 KB of KV per token is MLA's 576 values in each of 61 layers, where GLM-5.2's 50 KB
  include the indexer's keys), so it attends to every cached token in full: 61 layers x 64
  heads x (192 + 128) x 2 = 2.5 MFLOP per pair in BF16, against GLM-5.2's indexer at about
  71 layers (50 KB / (576 + 128) B) x 64 heads x 128 x 2 = 1.2 MFLOP in FP8 at twice BF16's
  rate;
- linear layers per uncached token (``c1``) x0.8: 32B active parameters against 40B (the
  two model cards);
- peer fetch and prefill-to-decode transfer per token x35.1/54.6: A.5's 35 KB of KV per
  token against the 54.6 KB that D.6 measures for GLM-5.2.

The decode coefficients stay GLM-5.2's (Fig. 5d is the only decode measurement), and so do
the memory sizes (D.5 gives them once, for the runs of both models).
"""

from __future__ import annotations

import msgspec

from evinfra.drivers.fake.config import FakeEngineConfig

__all__ = ["MODELS", "serving"]

K26_C2 = 4.0
K26_C1 = 32 / 40
K26_KV = 576 * 61 / 1e3 / 54.6

MODELS = ("glm-5.2", "kimi-k2.6")


def serving(fake: FakeEngineConfig, model: str) -> FakeEngineConfig:
    """``fake`` (GLM-5.2's node) serving ``model``."""
    if model == "glm-5.2":
        return fake
    if model == "kimi-k2.6":
        return msgspec.structs.replace(
            fake, c1=fake.c1 * K26_C1, c2=fake.c2 * K26_C2,
            fetch_s_per_token=fake.fetch_s_per_token * K26_KV,
            pd_s_per_token=fake.pd_s_per_token * K26_KV)
    raise ValueError(f"unknown model {model!r}: one of {', '.join(MODELS)}")
