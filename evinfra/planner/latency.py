"""Predicted latency of every candidate split, from the planner's own models (beyond the paper:
issue 43, for windows where throughput cannot tell the splits apart).

For slice ``i``, with arrival rate ``λ_i = requests_i / length_i`` and mean work ``w̄_i``, and the
candidate with ``p`` prefill nodes ``π[:p]`` and decode nodes ``π[p:]`` (the order of
:func:`~evinfra.planner.planner.plan`):

* **Prefill queue.** The router spreads requests over the prefill nodes by predicted TTFT, so
  they are taken as one queue of ``c = p`` servers of total rate ``μ_P = Σ_{n∈P} μ_P,n(w̄_i)``
  (Eq. 3), mean service ``S = c/μ_P`` (each node serves its share at its own speed) and load
  ``ρ = λ/μ_P``. Agents stop sending while they wait, so at most the slice's ``N_i`` active
  sources (:class:`Sources`: agents or sub-agent branches, from the window's requests) can
  queue: the wait ``W_q`` is that of the finite-source M/M/c//N queue (Engset's
  machine-repair model) whose sources send at the rate that makes it serve ``λ``; as ``ρ → 1``
  it tends to every other source waiting, ``(N − c)/μ_P``, and stays there when ``ρ ≥ 1``
  (the closed loop slows down instead of queueing without end). Without sources (an infinite
  one) it is the M/M/c wait, Sakasegawa's approximation
  ``S·ρ^(√(2(c+1)) − 1) / (c(1 − ρ))``, and ``inf`` when ``ρ ≥ 1``.
* **Batched prefill.** A node prefills the requests waiting for it together, in chunked
  iterations of up to ``t̄`` uncached tokens (the nodes' mean ``t̄_n``, Eq. 3): a request's
  prefill takes the time of the iterations its chunks run in, its own work and that of the
  requests packed with it, ``b·S`` with ``b = 1 + L_q/c`` (itself and those waiting per
  node), at most ``1 + t̄/t_uc``: behind a backed-up queue a request starts at a uniform
  offset in a full iteration and spans ``1 + t_uc/t̄`` of them, its neighbours' chunks filling
  one iteration's ``t̄`` tokens of its first and last (OSWorld's closed loop: ``t_uc`` ≈ 7K
  tokens take 2.2 ``S``, where a cap of ``t̄/t_uc`` said 1.2). ``TTFT = W_q + b·S``.
* **Decode (TPOT, E2E).** A request runs ``n_iter = t_out/t_acc`` decode iterations. The
  requests in decode spread evenly over the ``|D|`` decode nodes, ``B = q/|D|``, and Little's
  law ``q = λ·n_iter·T_D^iter(B)`` (Eq. 2 with the decode nodes' mean coefficients) is solved
  for ``B`` by iterating ``B ← λ·n_iter·T_D^iter(B)/|D|`` from 0: ``T_D^iter`` increases and is
  concave in ``B``, so the iterates increase to the least fixed point when there is one, that
  is when ``a·d2 < 1`` (``a = λ·n_iter/|D|``; ``φ ≤ 1``). ``TPOT = T_D^iter(B)/t_acc`` and the
  decode takes ``n_iter·T_D^iter(B)``.
* **Decode KV.** A decode node runs at most ``K = kv_tokens/kv̄`` requests (what its GPU KV
  holds, as in Θ: ``planner.py`` ``_theta``), ``K`` the candidate's decode nodes' mean. The
  fixed point is the population in decode that serves ``λ``; where it exceeds ``K`` the decode
  side cannot serve ``λ`` (``a·T_D^iter(K) > K`` then, since the least fixed point is where
  ``a·T_D^iter(B) − B`` turns negative) and the candidate does not keep up.
* ``E2E = TTFT + n_iter·T_D^iter(B)``, ``inf`` where the decode has no fixed point within ``K``
  (or, with an infinite source, ``ρ ≥ 1``).
* **Capacity**: the largest multiple of the slice's rate the candidate keeps up with,
  ``min(μ_P/λ, 1/(a·d2), K/(a·T_D^iter(K)))``; it *keeps up* in the slice when that is
  above 1.

Queueing for a decode slot and the P->D transfer are left out: they do not depend on the
split the way the two queues above do. The estimate is a model, not a measurement: the
planner switches on it only past a margin (``PlannerConfig.latency_min_gain``).
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import numpy as np
from scipy.optimize import brentq
from scipy.special import gammaln

from evinfra.planner.itermodel import phi

__all__ = ["Latency", "Sources", "predict_e2e"]

_ITERATIONS = 200
_TOLERANCE = 1e-9


class Latency(NamedTuple):
    """Predicted means per slice (rows) and candidate (column ``p − 1``), seconds."""

    wait: np.ndarray
    """``W_q``: the wait for a prefill node, before the prefill starts."""
    service: np.ndarray
    """``S``: one request's share of a prefill node (``ρ = λ·S/c``)."""
    prefill: np.ndarray
    """The prefill itself, its batch's time ``b·S`` (TTFT − wait)."""
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    capacity: np.ndarray
    """The largest multiple of the slice's rate the candidate keeps up with (> 1: it does)."""


