"""Predicted latency of every candidate split, from the planner's own models (beyond the paper:
issue 43, for windows where throughput cannot tell the splits apart).

For slice ``i``, with arrival rate ``λ_i = requests_i / length_i`` and mean work ``w̄_i``, and the
candidate with ``p`` prefill nodes ``π[:p]`` and decode nodes ``π[p:]`` (the order of
:func:`~evinfra.planner.planner.plan`):

* **Prefill (TTFT).** The router spreads requests over the prefill nodes by predicted TTFT, so
  they are taken as one queue of ``c = p`` servers of total rate ``μ_P = Σ_{n∈P} μ_P,n(w̄_i)``
  (Eq. 3), mean service ``S = c/μ_P`` (each node serves its share at its own speed) and load
  ``ρ = λ/μ_P``. The mean wait is Sakasegawa's approximation of the M/M/c queue,
  ``W_q = S·ρ^(√(2(c+1)) − 1) / (c(1 − ρ))``, and ``TTFT = W_q + S``.
* **Decode (TPOT, E2E).** A request runs ``n_iter = t_out/t_acc`` decode iterations. The
  requests in decode spread evenly over the ``|D|`` decode nodes, ``B = q/|D|``, and Little's
  law ``q = λ·n_iter·T_D^iter(B)`` (Eq. 2 with the decode nodes' mean coefficients) is solved
  for ``B`` by iterating ``B ← λ·n_iter·T_D^iter(B)/|D|`` from 0: ``T_D^iter`` increases and is
  concave in ``B``, so the iterates increase to the least fixed point when there is one.
  ``TPOT = T_D^iter(B)/t_acc`` and the decode takes ``n_iter·T_D^iter(B)``.
* ``E2E = TTFT + n_iter·T_D^iter(B)``. A candidate that cannot keep up in a slice (``ρ ≥ 1``, or
  no fixed point) predicts ``inf`` there.

Queueing for a decode slot and the P->D transfer are left out: they do not depend on the
split the way the two queues above do. The estimate is a model, not a measurement: the
planner switches on it only past a margin (``PlannerConfig.latency_min_gain``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from evinfra.planner.itermodel import phi

__all__ = ["Latency", "predict_e2e"]

_ITERATIONS = 200
_TOLERANCE = 1e-9


class Latency(NamedTuple):
    """Predicted means per slice (rows) and candidate (column ``p − 1``), seconds."""

    wait: np.ndarray
    """``W_q``: the wait for a prefill node, before the prefill starts."""
    service: np.ndarray
    """``S``: the prefill itself (finite where the wait is not: ``ρ = λ·S/c``)."""
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray


def predict_e2e(mu_p: np.ndarray, d: np.ndarray, rate: np.ndarray, n_iter: np.ndarray,
                t_acc: np.ndarray, k_over_e: float, t_fwd: float) -> Latency:
    """The module docstring's estimate for ``p = 1..N−1``.

    ``mu_p``: ``(m, N)``, each node's prefill rate ``1/T_P^req(w̄_i)`` in the order π;
    ``d``: ``(3, N)``, each node's ``d0, d1, d2`` in that order; ``rate``, ``n_iter``,
    ``t_acc``: ``(m,)``."""
    m, n = mu_p.shape
    c = np.arange(1, n, dtype=float)
    total = np.cumsum(mu_p, axis=1)[:, :-1]  # μ_P of each candidate
    lam = rate[:, None]
    rho = lam / total
    service = c / total
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        wait = service * rho ** (np.sqrt(2 * (c + 1)) - 1) / (c * (1 - rho))
    wait = np.where(rho < 1, wait, np.inf)
    ttft = wait + service

    size = n - c  # |D|
    d0, d1, d2 = (np.cumsum(x[::-1])[::-1][1:] / size for x in d)  # decode nodes' means
    a = lam * n_iter[:, None] / size
    B = np.zeros((m, n - 1))  # noqa: N806
    t_iter = d0 + d1 * phi(B, k_over_e, t_fwd) + d2 * B
    for _ in range(_ITERATIONS):
        nxt = a * t_iter
        step = np.abs(nxt - B)
        B = nxt  # noqa: N806
        t_iter = d0 + d1 * phi(B, k_over_e, t_fwd) + d2 * B
        if (step <= _TOLERANCE * np.maximum(B, 1.0)).all():
            break
    settled = np.abs(a * t_iter - B) <= 1e-6 * np.maximum(B, 1.0)
    decode = np.where(settled, n_iter[:, None] * t_iter, np.inf)
    tpot = np.where(settled, t_iter / t_acc[:, None], np.inf)
    return Latency(wait=wait, service=service, ttft=ttft, tpot=tpot, e2e=ttft + decode)
