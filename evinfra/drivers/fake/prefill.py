"""The prefill side of the fake engine: admission, peer fetch, chunked packing (paper 4.2,
5.1, D.1, D.6).

A prefill order starts its peer fetch at once and pins nothing while it waits; it is ready
when the fetch lands. Packing is FCFS over ready requests within the chunk budget; a request
pins its cached prefix and gets GPU room (restore of its host-only prefix, its uncomputed
input) only when its first chunk launches, and its computed pages enter the cache chunk by
chunk. When its last chunk ends it keeps its KV pinned for the decode side until the transfer
lands.

A mixin of :class:`~evinfra.drivers.fake.engine.FakeEngine`: it reads and writes the
engine's state and calls its loop (``_kick``, ``_schedule``), never the other way round
except through the methods here.
"""

from __future__ import annotations

import structlog

from evinfra.core.contracts import PrefillOrder
from evinfra.core.events import (IterationReport, PrefillDone, PrefillItem, PrefillStarted,
                                 RequestFailed)
from evinfra.core.types import Phase, RequestId, Tier
from evinfra.drivers.fake.records import PrefillIteration, PrefillRecord

__all__ = ["PrefillSide"]

log = structlog.get_logger(__name__)


class PrefillSide:
    """Prefill orders, fetches and chunks of one engine."""

    def _submit_prefill(self, order: PrefillOrder) -> None:
        now, page = self.clock.now(), self.config.page_size
        if order.request in self._prefills:
            log.warning("fake_engine_duplicate_order", node=self.node, request=order.request)
            return
        mode = self.config.peer_fetch
        awaiting = self.config.decode_prealloc and self.phase is Phase.PREFILL
        rec = PrefillRecord(order, page, bool(order.fetch) and mode != "none", awaiting)
        if rec.n_in == 0:
            self._out.append(RequestFailed(rec.request, self.node, now, "empty prompt", False))
            return
        rec.fetching = rec.fetch and mode == "queued"
        self._prefills[rec.request] = self._queue[rec.request] = rec
        if rec.fetching:
            self._start_fetches(now)
        self._dirty |= rec.ready
        self._kick()

    def _start_fetches(self, now: float) -> None:
        """Start queued requests' fetches in queue order while the KV their plans cover fits
        in the ``fetch_ahead`` share of L1 (the first always starts). A fetch pulls only the
        blocks the node lacks when it starts: its own copies, which the plan's first run
        backs, may have been evicted while the request waited."""
        page, budget = self.config.page_size, self.config.fetch_ahead * self.cache.l1_capacity
        for rec in self._queue.values():
            if not rec.fetching or rec.timer is not None:
                continue
            tokens = max(run.start + len(run.blocks) for run in rec.order.fetch) * page
            if self._ahead and self._ahead + tokens > budget:
                return
            missing = self._missing(rec) * page
            delay = (self.config.fetch_latency + missing * self.config.fetch_s_per_token
                     if missing else 0.0)
            rec.fetch_s, rec.ahead = delay, tokens
            self._ahead += tokens
            rec.timer = self._at(now + delay, self._fetch_done, rec)

    def _missing(self, rec: PrefillRecord) -> int:
        """Blocks of ``rec``'s fetch plan past the prefix this node holds now."""
        held, n = self.cache.prefix(rec.path), len(rec.path)
        return sum(max(0, min(run.start + len(run.blocks), n) - max(run.start, held))
                   for run in rec.order.fetch)

    def _leave_queue(self, rec: PrefillRecord) -> None:
        """``rec`` started or left the queue: its fetch no longer counts ahead."""
        if rec.ahead:
            self._ahead -= rec.ahead
            rec.ahead = 0
            self._start_fetches(self.clock.now())

    def _fetch_done(self, rec: PrefillRecord) -> None:
        """The fetch landed while the request waited (paper 4.2, D.6)."""
        self._pull(rec, self.clock.now())
        rec.fetching, rec.timer = False, None
        self._dirty = True
        self._kick()

    def _pull(self, rec: PrefillRecord, now: float) -> int:
        """Keep the contiguous part of the fetch plan the peers still hold, in own L2 and L1
        with the own host copies before it; the rest will be recomputed. Pins nothing: a
        queued request holding its prefix would let a long queue fill L1 with pins and
        starve admission (the pin comes with the first chunk). Returns the blocks that
        arrived.

        What finds no L1 room (a collocated node's running decodes hold it) stays in host
        memory, where the SGLang engine's fetch puts every page (``engine_patch/fetch.py``),
        and is loaded back at admission: dropping it recomputed whole fetched prefixes
        (OSWorld 160: 24 requests in flight across the warm-up's end, 31 % of the run's
        lost reuse)."""
        path = rec.path
        target = self.cache.prefix(path)
        for run in sorted(rec.order.fetch, key=lambda r: r.start):
            end = min(run.start + len(run.blocks), len(path))
            if run.start > target:
                break
            if end <= target:
                continue
            got = min(end, self.cluster.peer_l2_prefix(run.peer, path, end))
            if got <= target:
                break
            target = got
        res = self.cache.insert(path, target, rec.tokens, now)
        added = res.added
        if res.resident < target:
            added += self.cache.store_host(path, target, rec.tokens, now)
        rec.fetched = added
        rec.restored += res.restored + res.added  # host-only blocks: when admission loads them
        rec.fetch = False
        return added

    def _decode_reserved(self, request: RequestId) -> None:
        """The decode node reserved the request's KV (SGLang PD's handshake, paper D.1)."""
        rec = self._queue.get(request)
        if rec is not None and rec.awaiting:
            rec.awaiting = False
            self._dirty |= rec.ready
            self._kick()

    def _admit_prefill(self, rec: PrefillRecord, now: float) -> str:
        """Give a request its first chunk: restore its host-only prefix, reserve GPU room for
        the rest of its input (no reservation while queued, paper D.1)."""
        c, page, path = self.cache, self.config.page_size, rec.path
        if rec.fetch:
            # Fetched only now (``peer_fetch = "prefill_start"``): the transfer and the
            # load-back stall the iteration that consumes it (paper D.6), once; so does the
            # load-back of the node's own host copies below.
            added = self._pull(rec, now)
            if added:
                rec.load_s = rec.fetch_s = (self.config.fetch_latency
                                            + added * page * self.config.fetch_s_per_token)
        # Other requests may have stored more of it meanwhile. The prompt's log-probabilities
        # take its whole computation (SGLang reuses no prefix for them).
        held = 0 if rec.order.sampling.prompt_logprobs else c.prefix(path)
        c.extend_lock(path, rec.locked, held, now)
        rec.locked = held
        restore = rec.locked - c.tier_prefix(path, rec.locked, Tier.L1)
        compute = rec.n_in - rec.locked * page
        need = restore * page + compute
        if need > c.l1_capacity:
            return "fail"
        if need > c.kv_room or not c.make_room(need):
            return "wait"
        rec.restored += c.insert(path, rec.locked, rec.tokens, now).restored
        # Own host copies, restored here or by the pull above: loaded back too, no transfer.
        if rec.restored and rec.load_s is None and self.config.peer_fetch == "prefill_start":
            rec.load_s = 0.0
        c.reserve(compute)
        rec.reserved = compute
        # At least one input token is computed (its logits give the first output token).
        rec.cached = rec.done = min(rec.locked, (rec.n_in - 1) // page) * page
        return "ok"

    def _pack(self, now: float) -> list[tuple[PrefillRecord, PrefillItem]]:
        budget, chunks, page = self.config.chunk_tokens, [], self.config.page_size
        rec = self._chunked
        if rec is not None:
            t = min(budget, rec.n_in - rec.done)
            chunks.append((rec, PrefillItem(rec.request, t, rec.done, 0)))
            budget -= t
            self._chunked = None
        if self._switch_to is Phase.DECODE:
            return chunks
        started, failed = [], []
        for rec in self._queue.values():
            if budget <= 0:
                break
            if not rec.ready:
                continue
            verdict = self._admit_prefill(rec, now)
            if verdict == "fail":
                failed.append(rec)
                continue
            if verdict == "wait":
                break
            t = min(budget, rec.n_in - rec.done)
            chunks.append((rec, PrefillItem(rec.request, t, rec.done, rec.restored * page)))
            budget -= t
            started.append(rec)
        for rec in failed:
            self._forget(rec.request, True)
            self._out.append(RequestFailed(rec.request, self.node, now,
                                           "prompt exceeds the node's KV capacity", False))
        for rec in started:
            del self._queue[rec.request]
            rec.started = True
            self._leave_queue(rec)
        return chunks

    def _launch_prefill(self, chunks: list[tuple[PrefillRecord, PrefillItem]], now: float) -> None:
        items = [item for _, item in chunks]
        duration = self.truth.prefill(items)
        loads = [rec.load_s for rec, _ in chunks if rec.load_s is not None]
        load = sum(loads) + self.config.load_back_s if loads else 0.0
        for rec, _ in chunks:
            rec.load_s = None
        duration += load
        if self.phase is Phase.PREFILL and self.prefill_log is not None:
            waited = 0.0 if self._waiting_since is None else now - self._waiting_since
            self.prefill_log.append(PrefillIteration(now, duration, waited, load))
        self._waiting_since = None
        self._inflight, self._busy, self._was_busy, self._run = chunks, "prefill", True, None
        self._prefilled = True
        self._timer = self._at(now + duration, self._end_prefill, now, duration)
        self._state(now, items)
        for rec, item in chunks:
            if item.t_c == rec.cached:
                self._out.append(PrefillStarted(rec.request, self.node, now))

    def _end_prefill(self, start: float, duration: float) -> None:
        now, page = self.clock.now(), self.config.page_size
        chunks, self._inflight = self._inflight, []
        self._out.append(IterationReport(self.node, start, duration, [i for _, i in chunks]))
        for rec, item in chunks:
            if rec.aborted:
                continue
            rec.done += item.t_uc
            full = min(rec.done // page, len(rec.path))
            if full > rec.locked:
                self._commit(rec, full, now)
            if rec.done < rec.n_in:
                self._chunked = rec
                continue
            self._handoff[rec.request] = rec
            s = rec.order.sampling
            prompt = (self.cluster.outputs.logprobs(rec.tokens[1:], s.logprobs)
                      if s.prompt_logprobs and s.logprobs is not None else None)
            fetched = min(rec.fetched * page, rec.cached)
            self._out.append(PrefillDone(rec.request, self.node, now, rec.cached, fetched,
                                         rec.n_in - rec.cached, prompt,
                                         rec.fetch_s if fetched else 0.0))
            self.cluster.prefill_done(rec.request, self.node)
        self._busy = None
        self._schedule()

    def _commit(self, rec: PrefillRecord, full: int, now: float) -> None:
        """Computed pages move from the request's reservation into the tree (write-through)."""
        freed = (full - rec.locked) * self.config.page_size
        self.cache.release(freed)
        rec.reserved -= freed
        res = self.cache.insert(rec.path, full, rec.tokens, now)
        self.cache.extend_lock(rec.path, rec.locked, res.resident, now)
        rec.locked = res.resident

    def _release_source(self, request: RequestId) -> None:
        rec = self._handoff.pop(request, None)
        if rec is not None:
            del self._prefills[request]
            self._drop_prefill(rec)
            self._room_freed()
            self._kick()

    def _drop_prefill(self, rec: PrefillRecord) -> None:
        rec.aborted = True
        if rec.timer is not None:
            rec.timer.cancel()
            rec.timer = None
        self._leave_queue(rec)
        self.cache.unlock(rec.path, rec.locked, self.clock.now())
        self.cache.release(rec.reserved)
        rec.locked = rec.reserved = 0
