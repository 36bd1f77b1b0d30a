"""The client-side summary of a run: what every request saw, over the scored window.

One schema for the simulator's report and for a replay against a real endpoint, so the two
compare side by side. Computed from the runner's :class:`~evinfra.workloads.RequestRecord`s:

* throughput: requests finished in the window per second (paper C.4);
* E2E and TTFT per request, including an open-loop agent's admission wait on its first
  request (paper D.3); TPOT = (E2E − TTFT) / (output tokens − 1);
* KV hit rate ``h`` (reused input tokens over input tokens), the ideal ``h*`` (every input
  token whose KV an earlier request produced: an unlimited cache shared by all nodes, no
  switches), and lost KV reuse ``1 − h/h*`` (paper 3, Fig. 3 and 6);
* uncached input tokens per request;
* per request tag (``"subagent"``: a parent's first request after its sub-agents returned,
  ``"resume"``: the first request after a compaction, ...), the share of the prompt whose
  KV an earlier request produced and the wait before it (paper Fig. 2c: 98 % after a 359-s
  sub-agent call, 14 % after a 12-s compaction): a property of the workload, whatever the
  cache did;
* where reuse is lost, by the wait before the request (:data:`WAITS`): a branch's first
  request, or how long after its previous request's answer it was sent. The KV of a branch
  waiting on a tool, a sub-agent or its user must survive that wait (paper 3, 5.3), so this
  shows which waits the cache lets down (LRU loses long waits first).

A request counts in the window when it finishes in it (throughput's definition), errors and
requests cut by the end of the run are counted apart.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import msgspec
import numpy as np

from evinfra.workloads.backend import RequestRecord

__all__ = ["WAITS", "WAIT_LABELS", "WAIT_NAMES", "Latency", "Summary", "TagReuse", "WaitReuse",
           "round6", "summarise"]

WAITS: tuple[tuple[str, float], ...] = (
    ("<10s", 10.0), ("10s-1m", 60.0), ("1-10m", 600.0), (">=10m", float("inf")))
"""Wait buckets by upper bound (seconds); a branch's first request is ``"first"``."""
WAIT_LABELS = ("first", *(label for label, _ in WAITS))
WAIT_NAMES = dict(zip(WAIT_LABELS, (
    "a branch's first request", "a wait under 10 s", "a wait of 10 s to 1 min",
    "a wait of 1 to 10 min", "a wait of 10 min or more"), strict=True))
"""What reports call each bucket."""


class Latency(msgspec.Struct, frozen=True):
    """Seconds: mean, median, 95th and 99th percentile (0 when there is no sample)."""

    mean: float = 0.0
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0

    @classmethod
    def of(cls, values: Iterable[float]) -> "Latency":
        a = np.fromiter(values, dtype=float)
        if not a.size:
            return cls()
        p50, p95, p99 = np.percentile(a, [50, 95, 99])
        return cls(round6(a.mean()), round6(p50), round6(p95), round6(p99))


def round6(x: float) -> float:
    """Six significant digits: reports stay readable and byte-stable."""
    return float(f"{float(x):.6g}")



class WaitReuse(msgspec.Struct, frozen=True):
    """Reuse of the requests sent after one kind of wait (finished ok in the window)."""

    requests: int
    ideal_cached: int
    """Their ``h*`` numerator: tokens an unlimited shared cache would have reused."""
    cached: int
    lost_kv_reuse: float
    """``1 - cached / ideal_cached`` (0 with nothing to reuse)."""
    share_of_lost: float
    """Their part of the window's lost tokens (``ideal_cached - cached`` over all requests)."""


class Summary(msgspec.Struct, frozen=True):
    start: float
    end: float
    requests: int
    """Requests that finished ok in the window."""
    errors: int
    """Requests that failed in the window."""
    unfinished: int
    """Requests sent in the window that had no answer when the run ended."""
    throughput: float
    """Requests per second."""
    output_tokens_per_s: float
    e2e: Latency
    ttft: Latency
    tpot: Latency
    prompt_tokens: int
    cached_tokens: int
    kv_hit_rate: float
    """h: reused input tokens over input tokens."""
    ideal_hit_rate: float
    """h*: what an unlimited cache shared by every node, with no switches, would reuse."""
    lost_kv_reuse: float
    """1 - h/h*."""
    uncached_tokens_per_request: float
    cached_reported: bool
    """Whether the target reported reused tokens at all (``h`` is 0 when it did not)."""
    reuse_by_wait: dict[str, WaitReuse] = {}
    """By the wait before the request (:data:`WAIT_LABELS`)."""
    reuse_by_tag: dict[str, TagReuse] = {}
    """By the request's tag, as the workload labels it (``subagent``, ``resume`` ...)."""


