"""Iteration-time models of paper 5.1 (Equations 1-4) and their online fit.

Public API (the router and the planner rely on these names)::

    phi(B, k_over_e, t_fwd)                 fraction of routed experts a decode reads (B.3)
    NodeModel                               one node's frozen model; every method broadcasts (numpy)
        .c0 .c1 .c2 .c3 .d0 .d1 .d2         coefficients of Eq. 1 and Eq. 2 (seconds per unit)
        .t_bar .f                           t̄_n and f_n of Eq. 3 (remeasured every window)
        .k_over_e .t_fwd                    k/E and t_fwd of phi
        .unidentified                       coefficients the records could not determine
        .prefill_ok .decode_ok              whether Eq. 1/3 and Eq. 2/4 may be used
        .t_p_iter(t_uc, t_c, t_rst=0)       Eq. 1: one batch; sums over the last axis
        .t_p_req(t_uc, t_c, A=None)         Eq. 3: occupancy of one request in prefill
        .t_d_iter(B)                        Eq. 2
        .t_d_req(t_out, t_acc, B)           Eq. 4: occupancy of one request in decode
        .mu_p(t_uc, t_c, A=None)            1 / T_P^req
        .mu_d(t_out, t_acc, B)              1 / T_D^req (0 at B = 0)
        .kv_tokens                          GPU KV a decode batch can hold (0: not reported)
        .remeasured(t_bar, f, kv_tokens)    the same coefficients with new t̄_n, f_n, capacity
        .reduced .pooled .stand_in          coefficients not from the node's own full fit
    NodeFitter(node, k_over_e, t_fwd)       collects a node's IterationReports, fits, freezes
        .add(report)   .fit() -> FitReport
    FitReport                               the model plus what the fit could and could not tell
    pool(models)                            each model with the phases it lacks taken from peers
    PrefillMix                              t̄_n and f_n of one node from its prefill iterations

Check ``prefill_ok`` / ``decode_ok`` before predicting: a model whose records could not separate
two coefficients still computes numbers, but only for batches like the ones it was fitted on.

Fitting (Algorithm E.3 line 1). Records are the engine's own iteration reports. Prefill rows
are ``(1, Σt_uc, ΣA, Σt_rst)``, decode rows ``(1, φ(B), B)``; both are solved by
``scipy.optimize.nnls`` with every row divided by its measured time, because the noise of a
GPU iteration is multiplicative: unweighted least squares would fit the long 128K-context
iterations and ignore the relative error of the short ones. Rows are folded into the normal
equations as they arrive, so a 30-minute warmup costs a 4x4 and a 3x3 matrix per node, not
its records. The columns span ten orders of magnitude (ΣA ~ 1e9, the constant 1), so the
solve runs on columns scaled to unit norm and the coefficients are scaled back.

Identifiability. A coefficient is reported unidentifiable when the records cannot pin it down:
too few records, a column that is always zero (no host restores: ``c3``), or columns that are
linearly dependent (every iteration had the same Σt_uc, so ``c0`` and ``c1`` trade off; one
batch size, so ``d0``-``d2`` trade off). Only ``c3`` may be missing from a usable prefill
model: without restores it is taken as 0, which is exact for a node that never restores.

Stand-ins, so that one node's records never block the planner. Tied coefficients are fixed
at 0 one at a time until the rest are identified (``reduced``: the fit is still exact for
iterations like the recorded ones), and a phase a node has no usable records of takes the
median coefficients of the nodes that identified it (:func:`pool`, ``pooled``; all nodes
serve one model). A model with stand-ins keeps fitting online (the planner refits it every
window) until its own records identify it.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import nnls

from evinfra.core.events import IterationReport, PrefillItem
from evinfra.core.types import NodeId, qk_pairs

__all__ = ["FitReport", "NodeFitter", "NodeModel", "PrefillMix", "phi", "pool"]

PREFILL_COEFFICIENTS = ("c0", "c1", "c2", "c3")
DECODE_COEFFICIENTS = ("d0", "d1", "d2")
_PREFILL_COLUMNS = ("1", "Σt_uc", "ΣA", "Σt_rst")
_DECODE_COLUMNS = ("1", "φ(B)", "B")

# A direction of the column-normalised Gram matrix whose eigenvalue is below this fraction of
# the largest is a null direction: the design's condition number there exceeds 1e5, so a few
# percent of noise moves the coefficients along it by more than their own size.
_NULL_EIGENVALUE = 1e-10
# A coefficient is identifiable when its unit vector lies (numerically) outside the null space.
_NULL_LEAK = 1e-6
# Rows per coefficient before a fit is trusted: with fewer, NNLS interpolates the noise.
_ROWS_PER_COEFFICIENT = 2
# Which tied coefficient a reduced fit fixes at 0 first. Prefill: with equal Σt_uc per
# iteration the per-iteration cost c0 folds into the per-token c1 (Eq. 3 charges c0/t̄ per
# token, the same sum); restores tied to the prefix fold into the attention term. Decode: the
# expert-reading term φ(B) is what a narrow range of batch sizes cannot separate from 1 and B;
# with a single batch size the time is taken as constant (decode at small B reads weights).
_PREFILL_DROP = ("c0", "c3", "c2", "c1")
_DECODE_DROP = ("d1", "d2", "d0")
# Rows wait in a list and join the Gram matrix in numpy batches of this many.
_FOLD_EVERY = 512


def phi(B: ArrayLike, k_over_e: float, t_fwd: float) -> ArrayLike:
    """``φ(B) = 1 − (1 − k/E)^(t_fwd·B)``: expected fraction of routed experts that the
    ``t_fwd·B`` tokens of a decode iteration select (paper 5.1, derivation in App. B.3)."""
    return 1.0 - (1.0 - k_over_e) ** (t_fwd * B)


class NodeModel(msgspec.Struct, frozen=True, kw_only=True):
    """The iteration-time models of one node (Eq. 1-4), coefficients frozen after warmup.

    Every method takes floats or numpy arrays and broadcasts. ``t_bar`` (t̄_n, mean uncached
    tokens per prefill iteration) and ``f`` (f_n, fraction of cached tokens restored from host)
    are the only fields that change after warmup (:meth:`remeasured`), with ``kv_tokens``.
    """

    node: NodeId
    c0: float
    c1: float
    c2: float
    c3: float
    d0: float
    d1: float
    d2: float
    k_over_e: float
    t_fwd: float
    t_bar: float
    f: float
    kv_tokens: int = 0
    """Tokens of GPU KV the node's running requests can hold (``NodeState.l1_capacity``, as
    the node last reported it; 0: not reported, no bound). Decode runs from GPU memory, so
    this bounds the batch B that Θ credits the node with (:func:`~evinfra.planner.planner
    .plan`, a departure from Eq. 5 its README explains)."""
    unidentified: tuple[str, ...] = ()
    reduced: tuple[str, ...] = ()
    """Coefficients a reduced fit fixed at 0 because the records could not separate them from
    the others (:meth:`NodeFitter.fit`)."""
    pooled: tuple[str, ...] = ()
    """Coefficients carried from the nodes that identified them (:func:`pool`): this node's
    records could not determine them."""

    @property
    def stand_in(self) -> bool:
        """Some coefficient is not the node's own fit (reduced or pooled): keep fitting."""
        return bool(self.reduced or self.pooled)

    @property
    def prefill_ok(self) -> bool:
        """Eq. 1 and 3 are usable: c0-c2 are identified (c3 may be 0 for want of restores)."""
        return not set(self.unidentified) & {"c0", "c1", "c2"} and self.t_bar > 0

    @property
    def decode_ok(self) -> bool:
        return not set(self.unidentified) & set(DECODE_COEFFICIENTS)

    def t_p_iter(self, t_uc: ArrayLike, t_c: ArrayLike, t_rst: ArrayLike = 0.0) -> ArrayLike:
        """Eq. 1: time of one prefill iteration whose requests (chunks) are the last axis of
        ``t_uc``, ``t_c`` and ``t_rst``; a scalar is a batch of one request."""
        t_uc, t_c, t_rst = np.broadcast_arrays(np.atleast_1d(np.asarray(t_uc, dtype=float)),
                                               t_c, t_rst)
        return (self.c0 + self.c1 * t_uc.sum(-1) + self.c2 * qk_pairs(t_uc, t_c).sum(-1)
                + self.c3 * t_rst.sum(-1))

    def t_p_req(self, t_uc: ArrayLike, t_c: ArrayLike,
                A: ArrayLike | None = None) -> ArrayLike:  # noqa: N803
        """Eq. 3: ``c0·t_uc/t̄ + c1·t_uc + c2·A + c3·f·t_c``, a request's time on the node.

        ``A`` defaults to the request's own query-key pairs. Eq. 3 is linear in
        ``(t_uc, A, t_c)``, so passing the *means* of the three over a set of requests gives
        the exact mean occupancy of the set (the planner's w̄); ``A`` of the mean request
        would not, since A is quadratic in t_uc.
        """
        if A is None:
            A = qk_pairs(t_uc, t_c)
        return (self.c0 * t_uc / self.t_bar + self.c1 * t_uc + self.c2 * A
                + self.c3 * self.f * t_c)

    def t_d_iter(self, B: ArrayLike) -> ArrayLike:  # noqa: N803
        """Eq. 2: time of one decode iteration with ``B`` running requests."""
        return self.d0 + self.d1 * phi(B, self.k_over_e, self.t_fwd) + self.d2 * B

    def t_d_req(self, t_out: ArrayLike, t_acc: ArrayLike, B: ArrayLike) -> ArrayLike:  # noqa: N803
        """Eq. 4: ``T_D^iter(B)·t_out/(B·t_acc)``, the share of B-request decode iterations one
        request occupies over its ``t_out/t_acc`` iterations (B > 0). Linear in ``t_out``, so
        the mean ``t_out`` of a set gives its mean occupancy."""
        return self.t_d_iter(B) * t_out / (B * t_acc)

    def mu_p(self, t_uc: ArrayLike, t_c: ArrayLike,
             A: ArrayLike | None = None) -> ArrayLike:  # noqa: N803
        """Requests per second the node completes in prefill: ``1 / T_P^req``."""
        return 1.0 / self.t_p_req(t_uc, t_c, A)

    def mu_d(self, t_out: ArrayLike, t_acc: ArrayLike, B: ArrayLike) -> ArrayLike:  # noqa: N803
        """Requests per second the node completes in decode: ``1 / T_D^req`` (0 when B = 0)."""
        return B * t_acc / (self.t_d_iter(B) * t_out)

    def remeasured(self, t_bar: float, f: float, kv_tokens: int) -> "NodeModel":
        """This model with the window's t̄_n and f_n (paper 5.1 "Online fitting") and the
        node's last reported KV capacity."""
        return msgspec.structs.replace(self, t_bar=t_bar, f=f, kv_tokens=kv_tokens)


class FitReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one node's warmup records told the fit, for logs and the admin API."""

    node: NodeId
    model: NodeModel
    prefill_records: int
    decode_records: int
    skipped_records: int
    """Mixed prefill+decode iterations (neither equation alone describes them) and records
    with a non-positive duration."""
    prefill_error: float
    """RMS relative residual of Eq. 1 over the prefill records (NaN without records)."""
    decode_error: float
    problems: list[str]
    """One sentence per coefficient group the records could not determine."""

    @property
    def usable(self) -> bool:
        return self.model.prefill_ok and self.model.decode_ok


class PrefillMix:
    """t̄_n and f_n of one node (Eq. 3), summed over its prefill iterations.

    A chunk's ``t_c`` counts the earlier chunks of its own request too, so only the first
    chunk of a request contributes its cached prefix: a chunk whose request was in the node's
    previous prefill iteration is a continuation (chunked prefill runs a request's chunks in
    consecutive prefill iterations).
    """

    __slots__ = ("tokens", "iterations", "restored", "cached", "_previous")

    def __init__(self) -> None:
        self.tokens = 0
        self.iterations = 0
        self.restored = 0
        self.cached = 0
        self._previous: frozenset[str] = frozenset()

    def add(self, items: Sequence[PrefillItem]) -> None:
        self.iterations += 1
        for item in items:
            self.tokens += item.t_uc
            self.restored += item.t_rst
            if item.request not in self._previous:
                self.cached += item.t_c
        self._previous = frozenset(item.request for item in items)

    def merge(self, other: "PrefillMix") -> None:
        self.tokens += other.tokens
        self.iterations += other.iterations
        self.restored += other.restored
        self.cached += other.cached

    @property
    def t_bar(self) -> float | None:
        return self.tokens / self.iterations if self.iterations else None

    @property
    def f(self) -> float | None:
        return self.restored / self.cached if self.cached else None


