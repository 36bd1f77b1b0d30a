"""Online phase-split adaptation: paper 5.2 and the outer loop of Algorithm E.3 (lines 1, 15-29).

:func:`plan` is the pure decision at the end of a window: Θ (Eq. 5) of every candidate split
on every slice, the gains (Eq. 6), the ``ḡ > 2σ/√m`` test and the choice. :class:`Planner`
is the state around it: warmup and fit (line 1), the window and its slices (line 15), the
hold-off and draining guard (line 16), and the split it keeps. Both are synchronous and take
the time as an argument; the service feeds them observations and applies the decisions.

Candidates (line 19). The nodes are put in one order π: the prefill nodes first, those with
the strongest relative advantage for prefill (``μ_P,n / μ_D,n`` at the window's mean work)
first, then the decode nodes in the same order; ties go by node name. The candidate with
``p`` prefill nodes is ``(π[:p], π[p:])``: for ``p < |P|`` it moves the prefill nodes least
suited to prefill, for ``p > |P|`` the decode nodes best suited to it, and it changes
``|p − |P||`` nodes, the fewest possible.
"""

from __future__ import annotations

import math
from typing import Annotated, Iterable, Literal, Protocol, Sequence

import msgspec
import numpy as np
import structlog

from evinfra.core.contracts import NodeLoad
from evinfra.core.events import IterationReport, NodeState, RequestDone
from evinfra.core.types import BranchId, NodeId, NonNegFloat, PosFloat, PosInt
from evinfra.errors import ConfigError
from evinfra.planner.itermodel import FitReport, NodeFitter, NodeModel, phi, pool
from evinfra.planner.latency import Latency, Sources, predict_e2e
from evinfra.planner.window import SliceWork, Window

__all__ = ["Candidate", "Decision", "Planner", "PlannerConfig", "Split", "SplitPlanner", "plan",
           "predict"]

log = structlog.get_logger(__name__)


class PlannerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The planner's parameters; defaults are the paper's runs (6.1, E.3 "Parameters")."""

    t_learn: PosFloat = 1800.0
    """Collocated warmup before the models freeze (E.3 line 1; E.3 "Parameters": 1,800 s)."""
    t_win: PosFloat = 600.0
    """Planning window T_win (6.1, E.3: 600 s)."""
    m: Annotated[int, msgspec.Meta(ge=2)] = 10
    """Slices per window (6.1, E.3: 60-s slices, m = 10); the 2σ/√m test needs two."""
    hold_off: NonNegFloat = 120.0
    """Seconds skipped after a switch (E.3 line 16 and "Parameters": 120 s)."""
    experts_per_token: PosInt = 8
    """k of φ(B): routed experts each token selects (GLM-5.2: 8 of 256, App. B.1)."""
    routed_experts: PosInt = 256
    """E of φ(B) (GLM-5.2: 256, App. B.1)."""
    t_fwd: PosInt = 2
    """Tokens a running request feeds each decode iteration (5.1). The paper gives 6 for
    DeepSeek-V4-Flash (App. B.1) and only "MTP" for GLM-5.2 (6.1); 2 is one draft token."""
    adapt: bool = True
    """False keeps the split the warm-up ends with: the fixed-split ablation (6.4, Fig. 8b)
    and the static-split sweeps. The models are still fitted (the router needs them)."""
    objective: Literal["throughput", "latency"] = "throughput"
    """``throughput``: the paper's rule (Eq. 5-6). ``latency`` (beyond the paper): the
    paper's rule first; when no candidate's throughput gain is significant, the candidate
    whose predicted mean E2E gain (:mod:`evinfra.planner.latency`) passes the same 2σ/√m
    test and ``latency_min_gain``, among those predicted to keep up with that margin more
    load in every slice. While the current split keeps up so, a throughput candidate
    predicted slower by more than the margin is set aside (Θ differs below capacity while the
    throughput served does not; taking it would undo the latency rule's switches), and so is
    any candidate predicted not to keep up with the previous window's load (hysteresis). No
    latency gain takes a candidate that Θ predicts to serve less by the margin and the 2σ/√m
    test (the estimate holds the rate, Θ the requests in flight, which is what a closed loop
    holds). When the current split is predicted not to keep up over the window (its mean load
    is at least its capacity), the nearest candidate predicted to keep up takes its place
    without the 2σ/√m test (queues grow; :func:`_to_stable`)."""
    latency_min_gain: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.05
    """A latency switch also needs a mean gain of at least this share of the current split's
    predicted mean E2E: the model's own error, not only the slices' noise, must be beaten, so
    two splits predicted alike do not trade places."""
    ttft_target_s: PosFloat | None = None
    """Optional SLA targets of the latency rule (as SLA planners take them): a candidate
    *meets* them when its predicted mean TTFT (and TPOT, ``tpot_target_s``) stays within them
    in every slice. Among the candidates the latency rule qualifies, those that meet the
    targets are preferred, and while the current split meets them one that does not is set
    aside: the targets choose between qualified switches, they never cause one."""
    tpot_target_s: PosFloat | None = None

    def __post_init__(self) -> None:
        if self.experts_per_token > self.routed_experts:
            raise ValueError("experts_per_token (k) cannot exceed routed_experts (E)")

    @property
    def k_over_e(self) -> float:
        return self.experts_per_token / self.routed_experts


class Split(msgspec.Struct, frozen=True):
    """A PD split: which nodes prefill and which decode (names sorted)."""

    prefill: tuple[NodeId, ...]
    decode: tuple[NodeId, ...]

    @classmethod
    def of(cls, nodes: Iterable[NodeId], prefill: Iterable[NodeId]) -> "Split":
        p = set(prefill)
        return cls(tuple(sorted(p)), tuple(sorted(n for n in nodes if n not in p)))

    @property
    def label(self) -> str:
        return f"{len(self.prefill)}P{len(self.decode)}D"


class Candidate(msgspec.Struct, frozen=True, kw_only=True):
    """A candidate of Algorithm E.3 lines 19-24: ``(order[:prefill], order[prefill:])``."""

    prefill: int
    moved: int
    """Nodes that would switch phase: ``|prefill − |P||``."""
    gains: list[float]
    """g_i of Eq. 6 on each usable slice, requests per second."""
    mean: float
    sigma: float
    threshold: float
    """``2σ/√m``, with m the number of usable slices."""
    qualified: bool
    e2e: list[float] = []
    """Predicted mean E2E on each usable slice, seconds (``objective = "latency"``, when the
    throughput rule chose nothing; inf: the candidate cannot keep up there)."""
    e2e_gain: float = 0.0
    """Mean over the slices of the current split's predicted E2E minus this one's."""
    e2e_threshold: float = 0.0
    e2e_qualified: bool = False


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What the planner decided at ``at`` and why; JSON-encodable for logs and the API."""

    at: float
    split: Split
    """The split the window ran with."""
    reason: str
    chosen: Split | None = None
    """The split to switch to, or None to keep ``split``."""
    slices: list[SliceWork] = []
    order: list[NodeId] = []
    """π: a candidate with p prefill nodes prefills on ``order[:p]``."""
    theta: list[float] = []
    """Θ of ``split`` on each usable slice (Eq. 5), requests per second."""
    candidates: list[Candidate] = []
    rule: Literal["throughput", "latency", "none"] = "none"
    """Which rule chose ``chosen`` ("none": nothing was chosen)."""
    e2e: list[float] = []
    """Predicted mean E2E of ``split`` on each usable slice, when the latency rule ran."""
    sources: list[float] | None = None
    """The active sources of every slice (:class:`~evinfra.planner.latency.Sources`), which
    the latency rule's prefill queue holds at most; None: none seen, or the paper's rule."""


# -- the decision ----------------------------------------------------------------------------


class _Arrays:
    """The models as columns in one node order: what Eq. 3 and Eq. 4 need per node."""

    def __init__(self, k_over_e: float, t_fwd: float, columns: np.ndarray) -> None:
        self.k_over_e, self.t_fwd, self.columns = k_over_e, t_fwd, columns
        # c0/t̄ + c1 is Eq. 3's cost per uncached token; c3·f its cost per cached token; kv is
        # the GPU KV a decode batch can hold (inf: not reported).
        self.per_token, self.c2, self.c3f, self.d0, self.d1, self.d2, self.t_bar, self.kv = columns

    @classmethod
    def of(cls, models: Sequence[NodeModel]) -> "_Arrays":
        shapes = {(x.k_over_e, x.t_fwd) for x in models}
        if len(shapes) != 1:
            raise ValueError(f"all nodes must serve one model (k/E, t_fwd): got {shapes}")
        (k_over_e, t_fwd), = shapes
        return cls(k_over_e, t_fwd, np.array(
            [(x.c0 / x.t_bar + x.c1, x.c2, x.c3 * x.f, x.d0, x.d1, x.d2, x.t_bar,
              x.kv_tokens or math.inf) for x in models]).T)

    def take(self, order: np.ndarray) -> "_Arrays":
        return _Arrays(self.k_over_e, self.t_fwd, self.columns[:, order])

    def t_p_req(self, t_uc: np.ndarray, A: np.ndarray, t_c: np.ndarray) -> np.ndarray:  # noqa: N803
        """Eq. 3 for every (work, node) pair: shape ``work.shape + (N,)``."""
        return (np.multiply.outer(t_uc, self.per_token) + np.multiply.outer(A, self.c2)
                + np.multiply.outer(t_c, self.c3f))

    def t_d_iter(self, B: float) -> np.ndarray:  # noqa: N803
        return self.d0 + self.d1 * phi(B, self.k_over_e, self.t_fwd) + self.d2 * B

    def caps(self, kv: np.ndarray) -> np.ndarray:
        """``(m, N)``: the requests each node's GPU KV holds at each slice's ``kv̄``
        (``kv_tokens/kv̄``; inf where the node reported no capacity or the slice has no kv̄)."""
        kv = kv[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(kv > 0, self.kv[None, :] / kv, np.inf)


def _theta(nodes: _Arrays, w: dict[str, np.ndarray]) -> np.ndarray:
    """Θ(π[:p], π[p:]; w̄_i, n̄_i) of Eq. 5 for p = 1..N−1, shape (m, N−1), with
    ``nodes`` in the order π.

    The decode side is evaluated at ``B = n̄/|D|``, with n̄ the requests in flight (waiting
    for or in prefill, or in decode), where Eq. 5 takes the requests in decode, q̄. The
    paper's q̄ is what the current split lets into decode: on a prefill-bound split it is
    what the prefill side feeds, q̄ = λ·(t_out/t_acc)·T_D^iter(q̄/|D|) by Little's law, so
    the current decode side, Σ_D μ_D,n = q̄·t_acc/(t_out·T_D^iter(q̄/|D|)), is the rate
    served λ, every candidate with a decode node fewer gets less than λ (T_D^iter grows
    with B), and no move toward prefill can ever qualify. The
    requests queued for prefill are decode work the cluster already holds: a split that
    prefills them sooner decodes them too. n̄ is that population, so the decode side is
    again what the decode nodes can complete with the requests at hand; where decode binds,
    few requests wait for prefill and n̄ is q̄ plus those in prefill service.

    Decode runs from GPU memory, so node k runs at most ``cap_ik = kv_tokens_k / kv̄_i``
    requests (kv̄_i: the GPU KV a request in decode holds, :attr:`SliceWork.kv`); the others
    wait for admission, their prefill done. Its μ_D is evaluated at ``min(B, cap_ik)``, where
    Eq. 5 credits a node with every request its share of q̄ holds however little of their KV
    fits (the README's second departure from Eq. 5).

    The prefill side is a prefix sum of the μ_P matrix (m × N, computed once). The decode side
    is not a suffix sum of one matrix: B = n̄/|D| changes with p, so every node's μ_D is
    evaluated at the B of each candidate it decodes in, O(N·m) per candidate. A candidate
    gets that only where the decode side may be the smaller one: by the AM-HM inequality
    Σ_{k∈D} 1/T_k ≥ |D|² / Σ_{k∈D} T_k, whose right side costs O(1) per (slice, candidate)
    from suffix sums of d0, d1, d2, evaluated at B capped by the smallest cap among the
    candidate's decode nodes (μ_D grows with B: φ is concave with φ(0) = 0); where that bound
    reaches the prefill side in every slice, Θ is the prefill side exactly.
    """
    n = len(nodes.d0)
    mu_p = 1.0 / nodes.t_p_req(w["t_uc"], w["A"], w["t_c"])
    prefill = np.cumsum(mu_p, axis=1)[:, :-1]
    size = n - np.arange(1, n)  # |D| of each candidate
    B = w["n"][:, None] / size  # noqa: N806
    f = phi(B, nodes.k_over_e, nodes.t_fwd)
    # Eq. 4: μ_D,n = B·t_acc / (T_D,n^iter(B)·t_out); no requests in decode -> 0.
    n_iter = w["n_iter"][:, None]
    scale = np.where(B > 0, B / n_iter, 0.0)
    cap = nodes.caps(w["kv"])
    with np.errstate(divide="ignore", invalid="ignore"):
        at = np.where(np.isfinite(cap), cap, 0.0)
        # cap/T_D^iter(cap): what a node running its cap adds to Σ B/T_D^iter.
        full = np.where(np.isfinite(cap), at / nodes.t_d_iter(at), 0.0)
    smallest, largest = _over_decode(np.minimum, cap), _over_decode(np.maximum, cap)
    capped = B > largest  # every decode node runs its cap: a suffix sum, exact
    mixed = (B > smallest) & ~capped
    low = np.minimum(B, smallest)
    d0, d1, d2 = (_over_decode(np.add, x) for x in (nodes.d0, nodes.d1, nodes.d2))
    with np.errstate(divide="ignore", invalid="ignore"):
        bound = (np.where(low > 0, low / n_iter, 0.0) * size * size
                 / (d0 + d1 * phi(low, nodes.k_over_e, nodes.t_fwd) + d2 * low))
    exact = ~(bound >= prefill).all(axis=0)
    decode = np.where(capped, _over_decode(np.add, full) / n_iter, np.inf)
    wanted = exact & ~capped.all(axis=0)
    if wanted.any():
        with np.errstate(divide="ignore", invalid="ignore"):
            sums = _inverse_iter_sums(nodes, B, f, wanted, cap, full, mixed)
            summed = np.where(scale > 0, scale * sums, 0.0)
        decode[:, wanted] = np.where(capped, decode, summed)[:, wanted]
    return np.minimum(prefill, decode)


def _over_decode(ufunc: np.ufunc, x: np.ndarray) -> np.ndarray:
    """``ufunc`` reduced over each candidate's decode nodes: column ``p − 1`` of the result
    reduces ``x[..., π[p:]]`` (nodes on the last axis, in the order π), for p = 1..N−1."""
    return ufunc.accumulate(x[..., ::-1], axis=-1)[..., ::-1][..., 1:]


def _inverse_iter_sums(nodes: _Arrays, B: np.ndarray, f: np.ndarray,  # noqa: N803
                       wanted: np.ndarray, cap: np.ndarray, full: np.ndarray, mixed: np.ndarray,
                       chunk: int = 32) -> np.ndarray:
    """``S[i, p−1] = Σ_{k ≥ p} b / (B·T_D,k^iter(b))`` with ``b = min(B[i, p−1], cap[i, k])``
    for the ``wanted`` candidates (others: 0); ``f`` is φ(B), ``full`` is ``cap/T(cap)``,
    ``mixed`` marks the (slice, candidate) pairs where the cap binds on some of the decode
    nodes but not all. Times ``B/n_iter`` it is the candidate's decode side.

    Computed ``chunk`` candidates at a time for all slices, so the working set (m × chunk × N)
    stays in cache: ``T = [1, φ, B] @ [d0; d1; d2]`` is one matrix product per chunk, and
    within a chunk the nodes a candidate does not decode on are set to ``T = inf`` so they add
    0. A node whose cap binds runs its cap whatever B is, so its term ``cap/(B·T(cap))`` comes
    from one m × N matrix, and only chunks with ``mixed`` pairs pay for the substitution.
    Terms in float32 (half the memory traffic; relative error ~1e-7, far below what the
    2σ/√m test resolves), sums accumulated in float64.
    """
    m, c = B.shape
    d = np.stack([nodes.d0, nodes.d1, nodes.d2]).astype(np.float32)
    x = np.stack([np.ones_like(B), f, B], axis=-1).astype(np.float32)
    out = np.zeros((m, c))
    not_decoding = np.tril(np.full((chunk, chunk), np.inf, np.float32), -1)
    decoding = np.triu(np.ones((chunk, chunk), bool))
    for j0 in range(0, c, chunk):
        j1 = min(j0 + chunk, c)
        if not wanted[j0:j1].any():
            continue
        r, p0 = j1 - j0, j0 + 1
        t = np.matmul(x[:, j0:j1], d[:, p0:])
        t[:, :, :r] += not_decoding[:r, :r]
        np.reciprocal(t, out=t)
        if mixed[:, j0:j1].any():
            b = B[:, j0:j1]
            capped = b[:, :, None] > cap[:, None, p0:]
            capped[:, :, :r] &= decoding[:r, :r]
            np.copyto(t, full[:, None, p0:] / b[:, :, None], where=capped, casting="unsafe")
        t.sum(axis=-1, dtype=np.float64, out=out[:, j0:j1])
    return out


def _order(nodes: _Arrays, names: Sequence[NodeId], split: Split,
           w: dict[str, np.ndarray]) -> np.ndarray:
    """π (module docstring): indices into ``names``."""
    weight = w["requests"] / w["requests"].sum()
    t_uc, A, t_c, n_iter = (weight @ w[k] for k in ("t_uc", "A", "t_c", "n_iter"))  # noqa: N806
    B = w["n"].mean() / len(split.decode)  # noqa: N806
    # μ_P,n / μ_D,n up to the factor n_iter/B that every node shares.
    advantage = nodes.t_d_iter(B) / nodes.t_p_req(t_uc, A, t_c)
    rank = np.empty(len(names), dtype=np.intp)
    rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    in_prefill = set(split.prefill)
    prefill = np.fromiter((x in in_prefill for x in names), bool, len(names))
    # Prefill nodes leave from the end of their segment: least advantage, then larger name
    # last, so among equals the smaller name moves first as it does in the decode segment.
    p_order = np.flatnonzero(prefill)[np.lexsort((-rank[prefill], -advantage[prefill]))]
    d_order = np.flatnonzero(~prefill)[np.lexsort((rank[~prefill], -advantage[~prefill]))]
    return np.concatenate([p_order, d_order])


def _work(slices: Sequence[SliceWork]) -> dict[str, np.ndarray]:
    """The usable slices' work as columns: what Eq. 3-5 and the latency estimate take."""
    w = {k: np.array([getattr(s, k) for s in slices])
         for k in ("requests", "t_uc", "A", "t_c", "n", "length", "t_acc", "kv")}
    w["n_iter"] = np.array([s.t_out / s.t_acc for s in slices])
    return w


def _latency(ranked: _Arrays, w: dict[str, np.ndarray], sources: np.ndarray | None) -> Latency:
    """:func:`~evinfra.planner.latency.predict_e2e` of every candidate, ``ranked`` in the
    order π; a prefill iteration takes up to the candidate's prefill nodes' mean t̄ tokens,
    a decode node runs at most the mean over its candidate's decode nodes of what their GPU
    KV holds (``kv_tokens/kv̄``, as in :func:`_theta`; inf where a node reported none)."""
    mu_p = 1.0 / ranked.t_p_req(w["t_uc"], w["A"], w["t_c"])
    d = np.stack([ranked.d0, ranked.d1, ranked.d2])
    n = len(ranked.t_bar)
    t_bar = np.cumsum(ranked.t_bar)[:-1] / np.arange(1, n)
    cap = _over_decode(np.add, ranked.caps(w["kv"]))
    return predict_e2e(mu_p, d, w["requests"] / w["length"], w["n_iter"], w["t_acc"],
                       ranked.k_over_e, ranked.t_fwd, sources=sources,
                       batch=t_bar[None, :] / w["t_uc"][:, None],
                       cap=cap / (n - np.arange(1, n)))


def _sources(slices: Sequence[SliceWork], sources: Sequence[float] | None) -> np.ndarray | None:
    """The active sources of the usable slices (None: an infinite source)."""
    if sources is None:
        return None
    if len(sources) != len(slices):
        raise ValueError(f"{len(sources)} source counts for {len(slices)} slices")
    return np.array([n for s, n in zip(slices, sources) if s.usable], dtype=float)


def predict(models: Sequence[NodeModel], split: Split, slices: Sequence[SliceWork],
            sources: Sequence[float] | None = None) -> tuple[list[NodeId], Latency]:
    """What the latency rule predicts for every candidate on a window's usable ``slices``
    (rows), with ``models`` and ``sources`` as :func:`plan` takes them: π, and the estimate
    (column ``p − 1`` prefills on ``π[:p]``; column ``|P| − 1`` is ``split`` itself). For
    judging the estimate against measured runs (``evinfra.experiments.latency``)."""
    used = [s for s in slices if s.usable]
    if not used:
        raise ValueError("no usable slice: no finished request and decode iteration")
    names = [x.node for x in models]
    w = _work(used)
    nodes = _Arrays.of(models)
    order = _order(nodes, names, split, w)
    return [names[i] for i in order], _latency(nodes.take(order), w, _sources(slices, sources))


def plan(models: Sequence[NodeModel], split: Split, slices: Sequence[SliceWork], *,
         at: float, objective: Literal["throughput", "latency"] = "throughput",
         latency_min_gain: float = 0.05, ttft_target: float | None = None,
         tpot_target: float | None = None, sources: Sequence[float] | None = None,
         recent: Sequence[SliceWork] = (), recent_sources: Sequence[float] | None = None
         ) -> Decision:
    """Algorithm E.3 lines 17-28 for one window: evaluate every prefill count, pick or keep.

    ``models`` are usable models of every node of ``split`` (their t̄_n, f_n remeasured);
    ``slices`` are the window's. Slices without finished requests have no w̄ and are left
    out; m in ``2σ/√m`` counts the slices used. σ is the sample standard deviation. With
    ``objective = "latency"`` a window the throughput rule leaves alone is judged on
    predicted mean E2E, and on the optional TTFT/TPOT targets (:class:`PlannerConfig`);
    ``sources`` are the active sources of each of ``slices`` that the estimate's prefill
    queue holds at most (:class:`~evinfra.planner.latency.Sources`; None: an infinite source);
    ``recent`` and ``recent_sources`` are the previous window's, for the latency rule's
    hysteresis (:func:`_behind`).
    """
    used = [s for s in slices if s.usable]
    if len(used) < 2:
        return Decision(at=at, split=split, slices=list(slices), reason=(
            f"keep {split.label}: only {len(used)} of {len(slices)} slices had finished "
            "requests and decode iterations, the 2σ/√m test needs 2"))
    names = [x.node for x in models]
    if sorted(names) != sorted(split.prefill + split.decode):
        raise ValueError(f"models of {sorted(names)} do not match the split {split}")
    if len(names) == 2:
        return Decision(at=at, split=split, slices=list(slices),
                        reason="keep 1P1D: the only split with a node in each phase")
    w = _work(used)
    nodes = _Arrays.of(models)
    order = _order(nodes, names, split, w)
    theta = _theta(nodes.take(order), w)
    m, current = len(used), len(split.prefill)
    gains = theta - theta[:, [current - 1]]
    mean = gains.mean(axis=0)
    sigma = gains.std(axis=0, ddof=1)
    threshold = 2 * sigma / math.sqrt(m)
    qualified = mean > threshold
    qualified[current - 1] = False
    ordered = [names[i] for i in order]
    lat = headroom = None
    set_aside = ""
    if objective == "latency":
        ranked = nodes.take(order)

        lat = _latency(ranked, w, _sources(slices, sources))
        e2e = lat.e2e
        meets = None
        if ttft_target is not None or tpot_target is not None:
            meets = ((lat.ttft <= (np.inf if ttft_target is None else ttft_target))
                     & (lat.tpot <= (np.inf if tpot_target is None else tpot_target))).all(axis=0)
        # Below capacity Θ of Eq. 5 is no capacity (with nothing queued for prefill its
        # decode side is about the rate served): what counts is keeping up with the margin
        # more load.
        headroom = (lat.capacity >= 1.0 + latency_min_gain).all(axis=0)
        if headroom[current - 1]:
            # The current split keeps up: a Θ "gain" that costs predicted latency is that
            # artefact, and taking it would undo the latency rule's last switch.
            slower = ~(e2e.mean(axis=0) <= (1 + latency_min_gain) * e2e[:, current - 1].mean())
            dropped = qualified & slower
            if dropped.any():
                qualified &= ~slower
                set_aside = (f"; set aside, predicted slower while {split.label} keeps up: "
                             + ", ".join(f"{j + 1}P" for j in np.flatnonzero(dropped)))
        # Hysteresis: while the current split kept up with the previous window's load, a
        # split that would not is no place to go (load that alternates between windows would
        # otherwise move the split back and forth, each move one window late).
        behind = _behind(ranked, recent, recent_sources, current, latency_min_gain)
        dropped = qualified & behind
        if dropped.any():
            qualified &= ~behind
            set_aside += ("; set aside, predicted not to keep up with the previous window's "
                          "load: " + ", ".join(f"{j + 1}P" for j in np.flatnonzero(dropped)))
        headroom &= ~behind
    candidates = [
        Candidate(prefill=j + 1, moved=abs(j + 1 - current), gains=g, mean=mu, sigma=s,
                  threshold=th, qualified=ok)
        for j, (g, mu, s, th, ok) in enumerate(zip(gains.T.tolist(), mean.tolist(),
                                                   sigma.tolist(), threshold.tolist(),
                                                   qualified.tolist()))
        if j + 1 != current]
    chosen = None
    rule: Literal["throughput", "latency", "none"] = "none"
    e2e_now: list[float] = []
    if qualified.any():
        best = int(np.argmax(np.where(qualified, mean, -np.inf)))
        chosen = Split.of(names, ordered[:best + 1])
        rule = "throughput"
        reason = (f"switch {split.label} -> {chosen.label}: largest mean gain "
                  f"{mean[best]:.4g} req/s > 2σ/√m = {threshold[best]:.4g} "
                  f"({int(qualified.sum())} of {len(candidates)} candidates qualify, m = {m})"
                  f"{set_aside}")
    else:
        best = int(np.argmax(np.where(np.arange(len(mean)) == current - 1, -np.inf, mean)))
        why = (f"no candidate's mean gain exceeds 2σ/√m (best {best + 1}P: {mean[best]:.4g} "
               f"req/s vs {threshold[best]:.4g}, m = {m})" if not set_aside else
               f"no throughput gain qualifies (best {best + 1}P: {mean[best]:.4g} req/s vs "
               f"{threshold[best]:.4g}, m = {m}){set_aside}")
        reason = f"keep {split.label}: {why}"
        if lat is not None and headroom is not None:
            # Where Θ predicts a significant loss, the models disagree and the split holds
            # (PlannerConfig.objective says why).
            theta_now = float(theta[:, current - 1].mean())
            serves_less = (mean < -threshold) & (-mean > latency_min_gain * theta_now)
            candidates, chosen, latency_why = _by_latency(
                candidates, lat, current, headroom, latency_min_gain, names, ordered, split,
                theta_now, meets, serves_less)
            e2e_now = lat.e2e[:, current - 1].tolist()
            if chosen is None:
                reason += f"; {latency_why}"
            else:
                rule = "latency"
                reason = (f"switch {split.label} -> {chosen.label} by the latency rule, as {why}: "
                          f"{latency_why}")
    return Decision(at=at, split=split, slices=list(slices), order=ordered,
                    theta=theta[:, current - 1].tolist(), candidates=candidates,
                    chosen=chosen, reason=reason, rule=rule, e2e=e2e_now)


def _behind(ranked: _Arrays, recent: Sequence[SliceWork], sources: Sequence[float] | None,
            current: int, min_gain: float) -> np.ndarray:
    """The candidates predicted not to keep up with the margin more load in every slice of
    the previous window ``recent``, if the current split did (else none: nothing to hold)."""
    used = [s for s in recent if s.usable]
    if not used:
        return np.zeros(len(ranked.t_bar) - 1, dtype=bool)
    lat = _latency(ranked, _work(used), _sources(recent, sources))
    kept = (lat.capacity >= 1.0 + min_gain).all(axis=0)
    return ~kept if kept[current - 1] else np.zeros_like(kept)


def _by_latency(candidates: list[Candidate], lat: Latency, current: int,
                headroom: np.ndarray, min_gain: float, names: list[NodeId],
                ordered: list[NodeId], split: Split, theta_now: float,
                meets: np.ndarray | None = None, serves_less: np.ndarray | None = None
                ) -> tuple[list[Candidate], Split | None, str]:
    """The latency rule of :class:`PlannerConfig` on the estimate ``lat`` (slices ×
    candidates): the candidates with their latency figures, the choice, and why.
    ``theta_now``: the current split's mean Θ. ``headroom[p − 1]``: the candidate keeps up
    with every slice's rate plus the margin, so a switch for latency never trades away the
    throughput served. ``meets[p − 1]``: the candidate meets the TTFT/TPOT targets (None: no
    targets). ``serves_less[p − 1]``: Θ predicts the candidate serves significantly less; a
    latency gain does not take it (None: none does)."""
    e2e = lat.e2e
    m = e2e.shape[0]
    now = e2e[:, current - 1]
    if (1.0 / lat.capacity[:, current - 1]).mean() >= 1.0:
        return _to_stable(candidates, lat, current, headroom, min_gain, names, ordered, split,
                          theta_now)
    if not np.isfinite(now).all():
        return candidates, None, (
            f"the latency rule keeps it: {split.label} is predicted over its capacity in "
            f"{int((lat.capacity[:, current - 1] <= 1.0).sum())} of {m} slices but to keep up "
            "over the window (a burst)")
    gains = now[:, None] - e2e
    finite = np.isfinite(e2e).all(axis=0)
    with np.errstate(invalid="ignore"):
        g_mean = np.where(finite, gains.mean(axis=0), -np.inf)
        g_threshold = np.where(finite, 2 * gains.std(axis=0, ddof=1) / math.sqrt(m), np.inf)
    floor = min_gain * float(now.mean())
    ok = finite & (g_mean > g_threshold) & (g_mean > floor) & headroom
    ok[current - 1] = False
    aside = ""  # why qualified candidates were set aside
    if serves_less is not None and (ok & serves_less).any():
        aside = ("; set aside, Eq. 5 predicts they serve less: "
                 + ", ".join(f"{j + 1}P" for j in np.flatnonzero(ok & serves_less)))
        ok &= ~serves_less
    if meets is not None and (meets[current - 1] or (ok & meets).any()):
        missed = ok & ~meets
        ok &= meets
        if missed.any():
            aside += ("; set aside, predicted to miss the TTFT/TPOT targets"
                      + (f" {split.label} meets" if meets[current - 1] else "") + ": "
                      + ", ".join(f"{j + 1}P" for j in np.flatnonzero(missed)))
    out = [msgspec.structs.replace(c, e2e=e2e[:, c.prefill - 1].tolist(),
                                   e2e_gain=float(g_mean[c.prefill - 1]),
                                   e2e_threshold=float(g_threshold[c.prefill - 1]),
                                   e2e_qualified=bool(ok[c.prefill - 1])) for c in candidates]
    best = int(np.argmax(np.where(np.arange(len(g_mean)) == current - 1, -np.inf, g_mean)))
    figures = (f"predicted mean E2E {now.mean():.4g} s -> {e2e[:, best].mean():.4g} s at "
               f"{best + 1}P, gain {g_mean[best]:.4g} s vs 2σ/√m = {g_threshold[best]:.4g} s "
               f"and {100 * min_gain:g} % = {floor:.4g} s")
    if not ok.any():
        return out, None, f"no latency gain qualifies ({figures}){aside}"
    best = int(np.argmax(np.where(ok, g_mean, -np.inf)))
    figures = (f"predicted mean E2E {now.mean():.4g} s -> {e2e[:, best].mean():.4g} s, gain "
               f"{g_mean[best]:.4g} s > 2σ/√m = {g_threshold[best]:.4g} s and > "
               f"{100 * min_gain:g} % = {floor:.4g} s, keeping up with {100 * min_gain:g} % "
               f"more load in every slice{aside}")
    return out, Split.of(names, ordered[:best + 1]), figures


def _to_stable(candidates: list[Candidate], lat: Latency, current: int, headroom: np.ndarray,
               min_gain: float, names: list[NodeId], ordered: list[NodeId], split: Split,
               theta_now: float) -> tuple[list[Candidate], Split | None, str]:
    """The latency rule when ``split`` is predicted not to keep up over the window (its mean
    load over the slices, ``mean_i λ_i/capacity_i``, is at least 1: the backlog grows) and the
    throughput rule's noise test did not fire: queues grow, so no significance test waits for
    them. The nearest candidate (ties: the lower predicted mean E2E) predicted to keep up with
    the margin more load in every slice, else over the window. When none is, the load is
    more than any split serves, and Θ (Eq. 5), the throughput rule's measure, judges: the
    candidate with the largest mean gain, if that is the margin of the current split's mean
    Θ ``theta_now`` (so the throughput rule does not undo it)."""
    e2e = lat.e2e
    load = (1.0 / lat.capacity).mean(axis=0)
    mean = np.where(np.isfinite(e2e).all(axis=0), e2e.mean(axis=0), np.inf)
    distance = np.abs(np.arange(1, e2e.shape[1] + 1) - current)
    over = int((lat.capacity[:, current - 1] <= 1.0).sum())
    state = (f"{split.label} is predicted not to keep up: its mean load is "
             f"{load[current - 1]:.3g}x its capacity, over it in {over} of {e2e.shape[0]} "
             "slices")
    margin = 1.0 + min_gain
    over_window = load * margin < 1.0
    if headroom.any():
        pool, what = headroom, (f"the nearest split predicted to keep up with "
                                f"{100 * min_gain:g} % more load in every slice")
    elif over_window.any():
        pool, what = over_window, (f"the nearest split predicted to keep up with "
                                   f"{100 * min_gain:g} % more load over the window")
    else:
        top = max(candidates, key=lambda c: c.mean)
        if not top.mean > min_gain * theta_now:
            return candidates, None, (
                f"the latency rule keeps it: {state}; no split is predicted to keep up, and "
                f"none serves {100 * min_gain:g} % more by Eq. 5 (best {top.prefill}P: mean "
                f"gain {top.mean:.4g} req/s of {theta_now:.4g})")
        pool = np.arange(len(load)) == top.prefill - 1
        what = (f"the split that serves the most by Eq. 5, as none is predicted to keep up "
                f"(mean gain {top.mean:.4g} req/s of {theta_now:.4g})")
    # The current split is in no pool: its mean load is at least 1, and top is a candidate.
    best = min(np.flatnonzero(pool), key=lambda j: (distance[j], mean[j]))
    out = [msgspec.structs.replace(c, e2e=e2e[:, c.prefill - 1].tolist(),
                                   e2e_qualified=bool(c.prefill - 1 == best))
           for c in candidates]
    chosen = Split.of(names, ordered[:best + 1])
    figures = (f"{state}; {chosen.label} is {what}: mean load {load[best]:.3g}x, worst slice "
               f"{1.0 / lat.capacity[:, best].min():.3g}x, predicted mean E2E "
               f"{_seconds(mean[current - 1])} -> {_seconds(mean[best])}")
    return out, chosen, figures


def _seconds(x: float) -> str:
    return f"{x:.4g} s" if math.isfinite(x) else "unbounded"


# -- the service's interface -----------------------------------------------------------------


class SplitPlanner(Protocol):
    """What the service needs of a phase-split planner: evinfra's :class:`Planner` or a
    baseline's (``evinfra.baselines``). The service feeds it observations, ticks it at
    :attr:`window_end` while :attr:`adapts` (or while warming up), applies the split a
    :class:`Decision` chooses, and reports each switched node with :meth:`drained`.

    A planner without a warm-up has ``warmup_end`` at its start: the service's first tick
    ends the "warm-up" at once and applies the initial split (``finish_warmup`` fits
    nothing and returns no reports)."""

    split: Split
    models: dict[NodeId, NodeModel]
    """Fitted Eq. 1-2 models by node (the router predicts TTFT with them); may be empty."""
    fits: dict[NodeId, FitReport]
    warmup_end: float

    @property
    def warming_up(self) -> bool: ...

    @property
    def window_end(self) -> float:
        """When the service ticks :meth:`decide` next."""

    @property
    def adapts(self) -> bool:
        """Whether :meth:`decide` is ticked after the warm-up at all."""

    def observe_iteration(self, report: IterationReport) -> None: ...

    def observe_request(self, now: float, t_uc: float, t_c: float, t_out: float) -> None: ...

    def observe_population(self, now: float, q: float, n: float) -> None:
        """Cluster-wide, ``q`` requests are in decode and ``n`` in flight (``q`` among them)."""

    def observe_state(self, state: NodeState) -> None: ...

    def observe_arrival(self, branch: BranchId, now: float) -> None:
        """A request of ``branch`` was accepted at ``now`` (it ends with :meth:`observe_done`)."""

    def observe_done(self, record: RequestDone) -> None: ...

    def observe_loads(self, now: float, loads: "list[NodeLoad]") -> None:
        """The router's view of every node's load, right before each :meth:`decide`."""

    def drained(self, node: NodeId, now: float) -> None: ...

    def finish_warmup(self, now: float) -> list[FitReport]: ...

    def decide(self, now: float) -> Decision | None:
        """A decision to publish (and apply, if it chooses a split), or None for a tick
        with nothing to say. A decision that chooses a split has switched to it: ``split``
        is the chosen one and its moving nodes are ``draining`` (the service applies it to
        the engines and reports each node's end with :meth:`drained`)."""

    def switch_to(self, split: Split, now: float) -> None: ...


# -- the state around it ---------------------------------------------------------------------


class Planner:
    """The phase-split planner of one cluster (Algorithm E.3 outer loop).

    Life cycle: construct at the start of serving (every node collocated) and feed it
    ``observe_*``; once :meth:`ready`, call :meth:`finish_warmup`, which fits and freezes the
    models and starts PD disaggregation from the initial split; then call :meth:`decide` at
    every :attr:`window_end` and apply a chosen split; report each switched node's end of
    draining with :meth:`drained`. Observations made outside the current window (during the
    hold-off, or late) do not count toward it.
    """

    def __init__(self, config: PlannerConfig, nodes: Sequence[NodeId],
                 prefill: Iterable[NodeId], *, start: float) -> None:
        names = list(nodes)
        prefill = set(prefill)
        if len(set(names)) != len(names) or not prefill <= set(names):
            raise ConfigError(f"initial prefill nodes {sorted(prefill)} must be among the "
                              f"distinct nodes {names}", key="prefill")
        if not 0 < len(prefill) < len(names):
            raise ConfigError("the initial split needs at least one prefill and one decode "
                              "node", key="prefill")
        self.config = config
        self.nodes = names
        self.split = Split.of(names, prefill)
        self.warmup_end = start + config.t_learn
        self.models: dict[NodeId, NodeModel] = {}
        self.fits: dict[NodeId, FitReport] = {}
        """The latest fit of every node (the warmup's, or a refit of an unusable one)."""
        self.draining: set[NodeId] = set()
        self._fitters = {n: NodeFitter(n, config.k_over_e, config.t_fwd) for n in names}
        self._window: Window | None = None
        self._sources: Sources | None = None
        self._recent: tuple[list[SliceWork], list[float] | None] = ([], None)
        self.sources: list[float] | None = None
        """The active sources of each slice of the window last closed (the latency rule's
        finite source, :class:`~evinfra.planner.latency.Sources`; None: none seen)."""
        self._in_flight: dict[BranchId, tuple[int, float]] = {}
        """Branches with requests in flight: how many, and the earliest arrival among them
        (a later one's, once the earliest ended, only while another was in flight)."""
        self._last_switch = -math.inf
        self._population = (0.0, 0.0)  # (q, n): requests in decode, in flight
        self._kv = dict.fromkeys(names, 0)  # GPU KV capacity each node last reported
        self._out: list[NodeId] = []  # nodes out of service (down or cordoned), by name

    # -- observations ----------------------------------------------------------------------

    def observe_iteration(self, report: IterationReport) -> None:
        """An engine's forward pass: fitting data during warmup (and for nodes whose fit was
        unusable), t̄_n, f_n and t_acc after it."""
        if report.node not in self.fits and report.node not in self._fitters:
            log.warning("planner_unknown_node", node=report.node)
            return
        if report.node in self._fitters:
            self._fitters[report.node].add(report)
        if self._window is None:
            return
        if report.prefill:
            self._window.add_prefill(report.start, report.node, report.prefill)
        elif report.batch:
            self._window.add_decode(report.start, report.batch, report.accepted, report.count)

    def observe_request(self, now: float, t_uc: float, t_c: float, t_out: float) -> None:
        """A request finished with this work (its t_acc comes from the decode iterations)."""
        if self._window is not None:
            self._window.add_request(now, t_uc, t_c, t_out)

    def observe_population(self, now: float, q: float, n: float) -> None:
        """Cluster-wide, ``q`` requests are in decode and ``n`` in flight (``q`` among them)."""
        self._population = (q, n)
        if self._window is not None:
            self._window.set_population(now, q, n)

    def observe_state(self, state: NodeState) -> None:
        """A node report: its GPU KV capacity, which bounds Θ's decode batch on the node (the
        window measures work from requests and iterations, not from reports)."""
        if state.l1_capacity > 0 and state.node in self._kv:
            self._kv[state.node] = state.l1_capacity

    def observe_arrival(self, branch: BranchId, now: float) -> None:
        """A request of ``branch`` was accepted: the branch is an active source while it is
        in flight, also past the end of the window it arrived in."""
        n, first = self._in_flight.get(branch, (0, now))
        self._in_flight[branch] = (n + 1, min(first, now))

    def observe_done(self, record: RequestDone) -> None:
        """A request is over: its branch is an active source of the window (its work arrives
        through :meth:`observe_request`)."""
        if self._sources is not None:
            self._sources.add(record.branch, record.arrival, record.end)
        n, first = self._in_flight.pop(record.branch, (0, 0.0))
        if n > 1:
            self._in_flight[record.branch] = (n - 1, first)

    def observe_loads(self, now: float, loads: "list[NodeLoad]") -> None:
        """Which nodes serve (not down, not cordoned): the next decision plans over those.
        Queue depths are what Eq. 6's test is built to look past (5.2): unused."""
        self._out = sorted(x.node for x in loads if not x.serving)

    def drained(self, node: NodeId, now: float) -> None:
        """``node`` finished the requests it ran before its switch and now serves its new phase."""
        self.draining.discard(node)
        log.info("planner_drained", node=node, at=now, still_draining=sorted(self.draining))

    # -- warmup ----------------------------------------------------------------------------

    @property
    def warming_up(self) -> bool:
        return not self.models

    @property
    def adapts(self) -> bool:
        return self.config.adapt

    def ready(self, now: float) -> bool:
        """The warmup T_learn is over and :meth:`finish_warmup` is due."""
        return self.warming_up and now >= self.warmup_end

    def finish_warmup(self, now: float) -> list[FitReport]:
        """Algorithm E.3 line 1: fit every node's models, freeze them, start the first window.

        A node whose records could not identify its models gets stand-ins (a reduced fit, or
        a phase pooled from its peers: :func:`~evinfra.planner.itermodel.pool`), keeps
        collecting records in the phase it serves, and is refitted at every window end until
        its own fit is complete; each decision names the stand-ins it used. Only a phase that
        no node identified keeps the split (the reason says which node lacks what).
        """
        if not self.warming_up:
            raise RuntimeError("finish_warmup was already called")
        reports = [fitter.fit() for fitter in self._fitters.values()]
        self.fits = {r.node: r for r in reports}
        self.models = {m.node: m for m in pool([r.model for r in reports])}
        self._fitters = {r.node: self._fitters[r.node] for r in reports if not _complete(r)}
        for r in reports:
            _log_fit(r)
        self._open(now)
        return reports

    # -- decisions -------------------------------------------------------------------------

    @property
    def window_end(self) -> float:
        """When :meth:`decide` is next due (the warmup end while warming up)."""
        return self.warmup_end if self._window is None else self._window.end

    def decide(self, now: float) -> Decision:
        """Algorithm E.3 lines 15-29 at the end of a window. A chosen split becomes
        :attr:`split` at once; its moved nodes are :attr:`draining` until :meth:`drained`."""
        if self._window is None:
            return Decision(at=now, split=self.split, reason=(
                f"warming up (collocated) until {self.warmup_end:g} s, then finish_warmup"))
        if now < self._window.end:
            hold = self._last_switch + self.config.hold_off
            why = (f"hold-off after the switch at {self._last_switch:g} s until {hold:g} s"
                   if now < hold else f"window ends at {self._window.end:g} s")
            return Decision(at=now, split=self.split, reason=f"keep {self.split.label}: {why}")
        slices = self._close()
        recent, self._recent = self._recent, (slices, self.sources)
        blocked = self._blocked()
        if blocked:
            decision = Decision(at=now, split=self.split, slices=slices,
                                reason=f"keep {self.split.label}: {blocked}")
        else:
            decision = self._plan(slices, now, recent)
            stand_ins = self._stand_ins()
            if stand_ins:
                decision = msgspec.structs.replace(
                    decision, reason=f"{decision.reason}; stand-in models: {stand_ins}")
        if self.config.objective == "latency":
            decision = msgspec.structs.replace(decision, sources=self.sources)
        # The whole decision (slices, per-slice gains) is served by the status API; the log
        # line carries what a reader scans for.
        log.info("planner_decision", at=now, split=decision.split.label,
                 chosen=decision.chosen.label if decision.chosen else None,
                 reason=decision.reason,
                 candidates=[(c.prefill, round(c.mean, 4), round(c.threshold, 4), c.qualified)
                             for c in decision.candidates])
        if decision.chosen is not None:
            self.switch_to(decision.chosen, now)
        else:
            self._open(now)
        return decision

    def review(self, now: float) -> list[SliceWork]:
        """What :meth:`decide` would see at the end of the window, without deciding: its
        slices, and :attr:`models` remeasured on it; the next window starts at ``now``. For
        a fixed split (``adapt = False``), whose windows are otherwise never closed: the
        latency estimate judged against the measured run (``evinfra.experiments.latency``)."""
        if self._window is None or now < self._window.end:
            raise RuntimeError(f"no window has ended at {now:g} s")
        slices = self._close()
        self._open(now)
        return slices

    def _open(self, start: float) -> None:
        self._window = Window(start, self.config.t_win, self.config.m, *self._population)
        self._sources = Sources(start, self._window.end, self.config.m)

    def _close(self) -> list[SliceWork]:
        assert self._window is not None and self._sources is not None
        slices = self._window.close()
        self.sources = self._sources.per_slice(
            {b: first for b, (_, first) in self._in_flight.items()})
        self._remeasure(self._window)
        return slices

    def switch_to(self, split: Split, now: float) -> None:
        """``split`` is applied from ``now`` (chosen here, or forced by an operator): its moved
        nodes drain, and the next window starts after the hold-off."""
        if sorted(split.prefill + split.decode) != sorted(self.nodes):
            raise ValueError(f"{split} is not a split of {sorted(self.nodes)}")
        self.draining = set(split.prefill) ^ set(self.split.prefill)
        self.split = split
        self._last_switch = now
        if self._window is not None:
            self._open(now + self.config.hold_off)

    def _remeasure(self, window: Window) -> None:
        """E.3 line 15: new t̄_n, f_n for every model; refit the nodes whose own fit is not
        complete, and pool what they still lack."""
        for node, fitter in list(self._fitters.items()):
            report = fitter.fit()
            self.fits[node] = report
            self.models[node] = report.model
            if _complete(report):
                del self._fitters[node]
                _log_fit(report)
        if self._fitters:
            self.models = {m.node: m for m in pool(list(self.models.values()))}
        measured = window.remeasure({n: (x.t_bar, x.f) for n, x in self.models.items()})
        self.models = {n: x.remeasured(*measured[n], self._kv[n]) for n, x in self.models.items()}

    def _plan(self, slices: list[SliceWork], now: float,
              recent: tuple[list[SliceWork], list[float] | None]) -> Decision:
        """E.3 lines 17-28 over the nodes that serve: a node out of service (down, cordoned)
        gives the cluster no capacity, so the candidates split the others, and it keeps its
        phase for when it is back."""
        rule = {"objective": self.config.objective,
                "latency_min_gain": self.config.latency_min_gain,
                "ttft_target": self.config.ttft_target_s,
                "tpot_target": self.config.tpot_target_s, "sources": self.sources,
                "recent": recent[0], "recent_sources": recent[1]}
        if not self._out:
            return plan([self.models[n] for n in self.nodes], self.split, slices, at=now,
                        **rule)
        out = set(self._out)
        live = [n for n in self.nodes if n not in out]
        sub = Split.of(live, [n for n in self.split.prefill if n not in out])
        note = f"{', '.join(self._out)} out of service, kept as they are"
        if not sub.prefill or not sub.decode:
            return Decision(at=now, split=self.split, slices=slices, reason=(
                f"keep {self.split.label}: {note}, and no phase may be left without a node"))
        d = plan([self.models[n] for n in live], sub, slices, at=now, **rule)
        chosen = None if d.chosen is None else Split.of(
            self.nodes, list(d.chosen.prefill) + [n for n in self.split.prefill if n in out])
        return msgspec.structs.replace(d, split=self.split, chosen=chosen,
                                       reason=f"{d.reason} (over {sub.label}: {note})")

    def _blocked(self) -> str | None:
        if self.draining:
            return (f"{', '.join(sorted(self.draining))} still draining from the switch at "
                    f"{self._last_switch:g} s")
        unusable = [n for n, x in self.models.items() if not (x.prefill_ok and x.decode_ok)]
        if unusable:
            return "no usable model, from its own records or its peers', for " + "; ".join(
                f"{n}: {'; '.join(self.fits[n].problems)}" for n in unusable)
        return None

    def _stand_ins(self) -> str:
        """The coefficients this decision took from stand-ins rather than a node's own fit."""
        parts = []
        for n, m in sorted(self.models.items()):
            what = ([f"{', '.join(m.reduced)} fixed at 0 (reduced fit)"] if m.reduced else []) + (
                [f"{', '.join(m.pooled)} pooled from peers"] if m.pooled else [])
            if what:
                parts.append(f"{n}: {' and '.join(what)}")
        return "; ".join(parts)


def _complete(r: FitReport) -> bool:
    """The node's own records identified its models without a reduced fit: frozen."""
    return r.usable and not r.model.reduced


def _log_fit(r: FitReport) -> None:
    """One line per node: the coefficients of a usable fit, or why a fit is not usable (the
    whole report is served by the status API)."""
    if r.usable:
        m = r.model
        log.info("planner_fit", node=r.node, c=[m.c0, m.c1, m.c2, m.c3], d=[m.d0, m.d1, m.d2],
                 prefill_error=r.prefill_error, decode_error=r.decode_error,
                 records=[r.prefill_records, r.decode_records])
    else:
        log.warning("planner_fit_unusable", node=r.node, problems=r.problems)
