"""The shared vocabulary: identifiers, phases, tiers, and a prefill's query-key pairs.

Everything here is plain data. Names follow the paper (Table 1): ``A`` is a prefill's
query-key pairs for ``t_uc`` uncached and ``t_c`` cached input tokens (paper 5.1).
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

__all__ = [
    "BlockHash",
    "BranchId",
    "NodeId",
    "NonNegFloat",
    "NonNegInt",
    "Phase",
    "PosFloat",
    "PosInt",
    "RequestId",
    "Tier",
    "qk_pairs",
]

NodeId = str
"""A node's name from the config (``"n0"``...). One node runs one symmetric engine."""

BranchId = str
"""An agent branch (paper 1, E.1): one context and its sequence of requests."""

RequestId = str

BlockHash = int
"""A KV block's id: SGLang's page-chained hash as a signed int64 (see ``core/hashing.py``)."""

PosInt = Annotated[int, msgspec.Meta(gt=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class Phase(enum.Enum):
    """What a node serves. ``COLLOCATED`` is the warm-up mode of Algorithm E.3 line 1, where
    every node prefills and decodes its own requests while the iteration models are fitted."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLLOCATED = "collocated"


class Tier(enum.IntEnum):
    """Where a node holds a block: GPU memory (L1) or host memory (L2, the shared pool)."""

    L1 = 1
    L2 = 2

    @classmethod
    def from_medium(cls, medium: str | None) -> "Tier | None":
        """SGLang's ``medium`` of a KV event. ``None`` is the GPU radix cache (events published
        without HiCache carry no medium); DISK and EXTERNAL tiers are not tracked (None)."""
        if medium is None or medium == "GPU":
            return cls.L1
        if medium == "CPU_PINNED":
            return cls.L2
        return None

    @property
    def medium(self) -> str:
        return "GPU" if self is Tier.L1 else "CPU_PINNED"


def qk_pairs(t_uc: float, t_c: float) -> float:
    """``A = t_uc * t_c + t_uc (t_uc + 1) / 2``: query-key pairs of a prefill (paper 5.1)."""
    return t_uc * t_c + t_uc * (t_uc + 1) / 2
