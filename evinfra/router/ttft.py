"""Predicted TTFT of a request on each prefill node (paper 5.3, Eq. 7; Algorithm E.3 5-11).

For node ``n`` with queue ``Q_n`` (requests sent to ``n`` whose prefill has not finished)::

    Ŵ_n = T_rem,n + Σ_{j∈Q_n} T_P^req(w_j)                       wait before r starts
    T̂_n = Ŵ_n + T_P^req(w_n) + max(0, τ(x_n) − Ŵ_n) + κ·x_n      E.3 line 9

The paper's implementation evaluates the sums "by replaying the chunked prefill iterations of
n in arrival order, which also accounts for requests that share an iteration". This module
gives the replay's result without replaying: with a chunk budget ``B``, the queue is one
stream of uncached tokens cut every ``B`` tokens, and Eq. 1 is additive over the pieces
(a chunk's query-key pairs use the context before it, so a request's pieces sum to its
``A``). The iterations up to the one that finishes ``r`` thus take

    c0·⌈(U + u_r)/B⌉ + c1·(U + u_r) + c2·(ΣA + A_r) + c3·(Σt_rst + t_rst,r)

with ``U`` the queued uncached tokens, and ``r`` starts after the ``⌊U/B⌋`` iterations that
hold only earlier tokens, whose pieces :class:`PrefillQueue` sums with Fenwick trees. Every
prediction is O(log |Q|), every queue update O(log |Q|): no per-request work grows with the
queue (issue 4). ``tests/router/test_ttft.py`` checks the result against a literal replay.
"""

from __future__ import annotations

import msgspec

from evinfra.core.types import NonNegFloat, NonNegInt, PosFloat, PosInt, RequestId

__all__ = ["FetchTime", "PrefillQueue", "Prediction", "TTFTConfig", "estimate", "predict"]


class TTFTConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Parameters of the TTFT prediction (paper E.3 "Parameters of our runs")."""

    chunk_tokens: PosInt = 8192
    """Chunked-prefill budget per iteration (E.3: 8,192 tokens)."""
    fetch_base_s: NonNegFloat = 0.45
    """τ(x) = 0.45 s + 1 µs·x (E.3): the prior of :class:`FetchTime`'s online fit."""
    fetch_s_per_token: NonNegFloat = 1e-6
    fetch_min_tokens: NonNegInt = 512
    """No fetch below 512 tokens (E.3): such prefixes are recomputed."""
    kappa: NonNegFloat = 1e-6
    """Copy price κ, seconds of predicted TTFT per fetched token. The paper gives no value.
    A fetch leaves a duplicate copy in the target's host memory that will displace other KV
    (or be fetched again); we price that as one more transfer of the same tokens through
    the pool: 54.6 KB/token at ~52 GB/s is 1.05 µs/token (paper D.6), so κ = 1 µs/token.
    A 100K-token prefix then moves only to save more than 0.1 s. An ablation knob."""
    state_max_age_s: PosFloat = 5.0
    """A node's reported state is used only if at most 5 s old (E.3)."""