class _NormalEquations:
    """Σ w wᵀ and Σ w over rows ``w = x / y`` (each row relative to its measured time)."""

    def __init__(self, coefficients: tuple[str, ...], columns: tuple[str, ...]) -> None:
        self.coefficients = coefficients
        self.columns = columns
        p = len(coefficients)
        self.gram = np.zeros((p, p))
        self.moment = np.zeros(p)
        self.rows = 0
        self._pending: list[tuple[float, ...]] = []

    def add(self, *row: float, count: int = 1) -> None:
        """One record ``(x..., y)``; ``count`` identical records at once (a summarised run)."""
        self._pending.append((count, *row))
        if len(self._pending) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        if not self._pending:
            return
        cxy = np.array(self._pending)
        c = cxy[:, :1]
        w = cxy[:, 1:-1] / cxy[:, -1:]
        self.gram += (c * w).T @ w
        self.moment += (c * w).sum(axis=0)
        self.rows += int(c.sum())
        self._pending.clear()

    def solve(self, what: str, drop: tuple[str, ...] = ()
              ) -> tuple[np.ndarray, list[str], float, list[str], list[str]]:
        """NNLS on the rows so far -> (coefficients, unidentified, RMS rel. error, problems,
        reduced).

        Coefficients whose columns are linearly dependent are fixed at 0 one at a time, in
        the order ``drop``, until the rest are identified (``reduced``): the reduced model
        fits the records as well as any solution would, so it predicts batches like them
        exactly and extrapolates along the kept columns only. Ties ``drop`` does not name
        stay unidentified."""
        self._fold()
        p = len(self.coefficients)
        names = ", ".join(self.coefficients)
        if self.rows == 0:
            return np.zeros(p), list(self.coefficients), float("nan"), [
                f"{names} unidentifiable: no {what} iterations recorded"], []
        if self.rows < _ROWS_PER_COEFFICIENT * p:
            return np.zeros(p), list(self.coefficients), float("nan"), [
                f"{names} unidentifiable: only {self.rows} {what} iterations recorded, "
                f"{_ROWS_PER_COEFFICIENT * p} needed"], []
        norm = np.sqrt(np.diag(self.gram))
        live = norm > 0
        unidentified = [c for c, ok in zip(self.coefficients, live) if not ok]
        problems = [f"{c} unidentifiable: column {col} is 0 in every {what} record"
                    for c, col, ok in zip(self.coefficients, self.columns, live) if not ok]
        reduced: list[str] = []
        while True:
            idx = np.flatnonzero(live)
            scale = norm[idx]
            gram = self.gram[np.ix_(idx, idx)] / np.outer(scale, scale)
            moment = self.moment[idx] / scale
            lam, vec = np.linalg.eigh(gram)
            null = lam <= _NULL_EIGENVALUE * lam.max()
            tied = idx[(vec[:, null] ** 2).sum(axis=1) > _NULL_LEAK]
            if not tied.size:
                break
            tied_names = [self.coefficients[i] for i in tied]
            if not reduced:
                problems.append(
                    f"{', '.join(tied_names)} unidentifiable: columns "
                    f"{', '.join(self.columns[i] for i in tied)} are linearly dependent over "
                    f"the {self.rows} {what} records")
            pick = next((c for c in drop if c in tied_names), None)
            if pick is None:
                unidentified += tied_names
                break
            live[self.coefficients.index(pick)] = False
            reduced.append(pick)
        if reduced:
            problems.append(f"{', '.join(reduced)} fixed at 0 so that the rest are identified "
                            f"(a reduced fit, exact for {what} iterations like these)")
        # ||R x − b||² is the weighted residual up to a constant, with R = Λ^½ Vᵀ over the
        # non-null directions: NNLS on the Gram's square root instead of on the raw rows.
        keep = ~null
        root = np.sqrt(lam[keep])
        x, _ = nnls(root[:, None] * vec[:, keep].T, (vec[:, keep].T @ moment) / root)
        residual = x @ gram @ x - 2 * moment @ x + self.rows
        coef = np.zeros(p)
        coef[idx] = x / scale
        order = {c: i for i, c in enumerate(self.coefficients)}
        unidentified.sort(key=order.__getitem__)
        return coef, unidentified, float(np.sqrt(max(residual, 0.0) / self.rows)), problems, \
            reduced


