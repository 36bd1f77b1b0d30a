"""Which pages a queued prefill pulls from which peer (pure).

The router's plan (:class:`~evinfra.engine_patch.wire.FetchPlan`) names runs of the request's
path, ``own .. t_c`` in the router's view (Algorithm E.3: the node's own prefix, then what
peers hold). The engine's view may differ by the time the request arrives, so
:func:`segments` re-cuts the plan against what the engine holds now:

* pages the engine already holds (device or host) are not fetched;
* the fetch must start right where the local prefix ends: a radix tree only reuses a
  contiguous prefix, so a plan that starts later (a gap) is useless and fetches nothing;
* a run whose block hashes do not match the request's own pages (a stale plan, or another
  request's) ends the plan there.
"""

from __future__ import annotations

from typing import Sequence

import msgspec

from evinfra.engine_patch.wire import FetchPlan

__all__ = ["Segment", "segments"]


class Segment(msgspec.Struct, frozen=True):
    """Pages ``[start, end)`` of the request's path, to lease and read from ``peer``."""

    peer: str
    start: int
    end: int

    @property
    def pages(self) -> int:
        return self.end - self.start


def segments(plan: FetchPlan, path: Sequence[int], local_pages: int, page_size: int
             ) -> tuple[list[Segment], str]:
    """The segments to fetch, and why the plan was cut short ("" when it was not).

    ``path`` are the block hashes of the request's full pages; ``local_pages`` how many of
    them (a prefix) the engine holds now."""
    if plan.page_size != page_size:
        return [], f"plan pages are {plan.page_size} tokens, the engine's {page_size}"
    if not plan.runs:
        return [], "empty plan"
    end = 0
    why = ""
    for r in plan.runs:
        for i, h in enumerate(r.blocks):
            pos = r.start + i
            if pos >= len(path) or path[pos] != h:
                why = f"block {pos} of the plan is not the request's"
                break
            end = pos + 1
        if why:
            break
    if end <= local_pages:
        return [], why or "already held"
    if local_pages < plan.first_block:
        return [], (f"gap: the engine holds {local_pages} pages, the plan starts at "
                    f"{plan.first_block}")
    out = []
    for r in plan.runs:
        s, e = max(r.start, local_pages), min(r.start + len(r.blocks), end)
        if s < e:
            out.append(Segment(r.peer, s, e))
    return out, why