class Sources:
    """The active sources of one window's slices: each branch (an agent or sub-agent) is
    active from its first request's arrival to its last request's end among the requests that
    end in the window, and to the window's end while it has a request in flight then; a
    slice's ``N`` is the mean number active over it. O(branches)."""

    def __init__(self, start: float, end: float, m: int) -> None:
        self.start, self.end, self.m = start, end, m
        self._spans: dict[str, tuple[float, float]] = {}

    def add(self, branch: str, arrival: float, end: float) -> None:
        """A request of ``branch`` that arrived at ``arrival`` ended at ``end``."""
        if not self.start <= end < self.end:
            return
        first, last = self._spans.get(branch, (end, end))
        self._spans[branch] = (min(first, arrival), max(last, end))

    def per_slice(self, in_flight: Mapping[str, float] | None = None) -> list[float] | None:
        """``N`` of every slice; None without any request seen (an infinite source).
        ``in_flight``: the branches with a request in flight at the window's end, with the
        earliest arrival among those requests. In a saturated closed loop a branch's next
        request waits past the window's end: counted only by the requests that end in the
        window, the last slices' sources fell to a fifth (OSWorld, 144 agents at 2P7D: 138
        active, then 115, 72 and 27 in the last three slices)."""
        spans = dict(self._spans)
        for branch, arrival in (in_flight or {}).items():
            first = spans.get(branch, (arrival, arrival))[0]
            spans[branch] = (min(first, arrival), self.end)
        if not spans:
            return None
        edges = np.linspace(self.start, self.end, self.m + 1)
        first, last = np.array(list(spans.values())).T
        overlap = (np.minimum(last[:, None], edges[None, 1:])
                   - np.maximum(first[:, None], edges[None, :-1])).clip(min=0.0)
        return (overlap.sum(axis=0) / np.diff(edges)).tolist()


def _finite_wait(lam: float, total: float, c: int, n: int) -> tuple[float, float]:
    """``(W_q, L_q)`` of the M/M/c//N queue of ``n`` sources and ``c`` servers of total rate
    ``total`` that serves ``lam`` (the module docstring); its saturated limit when it cannot."""
    if n <= c:
        return 0.0, 0.0  # every source has a server
    mu = total / c
    k = np.arange(n + 1)
    # log of p_k / p_0 at a per-source rate r = 1: C(n, k)·k!/(c!·c^(k−c)) beyond c servers.
    base = gammaln(n + 1) - gammaln(n - k + 1) - np.where(
        k <= c, gammaln(k + 1), gammaln(c + 1) + (k - c) * math.log(c))
    busy = np.minimum(k, c)
    queued = np.maximum(k - c, 0)

    def probabilities(log_r: float) -> np.ndarray:
        p = np.exp((lp := base + k * log_r) - lp.max())
        return p / p.sum()

    if lam >= total:
        return (n - c) / total, float(n - c)
    # Throughput μ·E[busy] grows with r from 0 to c·μ; at r = λ/(nμ) it is at most λ.
    low = math.log(lam / (n * mu))
    high = low + 2.0
    while mu * (busy @ probabilities(high)) < lam:
        high += 2.0 * (high - low)
    log_r = brentq(lambda x: math.log(mu * (busy @ probabilities(x)) / lam), low, high,
                   xtol=1e-10)
    lq = float(queued @ probabilities(log_r))
    return lq / lam, lq