class FetchTime:
    """τ(x), the time to fetch ``x`` tokens from peers' host memory: ``base + per_token·x``
    for ``x ≥ fetch_min_tokens``, else 0 (recomputed). E.3 gives 0.45 s + 1 µs·x; that line
    is only the prior here, and the fetches the engines report (``PrefillDone.fetch_s``)
    refit it after each one.

    The fit is least squares on relative residuals, ``(base + per_token·x)/y − 1`` (a
    fetch's time varies by a factor, from milliseconds to seconds, as the planner's Eq. 1-2
    rows do), with base and per_token non-negative. The prior enters as two such rows on
    E.3's line, at ``fetch_min_tokens`` and 64 times that, so a few reported fetches
    outweigh it and it keeps the fit defined before any.
    """

    __slots__ = ("min_tokens", "base", "per_token", "fetches", "_gram", "_moment")

    _KILO = 1e-3  # x in thousands of tokens keeps the 2x2 system well scaled

    def __init__(self, cfg: TTFTConfig) -> None:
        self.min_tokens = cfg.fetch_min_tokens
        self.base, self.per_token = cfg.fetch_base_s, cfg.fetch_s_per_token
        self.fetches = 0
        self._gram = [0.0, 0.0, 0.0]  # Σ 1/y², Σ x/y², Σ x²/y²
        self._moment = [0.0, 0.0]  # Σ 1/y, Σ x/y
        for x in (max(self.min_tokens, 1), 64 * max(self.min_tokens, 1)):
            y = self.base + self.per_token * x
            if y > 0:
                self._add(x, y)

    def __call__(self, x: float) -> float:
        if x < self.min_tokens or x <= 0:
            return 0.0
        return self.base + self.per_token * x

    def observe(self, tokens: int, seconds: float) -> None:
        """A fetch of ``tokens`` took ``seconds``; refit."""
        if tokens <= 0 or not seconds > 0:
            return
        self.fetches += 1
        self._add(tokens, seconds)
        g11, g1x, gxx = self._gram
        m1, mx = self._moment
        det = g11 * gxx - g1x * g1x
        a = (m1 * gxx - mx * g1x) / det if det > 0 else -1.0
        b = (g11 * mx - g1x * m1) / det if det > 0 else -1.0
        if a < 0 or b < 0:  # the best fit on a face of the non-negative quadrant
            a, b = (m1 / g11, 0.0) if m1 * m1 / g11 >= mx * mx / gxx else (0.0, mx / gxx)
        self.base, self.per_token = a, b * self._KILO

    def _add(self, x: float, y: float) -> None:
        k = x * self._KILO
        w = 1.0 / (y * y)
        self._gram[0] += w
        self._gram[1] += k * w
        self._gram[2] += k * k * w
        self._moment[0] += 1.0 / y
        self._moment[1] += k / y


