"""Slice statistics of one planning window: Algorithm E.3 line 15.

A window of length ``T_win`` is cut into ``m`` equal slices. Per slice it keeps the sums
behind w̄_i (finished requests' ``t_uc``, ``A``, ``t_c``, ``t_out`` and their decode KV;
decode iterations' accepted tokens for ``t_acc``) and the time integrals of two levels:
``q``, the number of requests in decode, for q̄_i, and ``n``, the number of requests in
flight, for n̄_i. Per
node it keeps the prefill iterations behind t̄_n and f_n. Memory is O(m + nodes): nothing
per request survives its ``add_request``.

Why means of terms: Eq. 3 is linear in ``(t_uc, A, t_c)`` and Eq. 4 in ``t_out`` for a slice's
``t_acc``, so Θ evaluated on these means is the inverse of the exact mean occupancy of the
slice's requests, and that, not the mean of ``1/T^req``, is what a node sustains.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import msgspec

from evinfra.core.events import PrefillItem
from evinfra.core.types import NodeId, qk_pairs
from evinfra.planner.itermodel import PrefillMix

__all__ = ["SliceWork", "Window"]


class SliceWork(msgspec.Struct, frozen=True, kw_only=True):
    """w̄_i, q̄_i and n̄_i of one slice: the means of its finished requests' work terms and the
    time-weighted mean numbers of requests in decode and in flight. Without finished requests
    (or any decode iteration in the window, for t_acc) the slice has no w̄ and is not
    ``usable``."""

    start: float
    length: float
    """Seconds the slice lasts (``T_win / m``): its finished requests over it are the rate
    the latency estimate queues (:func:`~evinfra.planner.latency.predict_e2e`)."""
    requests: int
    t_uc: float
    A: float
    t_c: float
    t_out: float
    t_acc: float
    """Output tokens per request per decode iteration, from the slice's decode iterations (the
    window's when the slice had none)."""
    kv: float = 0.0
    """Tokens of GPU KV a request in decode holds on average over time: its whole context
    ``t_uc + t_c + t_out`` (an engine reserves or grows to it), weighted by its decode time,
    which at one node's batch is proportional to ``t_out``. So ``Σ(t_uc + t_c + t_out)·t_out
    / Σt_out`` over the slice's requests; 0 without any (no bound on Θ's decode batch)."""
    q: float
    n: float
    """Requests in flight: waiting for or in prefill (queued, fetching, handed over) or in
    decode, ``≥ q``. Θ's decode side is evaluated at this population (:func:`~evinfra.planner
    .planner.plan` says why)."""

    @property
    def usable(self) -> bool:
        return self.requests > 0 and self.t_acc > 0


class Window:
    """Observations of one window ``[start, start + length)``; outside it they are ignored.

    ``q`` and ``n`` are the numbers of requests in decode and in flight at ``start`` (levels,
    not events, so they carry over from the previous window and the hold-off).
    """

    def __init__(self, start: float, length: float, m: int, q: float, n: float) -> None:
        self.start = start
        self.end = start + length
        self.m = m
        self._dt = length / m
        # Per slice: finished requests and their Σt_uc, ΣA, Σt_c, Σt_out, Σ(context)·t_out;
        # decode iterations' accepted tokens and request-iterations (Σ batch); ∫q dt and ∫n dt.
        # Lists: one slice is updated per observation, where numpy's per-call cost would
        # dominate.
        self._work = [[0.0] * 6 for _ in range(m)]
        self._accepted = [0.0] * m
        self._fed = [0.0] * m
        self._q_area = [0.0] * m
        self._n_area = [0.0] * m
        self._q, self._n = q, n
        self._level_at = start
        self.mix: dict[NodeId, PrefillMix] = {}

    def _slice(self, now: float) -> int | None:
        if not self.start <= now < self.end:
            return None
        return min(int((now - self.start) / self._dt), self.m - 1)

    def add_request(self, now: float, t_uc: float, t_c: float, t_out: float) -> None:
        i = self._slice(now)
        if i is not None:
            for k, x in enumerate((1.0, t_uc, qk_pairs(t_uc, t_c), t_c, t_out,
                                   (t_uc + t_c + t_out) * t_out)):
                self._work[i][k] += x

    def add_decode(self, now: float, batch: int, accepted: int, count: int = 1) -> None:
        """``count`` decode iterations of ``batch`` requests with ``accepted`` tokens in all.
        ``accepted < batch·count`` means the engine did not report its accepted tokens (every
        running request gains at least one per iteration), so it is skipped."""
        i = self._slice(now)
        if i is not None and accepted >= batch * count > 0:
            self._accepted[i] += accepted
            self._fed[i] += batch * count

    def add_prefill(self, now: float, node: NodeId, items: Sequence[PrefillItem]) -> None:
        # A request chunked across the window start counts its first chunk here as cached:
        # at most one chunk per node per window, against hundreds of requests.
        if self._slice(now) is not None:
            self.mix.setdefault(node, PrefillMix()).add(items)

    def set_population(self, now: float, q: float, n: float) -> None:
        """The numbers of requests in decode and in flight became ``q`` and ``n`` at ``now``."""
        self._integrate(min(now, self.end))
        self._q, self._n = q, n

    def _integrate(self, until: float) -> None:
        t = self._level_at
        i = self._slice(t)
        while t < until:
            seg = min(until, self.start + (i + 1) * self._dt if i < self.m - 1 else self.end)
            self._q_area[i] += self._q * (seg - t)
            self._n_area[i] += self._n * (seg - t)
            t, i = seg, i + 1
        self._level_at = max(self._level_at, until)

    def close(self) -> list[SliceWork]:
        """w̄_i, q̄_i and n̄_i of every slice, integrating q and n up to the window end."""
        self._integrate(self.end)
        fed = sum(self._fed)
        pooled = sum(self._accepted) / fed if fed else 0.0
        out = []
        for i, (count, t_uc, A, t_c, t_out, kv) in enumerate(self._work):  # noqa: N806
            per = 1.0 / count if count else 0.0
            out.append(SliceWork(
                start=self.start + i * self._dt, length=self._dt, requests=int(count),
                t_uc=t_uc * per, A=A * per, t_c=t_c * per, t_out=t_out * per,
                kv=kv / t_out if t_out else 0.0,
                q=self._q_area[i] / self._dt, n=self._n_area[i] / self._dt,
                t_acc=self._accepted[i] / self._fed[i] if self._fed[i] else pooled))
        return out

    def remeasure(self, previous: Mapping[NodeId, tuple[float, float]]
                  ) -> dict[NodeId, tuple[float, float]]:
        """``{node: (t̄_n, f_n)}`` for the nodes of ``previous`` (E.3 line 15).

        A node that prefilled in this window gets its own values. A node that did not (a
        decode node) gets the values pooled over the window's prefill nodes: t̄ and f follow
        the workload mix, which the router spreads over all prefill nodes, and that is what
        the node would see if a candidate split moved it to prefill. Without any prefill
        iterations, and for f without any cached tokens, the previous values stay.
        """
        pooled = PrefillMix()
        for mix in self.mix.values():
            pooled.merge(mix)
        out = {}
        for node, (t_bar, f) in previous.items():
            mix = self.mix.get(node, pooled)
            out[node] = (mix.t_bar if mix.t_bar is not None else t_bar,
                         mix.f if mix.f is not None else f)
        return out