class TagReuse(msgspec.Struct, frozen=True):
    """The requests of one tag (finished ok in the window): how much of their prompts an
    unlimited shared cache holds, and how long after their branch's previous answer they
    were sent."""

    requests: int
    ideal_share: float
    """``Σ ideal_cached / Σ input_tokens``."""
    mean_wait: float
    """Seconds since the branch's previous request's answer (its send, if none)."""
    mean_e2e: float


def summarise(records: Sequence[RequestRecord], start: float, end: float) -> Summary:
    ok: list[RequestRecord] = []
    errors = unfinished = 0
    for r in records:
        if r.done_time is None:
            if start <= r.send_time < end:
                unfinished += 1
            continue
        if not start <= r.done_time < end:
            continue
        if r.status == "ok":
            ok.append(r)
        else:
            errors += 1
    span = max(end - start, 1e-9)
    prompt = sum(r.input_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ideal = sum(r.ideal_cached for r in ok)
    h = cached / prompt if prompt else 0.0
    h_star = ideal / prompt if prompt else 0.0
    ttft = [r.queued + r.ttft for r in ok if r.ttft is not None]
    e2e = [r.queued + r.e2e for r in ok]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    out = sum(r.output_tokens for r in ok)
    gaps = _gaps(records)
    return Summary(
        start=start, end=end, requests=len(ok), errors=errors, unfinished=unfinished,
        throughput=round6(len(ok) / span), output_tokens_per_s=round6(out / span),
        e2e=Latency.of(e2e), ttft=Latency.of(ttft), tpot=Latency.of(tpot),
        prompt_tokens=prompt, cached_tokens=cached, kv_hit_rate=round6(h),
        ideal_hit_rate=round6(h_star), lost_kv_reuse=round6(1 - h / h_star) if h_star else 0.0,
        uncached_tokens_per_request=round6((prompt - cached) / len(ok)) if ok else 0.0,
        cached_reported=any(r.cached_tokens is not None for r in ok),
        reuse_by_wait=_reuse_by_wait(records, ok, ideal - cached, gaps),
        reuse_by_tag=_reuse_by_tag(ok, gaps))


def _gaps(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """Each request's wait: from its branch's previous request's answer (its send, if it had
    none) to its own send, None for a branch's first request; every record counts as a
    previous request, warm-up and failures included."""
    gaps: dict[str, float | None] = {}
    last: dict[str, float] = {}
    for r in sorted(records, key=lambda r: r.send_time):
        before = last.get(r.branch_id)
        gaps[r.request_id] = None if before is None else r.send_time - before
        last[r.branch_id] = r.done_time if r.done_time is not None else r.send_time
    return gaps


def _reuse_by_tag(ok: list[RequestRecord], gaps: dict[str, float | None]
                  ) -> dict[str, TagReuse]:
    """:attr:`Summary.reuse_by_tag`."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in ok:
        if r.tag:
            groups.setdefault(r.tag, []).append(r)
    out = {}
    for tag, rs in sorted(groups.items()):
        prompt = sum(r.input_tokens for r in rs)
        waits = [g for r in rs if (g := gaps[r.request_id]) is not None]
        out[tag] = TagReuse(len(rs), round6(sum(r.ideal_cached for r in rs) / prompt) if prompt
                            else 0.0, round6(np.mean(waits)) if waits else 0.0,
                            round6(np.mean([r.queued + r.e2e for r in rs])))
    return out


def _reuse_by_wait(records: Sequence[RequestRecord], ok: list[RequestRecord],
                   lost: int, gaps: dict[str, float | None]) -> dict[str, WaitReuse]:
    """:attr:`Summary.reuse_by_wait` (``gaps``: :func:`_gaps`). ``lost``: the window's lost
    tokens."""
    wait: dict[str, str] = {}
    for r in records:
        gap = gaps[r.request_id]
        wait[r.request_id] = WAIT_LABELS[0] if gap is None else next(
            label for label, bound in WAITS if gap < bound)
    groups: dict[str, list[RequestRecord]] = {}
    for r in ok:
        groups.setdefault(wait[r.request_id], []).append(r)
    out = {}
    for label, rs in groups.items():
        ideal = sum(r.ideal_cached for r in rs)
        cached = sum(r.cached_tokens or 0 for r in rs)
        out[label] = WaitReuse(len(rs), ideal, cached,
                               round6(1 - cached / ideal) if ideal else 0.0,
                               round6((ideal - cached) / lost) if lost else 0.0)
    return out
