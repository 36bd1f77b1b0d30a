"""One fake node: a symmetric engine whose single scheduling loop serves both phases (paper 4.1).

The loop, run whenever no iteration is in flight:

1. a pending phase switch waits for the started work of the phase the node leaves (a chunked
   prefill, or the decode batch), then takes ``switch_latency`` and publishes
   ``PhaseSwitched``; meanwhile nothing of the old phase starts and the new phase's work goes
   on (a collocated node leaving its warm-up keeps serving the phase it keeps), a node
   leaving decode alternating prefill and decode iterations so its batch drains;
2. a prefill iteration packs up to ``chunk_tokens`` of ready requests, FCFS — the chunked
   request first, then queued requests whose peer fetch has landed (one still fetching is
   skipped, not waited for), stopping at the first that finds no GPU room;
3. otherwise ready decode requests join the batch (first token out) and a decode run starts;
4. otherwise the node is idle and heartbeats.

The phase is a label the router acts on: the engine serves whatever it is sent, which is what
makes it symmetric, and COLLOCATED (prefill first, else decode) is simply the loop above.

Decode *runs*: iterations with an unchanged batch end at ``start + i * d``. In ``iteration``
streaming the engine wakes at every boundary; in ``batched`` it sleeps until the first request
finishes, and any change (a request ready to join, prefill ready, an abort) cuts the run at
the next boundary: both modes compute the same times. Data-plane steps (peer fetches, P->D
transfers) run beside the loop, on their own timers.

Effects are buffered and published when a step ends (``_flush``), so a bus subscriber that
calls back into the engine always finds it consistent; messages between engines go through
the cluster at the same clock time, never as nested calls.
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any, Callable

import numpy as np

from evinfra.core.bus import Bus
from evinfra.core.clock import Clock, Timer
from evinfra.core.contracts import DecodeOrder, HintDelta, PrefillOrder
from evinfra.core.events import (AllBlocksCleared, KVEvent, NodeDown, NodeState, NodeUp,
                                 PhaseSwitched, PrefillItem, RequestFailed, Withdrawn)
from evinfra.core.types import Phase, RequestId
from evinfra.drivers.fake.cache import NodeCache
from evinfra.drivers.fake.config import FakeEngineConfig
from evinfra.drivers.fake.decode import DecodeSide
from evinfra.drivers.fake.kvpublish import KVPublisher
from evinfra.drivers.fake.outputs import DecodeProgress
from evinfra.drivers.fake.plane import DataPlane
from evinfra.drivers.fake.prefill import PrefillSide
from evinfra.drivers.fake.records import (DecodeRecord, DecodeState, PrefillIteration,
                                           PrefillRecord, Run)
from evinfra.drivers.fake.timing import GroundTruth

__all__ = ["FakeEngine"]

_W = DecodeState


class FakeEngine(PrefillSide, DecodeSide):
    """The simulated engine of ``node``; see the module docstring for its loop. The prefill
    and decode sides live in ``prefill.py`` and ``decode.py``."""

    def __init__(self, node: str, phase: Phase, config: FakeEngineConfig, clock: Clock,
                 bus: Bus, cluster: DataPlane, seed: int) -> None:
        self.node = node
        self.phase = phase
        self.config = config
        self.clock = clock
        self.bus = bus
        self.cluster = cluster
        self.seed = seed
        timing_rng, fault_rng, self._relaunch_rng = (
            np.random.default_rng(s) for s in
            np.random.SeedSequence([seed, zlib.crc32(node.encode())]).spawn(3))
        self.truth = GroundTruth(config, timing_rng)
        self.kv = KVPublisher(node, bus, fault_rng, config.kv_drop, config.kv_duplicate,
                              config.kv_reorder)
        self._kv_events: list[KVEvent] = []
        self.cache = NodeCache(config.page_size, config.l1_tokens, config.l2_tokens,
                               config.eviction == "count", self._kv_events.append)
        self._progress = DecodeProgress(config.t_acc)
        self._out: deque[object] = deque()
        self.down = False
        self.stalled = False
        self._deferred: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._switch_to: Phase | None = None
        self._busy: str | None = None  # what is in flight: "prefill", "decode", "switch"
        self._timer: Timer | None = None
        self._beat: Timer | None = None
        self._was_busy = False
        self._prefilled = False  # the last iteration was a prefill
        self._dirty = False  # something a batched decode run must stop for
        self._batch_changed = True
        self._last_state = float("-inf")
        self._prefills: dict[RequestId, PrefillRecord] = {}
        self._queue: dict[RequestId, PrefillRecord] = {}
        self._ahead = 0  # tokens of peer KV fetched or fetching for queued requests
        self._chunked: PrefillRecord | None = None
        self._inflight: list[tuple[PrefillRecord, PrefillItem]] = []
        self._handoff: dict[RequestId, PrefillRecord] = {}
        self._decodes: dict[RequestId, DecodeRecord] = {}
        self._prealloc: list[DecodeRecord] = []
        self._room_wait: list[DecodeRecord] = []
        self._ready: list[DecodeRecord] = []
        self._running: list[DecodeRecord] = []
        self._run: Run | None = None
        self._waiting_since: float | None = None  # prefill work present, the GPU idle
        self.prefill_log: list[PrefillIteration] | None = None
        """Every prefill iteration while in the prefill phase (paper D.6's idle time), once
        :meth:`FakeCluster.record_prefill` asks for it: a serving engine keeps no log."""

    # -- commands (the EngineDriver surface) ----------------------------------------------

    def start(self) -> None:
        """Publish the first NodeState and start the heartbeat."""
        self._enter(self._heartbeat)

    def submit_prefill(self, order: PrefillOrder) -> None:
        if self.down or self._busy == "relaunch":
            self._fail_now(order.request, started=False)
        else:
            self._enter(self._submit_prefill, order)

    def submit_decode(self, order: DecodeOrder) -> None:
        if self.down or self._busy == "relaunch":
            self._fail_now(order.request, started=True)
        else:
            self._enter(self._submit_decode, order)

    def withdraw(self, request: RequestId) -> None:
        self._enter(self._withdraw, request)

    def abort(self, request: RequestId) -> None:
        self._enter(self._abort, request, True)

    def switch_phase(self, phase: Phase) -> None:
        self._enter(self._switch_phase, phase)

    def push_hints(self, delta: HintDelta) -> None:
        self._enter(self.cache.apply_hints, delta)

    def healthy(self) -> bool:
        """False once crashed. A stalled engine still looks healthy: that is the hard case."""
        return not self.down

    # -- fault injection --------------------------------------------------------------------

    def crash(self, reason: str = "crashed") -> None:
        """The engine dies: ``NodeDown``, then its in-flight requests fail, its KV is gone,
        later orders fail at once. ``NodeDown`` goes first, as a driver sees a dead engine:
        a request failed before its prefill started is routed again, and the node must be
        out of routing by then (else it goes back to the dead node, and fails again)."""
        if self.down:
            return
        now = self.clock.now()
        self.down, self.stalled = True, False
        self._deferred.clear()
        self._kv_events.clear()
        self._out.append(NodeDown(self.node, now, reason))
        self._fail_all(now, f"node {self.node} down: {reason}")
        if self._beat is not None:
            self._beat.cancel()
        self.cache.clear()
        self._flush()
        self.cluster.node_down(self.node)

    def restart(self) -> None:
        """The crashed engine is relaunched: empty and idle, in the phase it had (a switch
        under way died with it). ``NodeUp`` then ``PhaseSwitched`` say so, as a restarted
        SGLang engine's driver does, and the heartbeat resumes."""
        if not self.down:
            return
        self.down = False
        self._switch_to = self._busy = None
        self._was_busy = self._prefilled = self._dirty = False
        self._batch_changed = True
        self._last_state = float("-inf")  # its state goes out at once
        now = self.clock.now()
        self._out.append(NodeUp(self.node, now))
        self._out.append(PhaseSwitched(self.node, self.phase.value, now))
        self._enter(self._heartbeat)

    def _fail_all(self, now: float, error: str) -> None:
        """Every request on the node fails (``started`` as far as it got) and is forgotten,
        timers cancelled; the cache is left to the caller."""
        if self._timer is not None:
            self._timer.cancel()
        failed: dict[RequestId, bool] = {}
        for rec in self._prefills.values():
            failed[rec.request] = rec.started
            if rec.timer is not None:
                rec.timer.cancel()
        for d in self._decodes.values():
            failed[d.request] = True
            if d.timer is not None:
                d.timer.cancel()
        for request, started in failed.items():
            self._out.append(RequestFailed(request, self.node, now, error, started))
        for table in (self._prefills, self._queue, self._handoff, self._decodes):
            table.clear()
        self._ahead = 0
        for queue in (self._prealloc, self._room_wait, self._ready, self._running,
                      self._inflight):
            queue.clear()
        self._chunked = self._run = None
        self._waiting_since = None

    def stall(self) -> None:
        """Stop making progress and publishing until :meth:`resume` (a stuck engine)."""
        self.stalled = True

    def resume(self) -> None:
        """Continue: everything that came due while stalled happens now, in order."""
        self.stalled = False
        deferred, self._deferred = self._deferred, []
        for fn, args in deferred:
            self._enter(fn, *args)

    # -- data plane (called by the cluster, at the sender's clock time) --------------------

    def kv_status(self, request: RequestId) -> str | None:
        """``"done"`` if this node holds the prefilled KV of ``request``, ``"running"`` if it
        is still prefilling it, None if it has no such request."""
        if self.down:
            return None
        if request in self._handoff:
            return "done"
        return "running" if request in self._prefills else None

    def source_ready(self, request: RequestId) -> None:
        self._enter(self._source_ready, request)

    def decode_reserved(self, request: RequestId) -> None:
        self._enter(self._decode_reserved, request)

    def release_source(self, request: RequestId) -> None:
        self._enter(self._release_source, request)

    def drop(self, request: RequestId) -> None:
        """Forget ``request`` silently: another node already answered for it."""
        self._enter(self._abort, request, False)

    def peer_down(self, peer: str) -> None:
        self._enter(self._peer_down, peer)

    # -- step plumbing ----------------------------------------------------------------------

    def _enter(self, fn: Callable[..., None], *args: Any) -> None:
        if self.down:
            return
        if self.stalled:
            self._deferred.append((fn, args))
            return
        fn(*args)
        self._flush()

    def _at(self, when: float, fn: Callable[..., None], *args: Any) -> Timer:
        return self.clock.call_at(when, self._enter, fn, *args)

    def _flush(self) -> None:
        """Publish what the step produced: its KV events as one batch first, then the rest.
        The bus runs to completion: a subscriber that calls back into this engine finds it
        consistent, and what that step produces is published after what this one did."""
        while True:
            if self._kv_events:
                events = self._kv_events[:]
                self._kv_events.clear()
                self.kv.publish(self.clock.now(), events)
            elif self._out:
                self.bus.publish(self._out.popleft())
            else:
                break

    def _fail_now(self, request: RequestId, started: bool) -> None:
        self.bus.publish(RequestFailed(request, self.node, self.clock.now(),
                                       f"node {self.node} is down", started))

    def _state(self, now: float, launched: list[PrefillItem] | None = None) -> None:
        self._last_state = now
        c = self.cache
        started = len(self._prefills) - len(self._queue) - len(self._handoff)
        self._out.append(NodeState(
            self.node, now, self.phase.value, launched or [], queued=len(self._queue),
            prefilling=started, decoding=len(self._decodes), kv_room=c.kv_room,
            l1_used=c.l1_used, l1_capacity=c.l1_capacity, l2_used=c.l2_used,
            l2_capacity=c.l2_capacity))

    def _heartbeat(self) -> None:
        now, period = self.clock.now(), self.config.heartbeat_s
        due = self._last_state + period
        if now + 1e-9 >= due:
            self._state(now)
            due = now + period
        self._beat = self._at(due, self._heartbeat)

    # -- the loop ---------------------------------------------------------------------------

    def _kick(self) -> None:
        self._admit_decodes(self.clock.now())
        if self._busy is None:
            self._schedule()
        elif self._busy == "decode" and self._dirty:
            self._interrupt()

    def _room_freed(self) -> None:
        # A ready prefill may have been waiting for this room: a batched run must stop for it
        # where an engine waking every iteration would see it.
        if any(r.ready for r in self._queue.values()):
            self._dirty = True

    def _schedule(self) -> None:
        now = self.clock.now()
        self._admit_decodes(now)
        target = self._switch_to
        # A switch waits only for the work of the phase the node leaves; the new phase's work
        # goes on meanwhile (a collocated node serves both until then).
        busy_in_old = (bool(self._running) if target is Phase.PREFILL
                       else self._chunked is not None)
        if target is not None and not busy_in_old:
            self._busy, self._run = "switch", None
            self._timer = self._at(now + self.config.switch_latency, self._switch_done)
            return
        # Leaving decode, the node alternates: its batch gets an iteration after each prefill
        # iteration, so it drains even under a prefill queue that never empties.
        drain = target is Phase.PREFILL and self._running and self._prefilled
        chunks = [] if drain else self._pack(now)
        if chunks:
            self._launch_prefill(chunks, now)
            return
        if target is not Phase.PREFILL:
            self._join(now)
        if self._running:
            self._waiting_since = None
            self._launch_decode(now)
            return
        self._run = None
        if not self._queue and self._chunked is None:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = now
        if self._was_busy:
            self._was_busy = False
            self._state(now)

    def _switch_phase(self, phase: Phase) -> None:
        # The worker of a relaunching cluster is launched for one phase: the first switch
        # out of the collocated start is its launch, any later change a relaunch.
        launched = self._switch_to if self.phase is Phase.COLLOCATED else self.phase
        if self.config.switch == "relaunch" and launched not in (None, phase):
            self._relaunch(phase)
            return
        self._switch_to = phase
        self._kick()

    def _relaunch(self, phase: Phase) -> None:
        """Dynamo's switch (paper A.1): the worker is terminated without waiting for its
        in-flight requests, its KV dropped (``AllBlocksCleared``), and serves ``phase`` once
        the new worker is up, ``relaunch_s`` after the decision (Table C.1 measures from the
        decision to the new worker ready). A request still on it fails, as Dynamo's frontend
        does with request migration off (its default, ``--migration-limit 0``); the peers'
        side is settled by the control plane's aborts."""
        now = self.clock.now()
        for request in list(self._prefills) + list(self._decodes):
            self.cluster.forget(request)
        self._fail_all(now, f"node {self.node} relaunching as {phase.value}")
        self.cache.clear()
        self._kv_events.append(AllBlocksCleared())
        low, high = self.config.relaunch_s
        self._switch_to, self._busy, self._was_busy = phase, "relaunch", False
        self._timer = self._at(now + float(self._relaunch_rng.uniform(low, high)),
                               self._switch_done)

    def _switch_done(self) -> None:
        now = self.clock.now()
        self.phase, self._switch_to, self._busy = self._switch_to, None, None
        self._out.append(PhaseSwitched(self.node, self.phase.value, now))
        self._state(now)
        self._schedule()

    # -- withdrawals, aborts, lost peers ----------------------------------------------------

    def _abort(self, request: RequestId, propagate: bool) -> None:
        if self._forget(request, propagate):
            self._kick()

    def _withdraw(self, request: RequestId) -> None:
        rec = self._queue.pop(request, None)
        if rec is None:
            return  # started (or unknown): it runs on, PrefillStarted told the router
        del self._prefills[request]
        self._drop_prefill(rec)
        self._out.append(Withdrawn(request, self.node, self.clock.now()))
        self.cluster.drop(request, self.node)
        self._room_freed()
        self._kick()

    def _forget(self, request: RequestId, propagate: bool) -> bool:
        """Drop ``request`` wherever it is on this node, freeing its KV; ``propagate`` drops
        the other end of its P->D pair too. No event: the caller reports what it must."""
        rec = self._prefills.pop(request, None)
        if rec is not None:
            self._queue.pop(request, None)
            self._handoff.pop(request, None)
            if self._chunked is rec:
                self._chunked = None
            self._drop_prefill(rec)
        d = self._decodes.pop(request, None)
        if d is not None:
            self._drop_decode(d)
        if rec is None and d is None:
            return False
        if propagate:
            self.cluster.drop(request, self.node)
        else:
            self.cluster.forget(request)
        self._room_freed()
        return True

    def _peer_down(self, peer: str) -> None:
        """``peer`` crashed and reported its requests failed: drop this node's side of them
        (KV it would have sent or received)."""
        for d in list(self._decodes.values()):
            if d.source == peer and d.state in (_W.PREALLOC, _W.WAIT_KV, _W.WAIT_ROOM,
                                                 _W.TRANSFER):
                self._forget(d.request, False)
        for rec in list(self._prefills.values()):
            if rec.started and self.cluster.target(rec.request) == peer:
                self._forget(rec.request, False)
        self._kick()
