"""Ground-truth iteration times of a fake node: Equations 1 and 2 plus what they leave out.

The engine measures its iterations with these functions; the control plane never calls them.
Prefill follows Eq. 1 exactly. Decode follows Eq. 2 plus the context term of B.4 that Eq. 2
omits, so a fitted model carries a small, honest error. Noise is multiplicative, as on a GPU
(the planner weights its fit for it), and comes from a seeded generator: one draw per call.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from evinfra.core.events import PrefillItem
from evinfra.core.types import qk_pairs
from evinfra.drivers.fake.config import FakeEngineConfig

__all__ = ["GroundTruth", "phi"]

_MIN_FACTOR = 0.5
"""Noise never shrinks an iteration below half its time (a Gaussian tail would reach zero)."""


def phi(B: int, k_over_e: float, t_fwd: int) -> float:  # noqa: N803 - the paper's name
    """``φ(B) = 1 − (1 − k/E)^(t_fwd·B)``: fraction of routed experts a decode reads (B.3)."""
    return 1.0 - (1.0 - k_over_e) ** (t_fwd * B)


class GroundTruth:
    """The iteration times of one node."""

    def __init__(self, config: FakeEngineConfig, rng: np.random.Generator) -> None:
        self.config = config
        self._rng = rng

    def prefill_base(self, items: Iterable[PrefillItem]) -> float:
        """Eq. 1: ``c0 + c1 Σt_uc + c2 ΣA + c3 Σt_rst`` over the chunks of one iteration."""
        c = self.config
        t_uc = A = t_rst = 0.0  # noqa: N806
        for i in items:
            t_uc += i.t_uc
            A += qk_pairs(i.t_uc, i.t_c)  # noqa: N806
            t_rst += i.t_rst
        return c.c0 + c.c1 * t_uc + c.c2 * A + c.c3 * t_rst

    def decode_base(self, B: int, context: int) -> float:  # noqa: N803
        """Eq. 2, ``d0 + d1 φ(B) + d2 B``, plus ``d_ctx`` per running context token (B.4)."""
        c = self.config
        return c.d0 + c.d1 * phi(B, c.k_over_e, c.t_fwd) + c.d2 * B + c.d_ctx * context

    def prefill(self, items: Iterable[PrefillItem]) -> float:
        return self._noisy(self.prefill_base(items))

    def decode(self, B: int, context: int) -> float:  # noqa: N803
        return self._noisy(self.decode_base(B, context))

    def _noisy(self, seconds: float) -> float:
        if not self.config.noise:
            return seconds
        factor = 1.0 + self.config.noise * float(self._rng.standard_normal())
        return seconds * max(_MIN_FACTOR, factor)