class NodeFitter:
    """Collects one node's iteration reports during warmup and fits Eq. 1 and Eq. 2 to them.

    ``k_over_e`` and ``t_fwd`` are the served model's (config); each decode record is fitted
    with the ``t_fwd`` its report carries, and the frozen model predicts with ``t_fwd``.
    """

    def __init__(self, node: NodeId, k_over_e: float, t_fwd: float) -> None:
        self.node = node
        self.k_over_e = k_over_e
        self.t_fwd = t_fwd
        self.mix = PrefillMix()
        self._prefill = _NormalEquations(PREFILL_COEFFICIENTS, _PREFILL_COLUMNS)
        self._decode = _NormalEquations(DECODE_COEFFICIENTS, _DECODE_COLUMNS)
        self._skipped = 0
        self._other_t_fwd: set[int] = set()

    def add(self, report: IterationReport) -> None:
        if report.duration <= 0 or (report.prefill and report.batch):
            self._skipped += 1
        elif report.prefill:
            self.mix.add(report.prefill)
            t_uc = sum(i.t_uc for i in report.prefill)
            A = sum(qk_pairs(i.t_uc, i.t_c) for i in report.prefill)  # noqa: N806
            t_rst = sum(i.t_rst for i in report.prefill)
            self._prefill.add(1.0, t_uc, A, t_rst, report.duration)
        elif report.batch:
            if report.t_fwd != self.t_fwd:
                self._other_t_fwd.add(report.t_fwd)
            B = report.batch  # noqa: N806
            self._decode.add(1.0, float(phi(B, self.k_over_e, report.t_fwd)), B, report.duration,
                             count=report.count)

    def fit(self) -> FitReport:
        """Fit both equations on every record so far (NNLS), and freeze them into a model."""
        c, c_bad, c_err, c_problems, c_reduced = self._prefill.solve("prefill", _PREFILL_DROP)
        d, d_bad, d_err, d_problems, d_reduced = self._decode.solve("decode", _DECODE_DROP)
        problems = c_problems + d_problems
        if self._skipped:
            problems.append(f"{self._skipped} records skipped: prefill and decode in one "
                            "iteration, or a non-positive duration")
        if self._other_t_fwd:
            problems.append(f"decode records with t_fwd {sorted(self._other_t_fwd)} fitted as "
                            f"reported, predictions use the configured t_fwd={self.t_fwd}")
        c0, c1, c2, c3 = map(float, c)
        d0, d1, d2 = map(float, d)
        model = NodeModel(node=self.node, c0=c0, c1=c1, c2=c2, c3=c3, d0=d0, d1=d1, d2=d2,
                          k_over_e=self.k_over_e, t_fwd=self.t_fwd,
                          t_bar=self.mix.t_bar or 0.0, f=self.mix.f or 0.0,
                          unidentified=tuple(c_bad + d_bad), reduced=tuple(c_reduced + d_reduced))
        return FitReport(node=self.node, model=model, prefill_records=self._prefill.rows,
                         decode_records=self._decode.rows, skipped_records=self._skipped,
                         prefill_error=c_err, decode_error=d_err, problems=problems)


