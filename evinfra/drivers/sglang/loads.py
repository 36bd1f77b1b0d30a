"""``GET /v1/loads`` parsed, and turned into the router's :class:`NodeState` and the planner's
:class:`IterationReport` (pure; the driver polls).

What SGLang 0.5.23 gives, and what it cannot:

* Node state: running and waiting requests, token usage, the PD queues
  (``disaggregation``: bootstrap / in-flight on a prefill engine, prealloc / transfer /
  retracted on a decode engine), ``max_total_num_tokens``. ``num_total_tokens`` counts used KV
  plus the KV that queued requests will need, so ``kv_room = max_total_num_tokens -
  num_total_tokens`` is free plus evictable KV (the radix cache's cached tokens are evictable).
  ``/v1/loads`` says nothing of the host tier (stock SGLang has none on CPU; the engine
  patch's is not in this answer), so ``l2_*`` stay 0. The snapshot's
  ``timestamp`` (engine wall clock) tells its age, which the router needs (it ignores state
  older than 5 s). What the engine does *not* report per iteration is which prefill chunks it
  launched, so ``launched`` stays empty: the router's queue books advance on ``PrefillDone``.
* Iteration reports: SGLang publishes per-iteration metrics only through its forward-pass
  metrics socket (``--enable-forward-pass-metrics``), timed with CUDA events, so not on CPU and
  not on stock GPU launches either. ``/v1/loads`` carries cumulative counters instead:
  ``decode_moments = [steps, Σ batch, Σ step µs, Σ batch², Σ batch·µs, Σ tokens]`` and
  ``total_prefill_busy_us`` / ``total_prefill_uncached_tokens``. Between two polls the decode
  moments give ``steps`` iterations of mean batch ``Σb/steps`` and mean time ``Σt/steps``: one
  :class:`IterationReport` with ``count = steps`` (exact when the batch did not change between
  polls, the mean otherwise). The prefill counters have no per-iteration split (no count of
  iterations, no context lengths), so a prefill report is only made when the counters' growth
  is exactly one prefill the driver saw finish (its uncached tokens match): then the busy time
  is that prefill's, as one iteration (its chunks summed; exact for a prompt within one
  chunk). Prefills that overlapped are not attributed and give no report. An engine running
  the evinfra patch reports each pass itself (``iterations``), and these are not used.
"""

from __future__ import annotations

import msgspec

from evinfra.core.events import IterationReport, NodeState, PrefillItem
from evinfra.core.types import NodeId, Phase

__all__ = ["EngineLoad", "LoadsTracker", "parse_loads", "LOADS_PATH"]

LOADS_PATH = "/v1/loads?include=core,queues,disagg"


class Disaggregation(msgspec.Struct, frozen=True):
    mode: str = "null"
    prefill_bootstrap_queue_reqs: int = 0
    prefill_inflight_queue_reqs: int = 0
    decode_prealloc_queue_reqs: int = 0
    decode_transfer_queue_reqs: int = 0
    decode_retracted_queue_reqs: int = 0


class EngineLoad(msgspec.Struct, frozen=True):
    """One DP rank's load snapshot (SGLang ``LoadSnapshot.to_dict``)."""

    timestamp: float = 0.0
    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    num_total_tokens: int = 0
    max_total_num_tokens: int = 0
    token_usage: float = 0.0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0
    decode_moments: list[float] | None = None
    disaggregation: Disaggregation | None = None

    @property
    def phase(self) -> Phase | None:
        mode = self.disaggregation.mode if self.disaggregation is not None else "null"
        return {"prefill": Phase.PREFILL, "decode": Phase.DECODE}.get(mode)


class _Loads(msgspec.Struct):
    loads: list[EngineLoad]


_decoder = msgspec.json.Decoder(_Loads)


def parse_loads(body: bytes) -> EngineLoad:
    """The snapshot of DP rank 0 (the driver runs one rank per node). Raises
    ``msgspec.ValidationError``/``DecodeError`` for a body that is not a loads answer."""
    loads = _decoder.decode(body).loads
    if not loads:
        raise msgspec.ValidationError("/v1/loads returned no DP rank")
    return min(loads, key=lambda x: x.dp_rank)