class _Fenwick:
    __slots__ = ("tree",)

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, i: int, delta: int) -> None:
        tree, n = self.tree, len(self.tree)
        i += 1
        while i < n:
            tree[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of entries ``[0, i)``."""
        tree, s = self.tree, 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s


class PrefillQueue:
    """``Q_n`` in arrival order: the prefill work each request still has on the node.

    An entry is ``(u, t_c, t_rst)``: uncached tokens not yet launched, the context before
    them, and the host restores still to pay (charged with the request's first chunk).
    Positions only grow; removed entries become zeros; the arrays are compacted when most
    positions are dead, so the cost stays O(log |Q|) amortised.
    """

    def __init__(self) -> None:
        self._pos: dict[RequestId, int] = {}
        self._cap = 0
        self._next = 0
        self._reset(16)
        self.U = 0
        self.SA = 0
        self.SR = 0
        # Bumped by every change: the router's per-node row of Eq. 7 inputs is rebuilt then.
        self.version = 0
        # first(k) of the last call: between two changes of this queue, every route asks
        # the same k, so all nodes but the one that took the last request answer in O(1).
        self._first: tuple[int, int, int] | None = None

    def _reset(self, cap: int) -> None:
        self._cap = cap
        self._u = [0] * cap
        self._tc = [0] * cap
        self._r = [0] * cap
        self._fu, self._fa, self._fr = _Fenwick(cap), _Fenwick(cap), _Fenwick(cap)

    def __len__(self) -> int:
        return len(self._pos)

    def __contains__(self, request: RequestId) -> bool:
        return request in self._pos

    def requests(self) -> list[RequestId]:
        """Queued requests in arrival order."""
        return sorted(self._pos, key=self._pos.__getitem__)

    def entry(self, request: RequestId) -> tuple[int, int, int]:
        i = self._pos[request]
        return self._u[i], self._tc[i], self._r[i]

    def add(self, request: RequestId, u: int, t_c: int, t_rst: int) -> None:
        if self._next == self._cap:
            self._compact(max(16, 2 * len(self._pos) + 1))
        i = self._next
        self._next += 1
        self._pos[request] = i
        self._set(i, u, t_c, t_rst)

    def launched(self, request: RequestId, tokens: int) -> None:
        """A chunk of ``tokens`` of ``request`` started: it leaves the queued stream."""
        i = self._pos.get(request)
        if i is None:
            return
        u = max(0, self._u[i] - tokens)
        self._set(i, u, self._tc[i] + (self._u[i] - u), 0)

    def remove(self, request: RequestId) -> None:
        i = self._pos.pop(request, None)
        if i is None:
            return
        self._set(i, 0, 0, 0)
        if self._next > 64 and 4 * len(self._pos) < self._next:
            self._compact(self._cap)

    def _set(self, i: int, u: int, t_c: int, r: int) -> None:
        self._first = None
        self.version += 1
        a_old = self._a(self._u[i], self._tc[i])
        a_new = self._a(u, t_c)
        du, da, dr = u - self._u[i], a_new - a_old, r - self._r[i]
        self._u[i], self._tc[i], self._r[i] = u, t_c, r
        if du:
            self._fu.add(i, du)
            self.U += du
        if da:
            self._fa.add(i, da)
            self.SA += da
        if dr:
            self._fr.add(i, dr)
            self.SR += dr

    @staticmethod
    def _a(u: int, t_c: int) -> int:
        return u * t_c + u * (u + 1) // 2

    def _compact(self, cap: int) -> None:
        live = [(r, self._u[i], self._tc[i], self._r[i])
                for r, i in sorted(self._pos.items(), key=lambda kv: kv[1])]
        self._reset(max(cap, 2 * len(live) + 16))
        self._pos = {}
        self._next = 0
        self.U = self.SA = self.SR = 0
        for r, u, t_c, rst in live:
            i = self._next
            self._next += 1
            self._pos[r] = i
            self._set(i, u, t_c, rst)

    def first(self, k: int) -> tuple[int, int]:
        """``(ΣA, Σt_rst)`` of the first ``k`` tokens of the queued stream."""
        if k <= 0:
            return 0, 0
        if self._first is not None and self._first[0] == k:
            return self._first[1], self._first[2]
        # Binary lifting on the U tree: ``pos`` entries lie wholly before token k.
        tree, cap = self._fu.tree, self._cap
        pos, rem = 0, k
        step = 1 << (cap.bit_length() - 1)
        while step:
            nxt = pos + step
            if nxt <= cap and tree[nxt] <= rem:
                pos = nxt
                rem -= tree[nxt]
            step >>= 1
        A = self._fa.prefix(pos)
        R = self._fr.prefix(pos)
        if rem > 0 and pos < cap:
            # The request straddling token k contributes its first ``rem`` tokens.
            A += rem * self._tc[pos] + rem * (rem + 1) // 2
            R += self._r[pos]
        self._first = (k, A, R)
        return A, R


class Prediction(msgspec.Struct, frozen=True, gc=False):
    """The prediction for one node (E.3 lines 6-9), kept to explain routing decisions."""

    node: str
    t_hat: float
    w_hat: float
    t_uc: int
    t_c: int
    t_rst: int
    x: int
    own: int
    """Tokens of the prefix the node holds itself (the tie-break of E.3 line 11)."""


def estimate(queue: PrefillQueue, c: tuple[float, float, float, float], t_rem: float,
             t_uc: int, t_c: int, t_rst: int, x: int, cfg: TTFTConfig, tau: FetchTime
             ) -> tuple[float, float]:
    """``(T̂_n, Ŵ_n)`` for a request with ``t_uc`` uncached and ``t_c`` cached tokens,
    ``t_rst`` restored from host (own host hits plus fetched), ``x`` fetched from peers, on a
    node with coefficients ``c = (c0, c1, c2, c3)`` of Eq. 1 and queue ``queue``."""
    c0, c1, c2, c3 = c
    B = cfg.chunk_tokens
    U = queue.U
    k = U // B  # iterations holding only earlier tokens
    A_k, R_k = queue.first(k * B)
    w_hat = t_rem + c0 * k + c1 * k * B + c2 * A_k + c3 * R_k
    A = t_uc * t_c + t_uc * (t_uc + 1) // 2
    iters = -(-(U + t_uc) // B)
    done = t_rem + c0 * iters + c1 * (U + t_uc) + c2 * (queue.SA + A) + c3 * (queue.SR + t_rst)
    return done + max(0.0, tau(x) - w_hat) + cfg.kappa * x, w_hat


def predict(node: str, queue: PrefillQueue, c: tuple[float, float, float, float], t_rem: float,
            t_uc: int, t_c: int, t_rst: int, x: int, own: int, cfg: TTFTConfig,
            tau: FetchTime) -> Prediction:
    """:func:`estimate` as a :class:`Prediction` that explains itself."""
    t_hat, w_hat = estimate(queue, c, t_rem, t_uc, t_c, t_rst, x, cfg, tau)
    return Prediction(node, t_hat, w_hat, t_uc, t_c, t_rst, x, own)
