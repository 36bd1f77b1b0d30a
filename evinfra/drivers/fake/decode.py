"""The decode side of the fake engine: binding, P->D transfer, batching, streaming (paper
4.2, 5.1, D.1, Fig. 4d).

A decode order fixes the request's output and waits for its source to finish the prefill.
Then, FCFS as GPU room allows (no reservation before, paper D.1; with ``decode_prealloc``,
SGLang's way, the room is reserved when the order arrives and the source waits for it), the
blocks this node's GPU lacks move from the source, and the request joins the batch at the
next iteration boundary with its first token. Iterations with an unchanged batch form a
:class:`Run`; ``batched`` streaming sleeps through a run and reports it once
(``IterationReport.count``).

A mixin of :class:`~evinfra.drivers.fake.engine.FakeEngine` (see ``prefill.py``).
"""

from __future__ import annotations

import numpy as np
import structlog

from evinfra.core.contracts import DecodeOrder
from evinfra.core.events import IterationReport, RequestFailed, TokensOut
from evinfra.core.types import RequestId
from evinfra.drivers.fake.records import DecodeRecord, DecodeState, Run

__all__ = ["DecodeSide"]

log = structlog.get_logger(__name__)

_W = DecodeState


class DecodeSide:
    """Decode orders, transfers and runs of one engine."""

    def _submit_decode(self, order: DecodeOrder) -> None:
        now = self.clock.now()
        if order.request in self._decodes:
            log.warning("fake_engine_duplicate_order", node=self.node, request=order.request)
            return
        out, finish = self.cluster.outputs.plan(order.request, order.sampling)
        d = DecodeRecord(order, self.config.page_size, out, finish,
                         self._progress.iterations(len(out)))
        status = self.cluster.bind(d.request, d.source, self.node)
        if status is None:
            self._out.append(RequestFailed(d.request, self.node, now,
                                           f"KV source {d.source} does not hold the request",
                                           True))
            return
        self._decodes[d.request] = d
        if status == "done":
            d.state = _W.WAIT_ROOM
            self._room_wait.append(d)
        elif self.config.decode_prealloc and d.source != self.node:
            d.state = _W.PREALLOC
            self._prealloc.append(d)
        self._kick()

    def _source_ready(self, request: RequestId) -> None:
        d = self._decodes.get(request)
        if d is not None and d.state is _W.WAIT_KV:
            if d.reserved:  # preallocated before the prefill: the transfer starts at once
                self._transfer(d, self.clock.now())
            else:
                d.state = _W.WAIT_ROOM
                self._room_wait.append(d)
            self._kick()

    def _admit_decodes(self, now: float) -> None:
        """Reserve (FCFS) as GPU room allows: first the preallocations of ``decode_prealloc``
        (SGLang PD reserves before the prefill and the source waits for it, paper D.1), then
        the transfers of requests whose KV is ready (evinfra reserves only now, after the
        prefill). A request whose size (the GPU room it takes) exceeds the GPU fails."""
        while self._prealloc:
            d = self._prealloc[0]
            size, ok = self._reserve(d, now)
            if size > self.cache.l1_capacity:
                self._too_big(d, now)
                continue
            if not ok:
                break
            self._prealloc.pop(0)
            d.state = _W.WAIT_KV
            self.cluster.decode_reserved(d.request, d.source)
        while self._room_wait:
            d = self._room_wait[0]
            if d.source == self.node:  # its input is pinned here already
                size, ok = len(d.out), self._take_over(d, now)
            else:
                size, ok = self._start_transfer(d, now)
            if size > self.cache.l1_capacity:
                self._too_big(d, now)
                continue
            if not ok:
                return
            self._room_wait.pop(0)

    def _too_big(self, d: DecodeRecord, now: float) -> None:
        self._forget(d.request, True)
        self._out.append(RequestFailed(d.request, self.node, now,
                                       "request exceeds the node's KV capacity", True))

    def _take_over(self, d: DecodeRecord, now: float) -> bool:
        """Same node: the prefill record's pins and partial page pass to the decode record."""
        c, need = self.cache, len(d.out)
        if need > c.l1_capacity or need > c.kv_room or not c.reserve(need):
            return False
        rec = self._handoff.pop(d.request)
        del self._prefills[d.request]
        d.locked, d.reserved = rec.locked, rec.reserved + len(d.out)
        rec.locked = rec.reserved = 0
        self._ready_to_join(d)
        return True

    def _start_transfer(self, d: DecodeRecord, now: float) -> tuple[int, bool]:
        size, ok = self._reserve(d, now)
        if ok:
            self._transfer(d, now)
        return size, ok

    def _reserve(self, d: DecodeRecord, now: float) -> tuple[int, bool]:
        """GPU room for the blocks this node's GPU lacks and the output. Its L1 prefix is
        pinned first, so that making the room cannot evict it (an evicted L1-only block,
        whose write-through found no host room, would be gone). Returns the GPU room the
        request takes in all, its reused prefix included, and whether it was granted."""
        c, page = self.cache, self.config.page_size
        total = d.n_in + len(d.out)
        k1 = c.l1_prefix(d.path)
        need = total - k1 * page
        if total > c.l1_capacity or need > c.kv_room:
            return total, False
        c.lock(d.path, k1, now)
        if not c.reserve(need):
            c.unlock(d.path, k1, now)
            return total, False
        d.locked, d.reserved = k1, need
        return total, True

    def _transfer(self, d: DecodeRecord, now: float) -> None:
        """P->D: only the blocks missing from this node's GPU move (Fig. 4d). A decode node
        never loads its own host copies: that would stall its batch (D.6)."""
        moved = d.n_in - d.locked * self.config.page_size
        d.state = _W.TRANSFER
        d.timer = self._at(now + moved * self.config.pd_s_per_token, self._transfer_done, d)

    def _transfer_done(self, d: DecodeRecord) -> None:
        now, page, c = self.clock.now(), self.config.page_size, self.cache
        self.cluster.transfer_done(d.request, d.source)
        n = len(d.path)
        freed = (n - d.locked) * page
        c.release(freed)
        d.reserved -= freed
        res = c.insert(d.path, n, d.tokens, now)
        c.extend_lock(d.path, d.locked, res.resident, now)
        d.locked, d.timer = res.resident, None
        self._ready_to_join(d)
        self._kick()

    def _ready_to_join(self, d: DecodeRecord) -> None:
        d.state = _W.READY
        self._ready.append(d)
        self._dirty = True

    def _join(self, now: float) -> None:
        """Ready requests join the batch; each streams its first token now (TTFT)."""
        joined, self._ready = self._ready, []
        for d in joined:
            d.state = _W.RUNNING
            self._running.append(d)
            self._batch_changed = True
            if len(d.out) == 1:
                self._finish(d, now)
            else:
                self._tokens(d, now, 1)

    def _launch_decode(self, now: float) -> None:
        run, batched = self._run, self.config.streaming == "batched"
        # The same batch right at the boundary the run planned continues it (same floats);
        # anything else starts a new run here.
        if (run is None or self._batch_changed or self.config.noise
                or run.start + run.done * run.d != now):
            ctx = sum(d.n_in for d in self._running)
            run = self._run = Run(now, self.truth.decode(len(self._running), ctx),
                                  list(self._running))
        if batched:
            run.planned = run.done + max(0, min([d.need - d.iters for d in run.batch]))
        else:
            run.planned = run.done + 1
        self._busy, self._was_busy, self._prefilled = "decode", True, False
        self._batch_changed = self._dirty = False
        self._timer = self._at(run.start + run.planned * run.d, self._end_decode)
        self._state(now)

    def _interrupt(self) -> None:
        """Cut a batched run at the first iteration boundary at or after now."""
        run, now = self._run, self.clock.now()
        self._dirty = False
        if self.config.streaming != "batched" or run is None or run.d <= 0:
            return
        i = max(run.done + 1, int((now - run.start) / run.d))
        while run.start + i * run.d < now:
            i += 1
        while i - 1 > run.done and run.start + (i - 1) * run.d >= now:
            i -= 1
        if i < run.planned:
            self._timer.cancel()
            run.planned = i
            self._timer = self._at(run.start + i * run.d, self._end_decode)

    def _end_decode(self) -> None:
        now, run, produced = self.clock.now(), self._run, self._progress.produced
        k = run.planned - run.done
        stream = self.config.streaming == "iteration"
        accepted, finished = 0, []
        for d in run.batch:
            d.iters += k
            if d.iters >= d.need:
                after = len(d.out)
                finished.append(d)
            else:
                after = produced(d.iters, len(d.out))
                if stream and after > d.emitted:
                    self._tokens(d, now, after)
            accepted += after - d.made
            d.made = after
        self._out.append(IterationReport(self.node, run.start + run.done * run.d, run.d,
                                         batch=run.B, t_fwd=self.config.t_fwd,
                                         accepted=accepted, count=k))
        run.done = run.planned
        for d in finished:
            self._finish(d, now)
        self._busy = None
        self._schedule()

    def _finish(self, d: DecodeRecord, now: float) -> None:
        """The request ends; the full pages of its input and output (all but the last token,
        which has no KV yet) are written through: the branch's next prefix."""
        c = self.cache
        self._running.remove(d)
        if self._run is not None and d in self._run.batch:
            self._run.batch.remove(d)
        del self._decodes[d.request]
        self._batch_changed = True
        committed = np.concatenate([d.tokens, d.out[:-1]])
        pages = self.cluster.pages.hashes(d.path, committed)
        c.release(d.reserved)
        if pages:
            full = d.path + pages
            c.insert(full, len(full), committed, now)
        c.unlock(d.path, d.locked, now)
        d.locked = d.reserved = 0
        self._tokens(d, now, len(d.out), d.finish)
        self.cluster.forget(d.request)
        self._room_freed()

    def _tokens(self, d: DecodeRecord, now: float, upto: int, finish: str | None = None
                ) -> None:
        """Stream ``d``'s output up to token ``upto`` (with logprobs if it asked)."""
        out = d.out[d.emitted:upto]
        k = d.order.sampling.logprobs
        lp = self.cluster.outputs.logprobs(out, k) if k is not None else None
        self._out.append(TokensOut(d.request, self.node, now, out, finish, lp))
        d.emitted = upto

    def _drop_decode(self, d: DecodeRecord) -> None:
        for queue in (self._prealloc, self._room_wait, self._ready, self._running):
            if d in queue:
                queue.remove(d)
        if self._run is not None and d in self._run.batch:
            self._run.batch.remove(d)
        if d.state is _W.RUNNING:
            self._batch_changed = self._dirty = True
        if d.timer is not None:
            d.timer.cancel()
        self.cache.unlock(d.path, d.locked, self.clock.now())
        self.cache.release(d.reserved)
        d.locked = d.reserved = 0