def predict_e2e(mu_p: np.ndarray, d: np.ndarray, rate: np.ndarray, n_iter: np.ndarray,
                t_acc: np.ndarray, k_over_e: float, t_fwd: float, *,
                sources: np.ndarray | None = None, batch: np.ndarray | None = None,
                cap: np.ndarray | None = None) -> Latency:
    """The module docstring's estimate for ``p = 1..N−1``.

    ``mu_p``: ``(m, N)``, each node's prefill rate ``1/T_P^req(w̄_i)`` in the order π;
    ``d``: ``(3, N)``, each node's ``d0, d1, d2`` in that order; ``rate``, ``n_iter``,
    ``t_acc``: ``(m,)``; ``sources``: ``(m,)``, the active sources ``N_i`` (None: an infinite
    source); ``batch``: ``(m, N−1)``, the requests a candidate's prefill iteration takes,
    ``t̄/t_uc`` (None: no batching, a prefill takes ``S``); ``cap``: ``(m, N−1)``, the
    requests a candidate's decode node holds in GPU KV, ``K`` (None, or inf: no bound)."""
    m, n = mu_p.shape
    c = np.arange(1, n, dtype=float)
    total = np.cumsum(mu_p, axis=1)[:, :-1]  # μ_P of each candidate
    lam = rate[:, None]
    rho = lam / total
    service = c / total
    if sources is None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            wait = service * rho ** (np.sqrt(2 * (c + 1)) - 1) / (c * (1 - rho))
        wait = np.where(rho < 1, wait, np.inf)
        queued = wait * lam
    else:
        wait, queued = np.empty((m, n - 1)), np.empty((m, n - 1))
        for i, j in np.ndindex(m, n - 1):
            wait[i, j], queued[i, j] = _finite_wait(
                float(rate[i]), float(total[i, j]), j + 1, max(1, math.ceil(sources[i])))
    if batch is None:
        prefill = service
    else:
        per_node = 1.0 + np.where(np.isfinite(queued), queued, 0.0) / c
        prefill = np.minimum(per_node, 1.0 + batch) * service
    ttft = wait + prefill

    size = n - c  # |D|
    d0, d1, d2 = (np.cumsum(x[::-1])[::-1][1:] / size for x in d)  # decode nodes' means
    a = lam * n_iter[:, None] / size

    def iter_time(b: np.ndarray) -> np.ndarray:
        """T_D^iter at batch ``b`` with the decode nodes' mean coefficients (Eq. 2)."""
        return d0 + d1 * phi(b, k_over_e, t_fwd) + d2 * b

    B = np.zeros((m, n - 1))  # noqa: N806
    t_iter = iter_time(B)
    for _ in range(_ITERATIONS):
        nxt = a * t_iter
        step = np.abs(nxt - B)
        B = nxt  # noqa: N806
        t_iter = iter_time(B)
        if (step <= _TOLERANCE * np.maximum(B, 1.0)).all():
            break
    settled = np.abs(a * t_iter - B) <= 1e-6 * np.maximum(B, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        decode_capacity = np.where(settled, 1.0 / (a * d2), np.minimum(1.0 / (a * d2), 1.0))
    if cap is not None:
        bounded = np.isfinite(cap)
        k = np.where(bounded, cap, 0.0)
        t_k = iter_time(k)
        settled &= ~bounded | (B <= cap * (1.0 + 1e-9))
        with np.errstate(divide="ignore", invalid="ignore"):
            decode_capacity = np.minimum(decode_capacity,
                                         np.where(bounded, k / (a * t_k), np.inf))
    decode = np.where(settled, n_iter[:, None] * t_iter, np.inf)
    tpot = np.where(settled, t_iter / t_acc[:, None], np.inf)
    capacity = np.minimum(total / lam, decode_capacity)
    return Latency(wait=wait, service=service, prefill=prefill, ttft=ttft, tpot=tpot,
                   e2e=ttft + decode, capacity=capacity)
