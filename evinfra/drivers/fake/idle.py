"""The idle GPU time of prefill nodes (paper D.6, Table D.5), from the engines' iteration logs.

Table D.5 "counts the time between iterations while a node has requests to serve": a prefill
node whose queued requests are all still fetching, awaiting their decode node's reservation
or short of GPU room waits between iterations, and under upstream SGLang an iteration that
consumes fetched KV also waits for its load-back before the forward. Both are idle GPU time
here; the share is over the time the node had prefill work (idle plus computing).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import msgspec

from evinfra.drivers.fake.records import PrefillIteration
from evinfra.workloads.summary import round6

__all__ = ["WAIT_S", "PrefillIdle", "prefill_idle"]

WAIT_S = 0.01
"""D.6: "93 % of its prefill iterations wait more than 10 ms before they start"."""


class PrefillIdle(msgspec.Struct, frozen=True):
    """Prefill iterations that started in a window, over every prefill node."""

    iterations: int
    idle_share: float
    """Idle seconds (waits between iterations plus load-back waits) over idle plus
    computing seconds."""
    load_share: float
    """Load-back waits alone over the same total (D.6: up to 8 % under upstream SGLang)."""
    waited_share: float
    """Iterations that waited more than :data:`WAIT_S` before their forward started."""
    loading_iterations: int
    """Iterations that consumed fetched KV loaded at their start."""
    mean_load: float
    """Seconds an iteration that consumed fetched KV waited for it (D.6: about 0.3 s)."""


def prefill_idle(logs: Iterable[Sequence[PrefillIteration]], start: float,
                 end: float) -> PrefillIdle:
    """:class:`PrefillIdle` of the iterations in ``logs`` (one log per node) that started in
    ``[start, end)``."""
    its = [i for log in logs for i in log if start <= i.start < end]
    waited = sum(i.waited for i in its)
    load = sum(i.load for i in its)
    total = waited + sum(i.duration for i in its)
    loading = [i.load for i in its if i.load > 0]
    return PrefillIdle(
        iterations=len(its),
        idle_share=round6((waited + load) / total) if total else 0.0,
        load_share=round6(load / total) if total else 0.0,
        waited_share=round6(sum(i.waited + i.load > WAIT_S for i in its) / len(its))
        if its else 0.0,
        loading_iterations=len(loading),
        mean_load=round6(sum(loading) / len(loading)) if loading else 0.0)