class LoadsTracker:
    """Turns successive snapshots of one node into router state and planner reports."""

    MAX_CLOCK_SKEW_S = 60.0

    MAX_PENDING_PREFILLS = 8

    def __init__(self, node: NodeId) -> None:
        self.node = node
        self.last: EngineLoad | None = None
        self._last_at: float | None = None
        self._prefills: list[PrefillItem] = []  # finished since the last attribution
        self._tokens = 0  # prefill counters' growth since the last attribution
        self._busy_us = 0

    def state(self, load: EngineLoad, now: float, wall_now: float) -> NodeState:
        """``now`` is the control plane's clock, ``wall_now`` its wall clock (to age the
        engine's timestamp). A timestamp that is implausible (clock skew between hosts) is
        ignored and the snapshot is taken as fresh."""
        age = wall_now - load.timestamp
        if not 0.0 <= age <= self.MAX_CLOCK_SKEW_S:
            age = 0.0
        d = load.disaggregation or Disaggregation()
        phase = load.phase
        room = max(0, load.max_total_num_tokens - load.num_total_tokens)
        if phase is Phase.PREFILL:
            prefilling = load.num_running_reqs + d.prefill_inflight_queue_reqs
            decoding = 0
        elif phase is Phase.DECODE:
            prefilling = 0
            decoding = load.num_running_reqs + d.decode_transfer_queue_reqs
        else:
            prefilling, decoding = 0, load.num_running_reqs
        return NodeState(
            node=self.node, time=now - age,
            phase=(phase or Phase.COLLOCATED).value, queued=load.num_waiting_reqs,
            prefilling=prefilling, decoding=decoding, kv_room=room,
            l1_used=load.num_used_tokens, l1_capacity=load.max_total_num_tokens)

    def decode_report(self, load: EngineLoad, now: float) -> IterationReport | None:
        """The decode iterations since the previous snapshot, summarised (see module doc)."""
        prev, prev_at = self.last, self._last_at
        self.last, self._last_at = load, now
        if prev is None or load.decode_moments is None or len(load.decode_moments) < 6:
            return None
        before = prev.decode_moments or [0.0] * 6
        delta = [a - b for a, b in zip(load.decode_moments, before)]
        steps = int(round(delta[0]))
        if steps <= 0 or any(x < 0 for x in delta):
            return None  # nothing new, or the counters restarted (a new engine process)
        batch = max(1, int(round(delta[1] / steps)))
        duration = delta[2] / steps / 1e6
        if duration <= 0:
            return None
        start = prev_at if prev_at is not None else now - duration * steps
        return IterationReport(node=self.node, start=start, duration=duration, batch=batch,
                               t_fwd=1, accepted=int(round(delta[5])), count=steps)

    def prefill_finished(self, request: str, t_uc: int, t_c: int, t_rst: int = 0) -> None:
        """The driver saw ``request``'s prefill finish (``t_uc`` tokens computed after ``t_c``
        cached ones, ``t_rst`` of which were restored from host memory for it, as the engine
        reported them)."""
        self._prefills.append(PrefillItem(request, t_uc, t_c, t_rst))
        if len(self._prefills) > self.MAX_PENDING_PREFILLS:  # never attributable: start over
            self._prefills.clear()
            self._tokens = self._busy_us = 0

    def prefill_report(self, load: EngineLoad, prev: EngineLoad | None, now: float
                       ) -> IterationReport | None:
        """A prefill iteration report when the counters' growth since the last attribution is
        exactly one finished prefill (call before :meth:`decode_report`, with the previous
        snapshot)."""
        if prev is None:
            return None
        d_tokens = load.total_prefill_uncached_tokens - prev.total_prefill_uncached_tokens
        d_us = load.total_prefill_busy_us - prev.total_prefill_busy_us
        if d_tokens < 0 or d_us < 0:  # counters restarted
            self._prefills.clear()
            self._tokens = self._busy_us = 0
            return None
        self._tokens += d_tokens
        self._busy_us += d_us
        if not self._prefills or self._tokens < sum(p.t_uc for p in self._prefills):
            return None  # the engine counted less than we saw finish: wait for its snapshot
        items, tokens, busy = self._prefills, self._tokens, self._busy_us
        self._prefills, self._tokens, self._busy_us = [], 0, 0
        if len(items) != 1 or tokens != items[0].t_uc or busy <= 0:
            return None  # overlapping or unattributable work
        duration = busy / 1e6
        return IterationReport(node=self.node, start=now - duration, duration=duration,
                               prefill=items)