_PHASES = {"prefill": ("c0", "c1", "c2", "c3"), "decode": DECODE_COEFFICIENTS}
# What a phase's model cannot do without (c3 may be 0: module docstring).
_NEEDED = {"prefill": {"c0", "c1", "c2"}, "decode": set(DECODE_COEFFICIENTS)}


def pool(models: Sequence[NodeModel]) -> list[NodeModel]:
    """Every model, with the coefficients of a phase it cannot use replaced by the element-wise
    median of the nodes whose own fit identified that phase (all nodes serve one model on
    like hardware: a peer's coefficients are the best prior a node has). Donors with a full
    fit of the phase are preferred to reduced ones; pooled coefficients are never passed on.
    A node without prefill iterations also takes the donors' median t̄_n and f_n (the
    window remeasures them later). A phase no node identified stays unidentified."""
    out = []
    for m in models:
        for phase, names in _PHASES.items():
            if not set(m.unidentified) & _NEEDED[phase]:
                continue
            usable = [x for x in models if x is not m and not set(x.unidentified) & _NEEDED[phase]
                      and not set(x.pooled) & set(names)]
            full = [x for x in usable if not set(x.reduced) & set(names)]
            donors = full or usable
            if not donors:
                continue
            values = {c: float(np.median([getattr(x, c) for x in donors])) for c in names}
            if phase == "prefill" and m.t_bar <= 0:
                values["t_bar"] = float(np.median([x.t_bar for x in donors]))
                values["f"] = float(np.median([x.f for x in donors]))
            m = msgspec.structs.replace(
                m, **values, unidentified=tuple(c for c in m.unidentified if c not in names),
                reduced=tuple(c for c in m.reduced if c not in names),
                pooled=m.pooled + names)
        out.append(m)
    return out
