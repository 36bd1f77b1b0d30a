"""The SGLang driver: one real SGLang PD engine behind the :class:`EngineDriver` protocol.

Commands return at once; each request runs in its own task that streams ``/generate`` and
turns what the engine says into bus events. Two more tasks per node follow the engine: the KV
event subscriber (``kvsub``) and the ``/v1/loads`` poller (``loads``), which also decides when
the engine is down. A down engine is looked for again every ``rejoin_interval_s``: once it
answers (restarted, its KV empty) it is discovered anew and the node serves again
(``NodeUp``, then its phase). The pure parts (discovery, stream tracking, loads, request
bodies, error mapping) live in their own modules; this one only moves data between them and
the network.

Events answering a *command* (a refusal at submit, ``Withdrawn``) are published from inside
it, as the fake engines' are: the bus runs commands to completion and delivers them after
(``core/bus.py``). A request's outcome is published once (``_Leg.closed``); after
``abort`` nothing follows.

Deviation from the paper (D.1), forced by stock SGLang PD: a prefill engine keeps a request in
its bootstrap queue until the decode side of the same room arrives, and says nothing about it
until the prefill is over. So ``PrefillStarted`` is published as soon as the prefill engine
*accepts* the request (its streaming response starts), which makes the service bind the decode
node at submit time rather than when the prefill begins; the decode engine reserves KV for it
from then on, as SGLang PD always does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import aiohttp
import msgspec
import structlog

from evinfra.core.bus import Bus
from evinfra.core.clock import Clock
from evinfra.core.contracts import DecodeOrder, HintDelta, PrefillOrder
from evinfra.core.events import (AllBlocksCleared, KVEventBatch, NodeDown, NodeKVEvents,
                                 NodeKVViewLost, NodeUp, PhaseSwitched, PrefillDone,
                                 PrefillStarted, RequestFailed, TokensOut, Withdrawn)
from evinfra.core.types import NodeId, Phase, RequestId
from evinfra.drivers.sglang.discovery import EngineInfo, parse_engine_info
from evinfra.drivers.sglang.errors import Failure, engine_message, from_exception, from_http
from evinfra.drivers.sglang.hints import HintOutbox
from evinfra.drivers.sglang.iterations import IterationTracker
from evinfra.drivers.sglang.kvsub import KVSubscriber
from evinfra.drivers.sglang.loads import LOADS_PATH, LoadsTracker, parse_loads
from evinfra.drivers.sglang.pairs import PairBook
from evinfra.drivers.sglang.requests import (DONE, Bootstrap, Chunk, OutputCursor, StreamError,
                                             generate_body, parse_sse_line, priority_for,
                                             prompt_logprobs)
from evinfra.engine_patch.wire import (STATUS_PATH, FetchPlan, FetchRunWire, decode_iterations,
                                       fetch_kv_hints, fetch_seconds,
                                       restored_tokens)
from evinfra.errors import EngineError, EvinfraError

__all__ = ["DriverSettings", "SGLangDriver", "switch_wait_s"]

log = structlog.get_logger(__name__)


class DriverSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Timing of the driver's I/O (defaults suit engines on one cluster network)."""

    connect_timeout_s: float = 5.0
    discovery_timeout_s: float = 30.0
    """How long ``start`` waits for an engine to answer ``/server_info``."""
    poll_interval_s: float = 0.5
    """``/v1/loads`` period: well inside the router's 5 s state age limit."""
    poll_timeout_s: float = 2.0
    down_after_s: float = 3.0
    """An engine whose ``/v1/loads`` fails this long (or refuses connections) is down."""
    replay_timeout_s: float = 2.0
    switch_timeout_s: float = 120.0
    """How long a switch may take besides draining: a stock engine's whole switch (it refuses
    to switch while busy), a patched engine's rebuild after its drain (see
    :func:`switch_wait_s`)."""
    switch_retry_s: float = 30.0
    """How long a switch the engine refuses as "not idle" is retried."""
    clear_wait_s: float = 2.0
    """After a switch, how long to wait for the engine's ``AllBlocksCleared`` (stock SGLang
    drops its prefix cache on a switch) so the directory applies it before new-phase work."""
    finish_wait_s: float = 2.0
    """How long a finished decode waits for its prefill's outcome before closing the request."""
    abort_timeout_s: float = 2.0
    rejoin_interval_s: float = 5.0
    """How often a down engine is looked for (a restarted one rejoins the cluster)."""


def switch_wait_s(settings: DriverSettings, drain_timeout_s: float | None) -> float:
    """How long to wait for an engine's answer to a switch. A patched engine drains first, up
    to the limit it advertises (``EVINFRA_DRAIN_TIMEOUT_S``, the one source of that limit),
    then rebuilds: waiting less would mark a node down that is still draining."""
    if drain_timeout_s is None:
        return settings.switch_timeout_s
    return drain_timeout_s + settings.switch_timeout_s


class _Leg:
    """One side (prefill or decode) of a request on this engine: its HTTP stream."""

    __slots__ = ("request", "kind", "rid", "task", "accepted", "closed", "source", "bootstrap")

    def __init__(self, request: RequestId, kind: str, rid: str, source: NodeId,
                 bootstrap: Bootstrap) -> None:
        self.request = request
        self.kind = kind  # "prefill" | "decode"
        self.rid = rid  # the engine's request id (unique per attempt)
        self.task: asyncio.Task | None = None
        self.accepted = False  # the engine's response started
        self.closed = False  # outcome published, or aborted / withdrawn
        self.source = source  # the prefill node of the pair
        self.bootstrap = bootstrap


class SGLangDriver:
    """One SGLang engine (``node``) at ``url``."""

    def __init__(self, node: NodeId, url: str, clock: Clock, bus: Bus, pairs: PairBook,
                 page_size: int, settings: DriverSettings = DriverSettings()) -> None:
        self.node = node
        self.url = url.rstrip("/")
        self.clock = clock
        self.bus = bus
        self.pairs = pairs
        self.page_size = page_size
        self.settings = settings
        self.info: EngineInfo | None = None
        self.phase: Phase | None = None
        self._down = False
        self._stopping = False
        self._flights: dict[tuple[RequestId, str], _Leg] = {}
        self._tasks: set[asyncio.Task] = set()
        self._session: aiohttp.ClientSession | None = None
        self._kv: KVSubscriber | None = None
        self._kv_task: asyncio.Task | None = None
        self._loads = LoadsTracker(node)
        self._iterations = IterationTracker(node)
        self._iterations_failed: str | None = None
        self._engine_clears = 0
        self._hints = HintOutbox()
        self._hint_task: asyncio.Task | None = None
        self._resync_wanted = False  # a KV resync to ask of the engine
        self._resync_awaited = False  # asked: its AllBlocksCleared is no cache drop
        self._resync_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"prefills": 0, "decodes": 0, "failed": 0, "withdrawn": 0, "aborted": 0,
                      "switches": 0, "fetch_plans_sent": 0, "fetch_plans_ignored": 0,
                      "fetched_tokens": 0, "restored_tokens": 0, "hints_sent": 0,
                      "hints_retried": 0, "hints_refused": 0, "hints_unsupported": 0,
                      "kv_batches": 0, "kv_resyncs": 0, "kv_resync_sent": 0,
                      "kv_resync_retried": 0, "kv_resync_refused": 0,
                      "kv_resync_received": 0, "state_reports": 0,
                      "iteration_reports": 0, "iterations_missed": 0}

    @property
    def constrains_output(self) -> bool:
        return self.info is not None and self.info.grammar

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.settings
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=s.connect_timeout_s),
            read_bufsize=1 << 20, raise_for_status=False)
        try:
            info = await self._discover()
        except BaseException:
            await self._session.close()
            raise
        self._connect(info)
        self._spawn(self._watch())

    def _connect(self, info: EngineInfo) -> None:
        """Serve the engine ``info`` describes: its role, its KV events."""
        s = self.settings
        self.info = info
        self.phase = info.phase
        self.pairs.register_engine(self.node, info.host, info.bootstrap_port, info.pool)
        log.info("sglang_engine", node=self.node, url=self.url, phase=info.phase.value,
                 model=info.model, version=info.version, kv_events=info.kv_endpoint,
                 replay=info.replay_endpoint, role_switch=info.role_switch,
                 priority_eviction=info.priority_eviction, count_hints=info.hints_path,
                 switch_in_place=info.switch_in_place, fetch=info.fetch, pool=info.pool)
        if not info.radix_cache:
            log.warning("sglang_no_radix_cache", node=self.node,
                        hint="launch with --disaggregation-decode-enable-radix-cache: without "
                             "it a decode engine keeps no KV for a branch's next request, and "
                             "after a switch to prefill it caches no prefix at all")
        if not info.role_switch:
            log.warning("sglang_no_role_switch", node=self.node,
                        hint="launch with --enable-pd-role-switch or the planner cannot "
                             "move this node")
        # The engine's PD role is fixed at launch: the router routes it by that role from now
        # on, before any request (stock SGLang has no collocated mode to warm up in).
        self.bus.publish(PhaseSwitched(self.node, info.phase.value, self.clock.now()))
        if info.kv_endpoint is not None:
            self._kv = KVSubscriber(self.node, info.kv_endpoint, info.replay_endpoint,
                                    info.kv_topic, self._on_kv_batch, self._on_kv_clear,
                                    s.replay_timeout_s)
            self._kv_task = self._spawn(self._kv.run())
        else:
            log.warning("sglang_no_kv_events", node=self.node,
                        hint="launch with --kv-events-config '{\"publisher\":\"zmq\",...}': "
                             "without it the directory never sees this node's cache")

    async def stop(self) -> None:
        self._stopping = True
        aborts = [f for f in self._flights.values() if not f.closed]
        for f in aborts:
            f.closed = True
            if f.task is not None:
                f.task.cancel()
        if aborts and not self._down:
            await asyncio.gather(*(self._abort_on_engine(f.rid) for f in aborts),
                                 return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._kv is not None:
            self._kv.close()
        if self._session is not None:
            await self._session.close()

    def healthy(self) -> bool:
        return self.info is not None and not self._down

    # -- commands (return at once) -----------------------------------------------------------

    def submit_prefill(self, order: PrefillOrder) -> None:
        now = self.clock.now()
        if not self.healthy():
            self.bus.publish(RequestFailed(order.request, self.node, now,
                                           f"engine {self.node} is down", started=False))
            return
        boot = self.pairs.open(order.request, self.node, now)
        f = _Leg(order.request, "prefill", f"{order.request}-p{boot.room:x}", self.node, boot)
        self._flights[(order.request, "prefill")] = f
        self.stats["prefills"] += 1
        f.task = self._spawn(self._run_prefill(f, order))

    def submit_decode(self, order: DecodeOrder) -> None:
        now = self.clock.now()
        boot = self.pairs.find(order.request, order.source)
        if not self.healthy() or boot is None:
            why = (f"engine {self.node} is down" if not self.healthy() else
                   f"no open prefill of this request on {order.source} to pair with")
            self.bus.publish(RequestFailed(order.request, self.node, now, why, started=True))
            return
        f = _Leg(order.request, "decode", f"{order.request}-d{boot.room:x}", order.source,
                    boot)
        self._flights[(order.request, "decode")] = f
        self.stats["decodes"] += 1
        f.task = self._spawn(self._run_decode(f, order))

    def withdraw(self, request: RequestId) -> None:
        f = self._flights.get((request, "prefill"))
        if f is None or f.closed or f.accepted:
            return  # accepted means PrefillStarted went out: the request runs on here
        self._end(f)
        self.stats["withdrawn"] += 1
        self.bus.publish(Withdrawn(request, self.node, self.clock.now()))

    def abort(self, request: RequestId) -> None:
        for kind in ("prefill", "decode"):
            f = self._flights.get((request, kind))
            if f is not None and not f.closed:
                self._end(f)
                self.stats["aborted"] += 1

    def switch_phase(self, phase: Phase) -> None:
        self._spawn(self._run_switch(phase))

    def push_hints(self, delta: HintDelta) -> None:
        if self.info is None or self._down:
            return
        if self.info.hints_path is None:
            # Stock SGLang has no count-aware eviction to hint; request priority is what it
            # can take (see requests.priority_for).
            self.stats["hints_unsupported"] += 1
            return
        self._hints.add(delta)
        if self._hint_task is None:
            self._hint_task = self._spawn(self._send_hints())

    # -- requests ------------------------------------------------------------------------------

    def _priority(self, final: bool) -> int | None:
        info = self.info
        if info is not None and info.priority_eviction and info.priority_allowed:
            return priority_for(final)
        return None

    def _fetch_hints(self, order: PrefillOrder) -> dict | None:
        """The fetch plan as the patched engine takes it (``kv_hints``), peers named by their
        pool servers; None for stock SGLang, which cannot pull KV from a peer's host memory
        (the engine recomputes those blocks). A run from a peer without a pool ends the plan:
        what follows could not attach to the prefix."""
        if not order.fetch:
            return None
        runs = []
        if self.info is not None and self.info.fetch:
            for r in order.fetch:
                peer = self.pairs.pool(r.peer)
                if peer is None:
                    break
                runs.append(FetchRunWire(peer, r.start, list(r.blocks)))
        if not runs:
            self.stats["fetch_plans_ignored"] += 1
            return None
        self.stats["fetch_plans_sent"] += 1
        return fetch_kv_hints(FetchPlan(self.page_size, runs), str(order.request))

    async def _run_prefill(self, f: _Leg, order: PrefillOrder) -> None:
        body = generate_body(order.tokens, order.sampling, f.rid, f.bootstrap,
                             self._priority(order.final), self._fetch_hints(order),
                             prefill=True)
        done = False
        try:
            async with self._session.post(self.url + "/generate", json=body) as resp:
                if resp.status != 200:
                    self._fail(f, from_http(resp.status, await resp.read(), "prefill"))
                    return
                f.accepted = True
                if f.closed:
                    return
                self.bus.publish(PrefillStarted(f.request, self.node, self.clock.now()))
                async for item in self._chunks(resp):
                    if isinstance(item, StreamError):
                        self._fail(f, Failure(f"prefill: {item.message}", status=item.code))
                        return
                    fin = item.meta_info.finish_reason
                    if fin is None:
                        continue
                    if fin.type == "abort":
                        self._fail(f, Failure(f"prefill aborted by the engine: "
                                              f"{fin.message or 'no reason given'}",
                                              status=fin.status_code))
                        return
                    done = True
                    self._prefill_done(f, item, order.sampling.prompt_logprobs)
                if not done:
                    self._fail(f, Failure("prefill: the engine ended the stream without a "
                                          "result", unreachable=True))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped into a clear failure at the boundary
            self._fail(f, from_exception(exc, "prefill"))
        finally:
            self.pairs.prefill_over(f.request, self.node, f.bootstrap.room)
            if not done:
                self.pairs.close(f.request, self.node, f.bootstrap.room)
            self._forget(f)

    def _prefill_done(self, f: _Leg, chunk: Chunk, prompt: bool) -> None:
        if f.closed:
            return
        f.closed = True
        meta = chunk.meta_info
        cached = min(meta.cached_tokens, meta.prompt_tokens)
        computed = meta.prompt_tokens - cached
        # The engine patch says how much of the cached prefix it pulled from peers and how
        # much it loaded from host memory (t_rst of the iteration model); stock SGLang: 0.
        fetched, restored = restored_tokens(meta.cached_tokens_details)
        fetched, restored = min(fetched, cached), min(restored, cached)
        self.stats["fetched_tokens"] += fetched
        self.stats["restored_tokens"] += restored
        self._loads.prefill_finished(f.request, computed, cached, restored)
        self.bus.publish(PrefillDone(f.request, self.node, self.clock.now(), cached=cached,
                                     fetched=fetched, computed=computed,
                                     fetch_s=fetch_seconds(meta.cached_tokens_details)
                                     if fetched else 0.0,
                                     prompt_logprobs=prompt_logprobs(meta) if prompt else None))

    async def _run_decode(self, f: _Leg, order: DecodeOrder) -> None:
        body = generate_body(order.tokens, order.sampling, f.rid, f.bootstrap,
                             self._priority(order.final))
        cursor = OutputCursor()
        # The prompt's log-probabilities come with the prefill's answer, before any output.
        wait = order.sampling.prompt_logprobs
        try:
            async with self._session.post(self.url + "/generate", json=body) as resp:
                if resp.status != 200:
                    self._fail(f, from_http(resp.status, await resp.read(), "decode"))
                    return
                f.accepted = True
                async for item in self._chunks(resp):
                    if f.closed:
                        return
                    if isinstance(item, StreamError):
                        self._fail(f, Failure(f"decode: {item.message}", status=item.code))
                        return
                    fin = item.meta_info.finish_reason
                    if fin is not None and fin.type == "abort":
                        self._fail(f, Failure(f"decode aborted by the engine: "
                                              f"{fin.message or 'no reason given'}",
                                              status=fin.status_code))
                        return
                    tokens = cursor.new_tokens(item)
                    logprobs = cursor.new_logprobs(item)
                    if wait and tokens:
                        wait = False
                        await self.pairs.wait_prefill(f.request, f.source, f.bootstrap.room,
                                                      self.settings.finish_wait_s)
                        if f.closed:
                            return
                    if fin is None:
                        if tokens:
                            self.bus.publish(TokensOut(f.request, self.node, self.clock.now(),
                                                       tokens, logprobs=logprobs))
                        continue
                    # The last chunk: let the prefill half report first, so the request's
                    # record carries its cached tokens.
                    await self.pairs.wait_prefill(f.request, f.source, f.bootstrap.room,
                                                  self.settings.finish_wait_s)
                    if f.closed:
                        return
                    f.closed = True
                    self.bus.publish(TokensOut(f.request, self.node, self.clock.now(), tokens,
                                               finish="length" if fin.type == "length"
                                               else "stop", logprobs=logprobs))
                    return
                self._fail(f, Failure("decode: the engine ended the stream without a finish",
                                      unreachable=True))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped into a clear failure at the boundary
            self._fail(f, from_exception(exc, "decode"))
        finally:
            self.pairs.close(f.request, f.source, f.bootstrap.room)
            self._forget(f)

    async def _chunks(self, resp: aiohttp.ClientResponse):
        """The parsed chunks of an SSE stream, up to ``[DONE]``."""
        async for line in resp.content:
            item = parse_sse_line(line)
            if item is None:
                continue
            if item is DONE:
                return
            yield item

    def _fail(self, f: _Leg, failure: Failure) -> None:
        if failure.unreachable and not self._stopping:
            self._spawn(self._probe())
        if f.closed:
            return
        f.closed = True
        self.stats["failed"] += 1
        # A prefill the engine never accepted has not started: the service may route it again.
        started = f.kind == "decode" or f.accepted
        log.warning("sglang_request_failed", node=self.node, request=f.request, kind=f.kind,
                    started=started, error=failure.message)
        self.bus.publish(RequestFailed(f.request, self.node, self.clock.now(),
                                       f"{self.node}: {failure.message}", started,
                                       failure.rejected))

    def _end(self, f: _Leg) -> None:
        """Stop a flight quietly (abort, withdraw): cancel its stream, tell the engine."""
        f.closed = True
        if f.task is not None:
            f.task.cancel()
        if f.kind == "prefill":
            self.pairs.prefill_over(f.request, self.node, f.bootstrap.room)
            self.pairs.close(f.request, self.node, f.bootstrap.room)
        self._forget(f)
        if f.accepted or f.kind == "prefill":
            # The engine may hold it (a prefill waits in its bootstrap queue): free it there.
            self._spawn(self._abort_on_engine(f.rid))

    def _forget(self, f: _Leg) -> None:
        key = (f.request, f.kind)
        if self._flights.get(key) is f:
            del self._flights[key]

    async def _abort_on_engine(self, rid: str) -> None:
        if self._down or self._session is None or self._session.closed:
            return
        try:
            async with self._session.post(
                    self.url + "/abort_request", json={"rid": rid},
                    timeout=aiohttp.ClientTimeout(total=self.settings.abort_timeout_s)) as r:
                await r.read()
        except Exception as exc:  # noqa: BLE001 - best effort: the engine may be gone
            log.debug("sglang_abort_failed", node=self.node, rid=rid, error=str(exc))

    # -- phase switch ----------------------------------------------------------------------

    async def _run_switch(self, phase: Phase) -> None:
        s = self.settings
        body: dict[str, Any] = {"new_role": phase.value}
        if phase is Phase.DECODE:
            # Required when the engine would capture decode CUDA graphs (none on CPU or with
            # --disable-cuda-graph); 0 skips the headroom check.
            body["decode_cuda_graph_memory_gb"] = 0
        deadline = self.clock.now() + s.switch_retry_s
        clears_before = self._engine_clears
        in_place = self.info is not None and self.info.switch_in_place
        wait_s = switch_wait_s(s, self.info.drain_timeout_s if in_place else None)
        while True:
            try:
                async with self._session.post(
                        self.url + "/pd_role_switch", json=body,
                        timeout=aiohttp.ClientTimeout(total=wait_s)) as resp:
                    raw = await resp.read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._mark_down(from_exception(exc, f"role switch to {phase.value}").message)
                return
            try:
                answer = msgspec.json.decode(raw, type=_SwitchAnswer)
            except (msgspec.DecodeError, msgspec.ValidationError):
                answer = _SwitchAnswer(False, engine_message(raw))
            if answer.success:
                break
            if answer.safe_to_restore and "not idle" in answer.message \
                    and self.clock.now() < deadline:
                log.info("sglang_switch_retry", node=self.node, to=phase.value,
                         reason=answer.message)
                await self._sleep(0.25)
                continue
            # The router drained the node for the new phase and will not route its old one:
            # a node that cannot switch serves nothing, and says so.
            self._mark_down(f"role switch to {phase.value} refused: {answer.message}")
            return
        if not in_place:
            waited = 0.0
            while self._engine_clears == clears_before and waited < s.clear_wait_s:
                await self._sleep(0.02)
                waited += 0.02
        # (A patched engine drained by itself and kept its cache: nothing to wait for.)
        self.phase = phase
        self.stats["switches"] += 1
        self.bus.publish(PhaseSwitched(self.node, phase.value, self.clock.now()))
        if in_place:
            self._spawn(self._log_switch(phase))
        else:
            log.info("sglang_switched", node=self.node, phase=phase.value, in_place=False,
                     cache_cleared=self._engine_clears != clears_before)

    async def _log_switch(self, phase: Phase) -> None:
        """Log the patched engine's own record of the switch it just made (its drain and
        switch time, measured from the moment it took the decision)."""
        timing: dict[str, Any] = {}
        try:
            async with self._session.get(
                    self.url + STATUS_PATH,
                    timeout=aiohttp.ClientTimeout(total=self.settings.poll_timeout_s)) as r:
                status = await r.json(content_type=None) if r.status == 200 else {}
            rec = (status.get("switch") or {}).get("history", [])[-1]
            timing = {k: rec[k] for k in ("drain_s", "rebuild_s", "switch_s")}
        except Exception:  # noqa: BLE001 - a log detail only
            pass
        log.info("sglang_switched", node=self.node, phase=phase.value, in_place=True, **timing)

    # -- KV events -------------------------------------------------------------------------

    def _on_kv_batch(self, seq: int, batch: KVEventBatch) -> None:
        if self._down:
            return
        self.stats["kv_batches"] += 1
        if any(type(e) is AllBlocksCleared for e in batch.events):
            if self._resync_awaited:  # the engine republishing its cache, as we asked
                self._resync_awaited = False
                self.stats["kv_resync_received"] += 1
            else:
                self._engine_clears += 1
        self.bus.publish(NodeKVEvents(self.node, seq, batch))

    def _on_kv_clear(self, reason: str, emptied: bool) -> None:
        """Our view of the node's stream broke (``kvstream``): the directory forgets what it
        lists on the node (it may list blocks the engine dropped meanwhile) and keeps the
        branches' counts there, and a patched engine is asked for all of it again. An engine
        that started over (``emptied``) lost its blocks: that is an eviction of all of them."""
        if self._down:
            return
        self.stats["kv_resyncs"] += 1
        if emptied:
            self.bus.publish(NodeKVEvents(self.node, -1, KVEventBatch(time.time(),
                                                                      [AllBlocksCleared()])))
        else:
            self.bus.publish(NodeKVViewLost(self.node, reason))
        self._ask_resync()

    # -- load, health ----------------------------------------------------------------------

    async def _watch(self) -> None:
        """Poll the engine while it is up; once it is down, wait for it to come back."""
        while True:
            await self._poll_loads()
            await self._rejoin()

    async def _rejoin(self) -> None:
        """Look for the engine until it answers discovery again (a restart: its KV is empty,
        its KV event sequence starts over), then serve it."""
        said = None
        while True:
            await self._sleep(self.settings.rejoin_interval_s)
            try:
                info = await self._discover()
            except EvinfraError as exc:  # not answering (EngineError), or unusable now
                if exc.message != said:
                    said = exc.message
                    log.warning("sglang_engine_still_down", node=self.node, reason=said)
                continue
            break
        self._down = False
        self._loads = LoadsTracker(self.node)
        self._iterations = IterationTracker(self.node)
        log.info("sglang_engine_back", node=self.node, url=self.url)
        self.bus.publish(NodeUp(self.node, self.clock.now()))
        self._connect(info)

    async def _poll_loads(self) -> None:
        s = self.settings
        failing_since: float | None = None
        while not self._down:
            now = self.clock.now()
            try:
                load = parse_loads(await self._get(LOADS_PATH, "load poll"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                failure = exc.failure if isinstance(exc, _HTTPFailure) else \
                    from_exception(exc, "load poll")
                if failing_since is None:
                    failing_since = now
                refused = isinstance(exc, aiohttp.ClientConnectorError)
                if refused or now - failing_since >= s.down_after_s:
                    self._mark_down(failure.message)
                    return
            else:
                failing_since = None
                self._report(load, now)
                if self.info.iterations is not None:
                    await self._poll_iterations()
            await self._sleep(s.poll_interval_s)

    async def _poll_iterations(self) -> None:
        """The patched engine's forward passes since the last poll, each the planner's
        report (``iterations``). A failed read is logged once per kind and tried again at the
        next poll (the engine keeps its last passes meanwhile)."""
        tracker = self._iterations
        try:
            got = decode_iterations(await self._get(self.info.iterations, "iteration log",
                                                    after=str(tracker.after)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the planner waits for the next poll
            why = exc.failure.message if isinstance(exc, _HTTPFailure) else str(exc)
            if why != self._iterations_failed:
                self._iterations_failed = why
                log.warning("sglang_iterations_failed", node=self.node, error=why)
            return
        self._iterations_failed = None
        missed = tracker.missed
        for report in tracker.take(got, self.clock.now(), time.time()):
            self.stats["iteration_reports"] += 1
            self.bus.publish(report)
        self.stats["iterations_missed"] += tracker.missed - missed

    async def _get(self, path: str, what: str, **params: str) -> bytes:
        """The body of ``GET path`` (``what`` names it in errors); raises ``_HTTPFailure``
        for an answer that is not 200."""
        async with self._session.get(
                self.url + path, params=params,
                timeout=aiohttp.ClientTimeout(total=self.settings.poll_timeout_s)) as r:
            raw = await r.read()
            if r.status != 200:
                raise _HTTPFailure(from_http(r.status, raw, what))
            return raw

    def _report(self, load, now: float) -> None:
        prev = self._loads.last
        report = self._loads.prefill_report(load, prev, now)
        decode = self._loads.decode_report(load, now)
        state = self._loads.state(load, now, time.time())
        if load.phase is not None and load.phase is not self.phase:
            log.warning("sglang_role_mismatch", node=self.node, engine=load.phase.value,
                        driver=self.phase.value if self.phase else None)
        self.stats["state_reports"] += 1
        self.bus.publish(state)
        if self.info.iterations is not None:
            return  # the engine's own log reports every pass (_poll_iterations)
        for r in (report, decode):
            if r is not None:
                self.stats["iteration_reports"] += 1
                self.bus.publish(r)

    async def _probe(self) -> None:
        """A request saw the engine fail: is it gone? A refused connection says so at once;
        anything slower is left to the load poller's ``down_after_s``."""
        if self._down:
            return
        try:
            async with self._session.get(
                    self.url + "/health",
                    timeout=aiohttp.ClientTimeout(total=self.settings.poll_timeout_s)) as r:
                await r.read()
        except aiohttp.ClientConnectorError as exc:
            self._mark_down(from_exception(exc, "health probe").message)
        except Exception:  # noqa: BLE001 - slow or odd: the poller decides
            pass

    def _mark_down(self, reason: str) -> None:
        if self._down or self._stopping:
            return
        self._down = True
        now = self.clock.now()
        log.error("sglang_engine_down", node=self.node, url=self.url, reason=reason)
        self.bus.publish(NodeDown(self.node, now, f"{self.node} ({self.url}): {reason}"))
        # What was still running here is lost with the engine.
        for f in list(self._flights.values()):
            if not f.closed:
                self._fail(f, Failure(f"engine down: {reason}"))
                if f.task is not None:
                    f.task.cancel()
        # A restarted engine has no marks; the service resyncs one that comes back.
        self._hints.clear()
        self._resync_wanted = self._resync_awaited = False
        # The directory dropped the node's blocks (NodeDown): stop feeding it more.
        if self._kv_task is not None:
            self._kv_task.cancel()
        if self._kv is not None:
            self._loop.call_soon(self._kv.close)  # after the cancelled task has unwound

    # -- hints -----------------------------------------------------------------------------

    async def _send_hints(self) -> None:
        """Send what waits in the outbox, one message at a time (see ``hints``), until it is
        empty or the engine is down."""
        try:
            await self._deliver("hints", self.info.hints_path, lambda: bool(self._hints),
                                self._hints.take, self._hints.put_back)
        finally:
            self._hint_task = None

    def _ask_resync(self) -> None:
        """Ask a patched engine to republish its whole cache on its KV event stream: our view
        of the node was just cleared (``kvstream``), and its answer, in order with the rest of
        the stream, rebuilds it (``AllBlocksCleared``, then every page it holds)."""
        if self.info is None or self.info.kv_resync is None or self._down:
            return
        self._resync_wanted = True
        if self._resync_task is None:
            self._resync_task = self._spawn(self._send_resync())

    async def _send_resync(self) -> None:
        def take() -> None:
            self._resync_wanted = False
            self._resync_awaited = True

        def put_back(_: object) -> None:
            self._resync_wanted = True

        try:
            await self._deliver("kv_resync", self.info.kv_resync,
                                lambda: self._resync_wanted, take, put_back)
        finally:
            self._resync_task = None

    async def _deliver(self, what: str, path: str, pending: Callable[[], bool],
                       take: Callable[[], Any], put_back: Callable[[Any], None]) -> None:
        """POST ``take()`` to ``path`` while ``pending()`` and the engine is up. A message
        that did not land is put back, to be sent again (merged with what came since) after
        ``poll_interval_s``; the failure is logged once per kind, not once per retry."""
        said = None
        while pending() and not self._down:
            msg = take()
            failed = await self._post_control(what, path, msg)
            if failed is None:
                said = None
                continue
            put_back(msg)
            self.stats[f"{what}_retried"] += 1
            if failed != said:
                said = failed
                log.warning(f"sglang_{what}_failed", node=self.node, error=failed)
            await self._sleep(self.settings.poll_interval_s)

    async def _post_control(self, what: str, path: str, msg: msgspec.Struct | None
                            ) -> str | None:
        """POST one message (``msg`` None: no body); None once it is done with (taken, or
        refused as malformed: sending it again would not help), else why to try again."""
        try:
            async with self._session.post(
                    self.url + path, data=msgspec.json.encode(msg) if msg is not None else b"",
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=self.settings.poll_timeout_s)) as r:
                if r.status == 200:
                    self.stats[f"{what}_sent"] += 1
                    return None
                error = engine_message(await r.read())
                if 400 <= r.status < 500:
                    self.stats[f"{what}_refused"] += 1
                    log.warning(f"sglang_{what}_refused", node=self.node, status=r.status,
                                error=error)
                    return None
                return f"HTTP {r.status}: {error}"
        except Exception as exc:  # noqa: BLE001 - not answered: the poller judges the engine
            return str(exc) or type(exc).__name__

    # -- plumbing ----------------------------------------------------------------------------

    async def _discover(self) -> EngineInfo:
        s = self.settings
        deadline = self.clock.now() + s.discovery_timeout_s
        last: Failure | None = None
        waited = False
        while True:
            try:
                bodies = []
                for path in ("/server_info", "/model_info"):
                    async with self._session.get(
                            self.url + path,
                            timeout=aiohttp.ClientTimeout(total=s.poll_timeout_s * 5)) as r:
                        raw = await r.read()
                        if r.status != 200:
                            raise _HTTPFailure(from_http(r.status, raw, path))
                        bodies.append(raw)
                return parse_engine_info(self.node, self.url, bodies[0], bodies[1],
                                         self.page_size)
            except _HTTPFailure as exc:
                last = exc.failure
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = from_exception(exc, "discovery")
            if self.clock.now() >= deadline:
                raise EngineError(self.node, f"not usable at {self.url} after "
                                  f"{s.discovery_timeout_s:g} s: {last.message}")
            if not waited:  # say once why the start waits (an engine still loading, say)
                waited = True
                log.info("sglang_engine_waiting", node=self.node, url=self.url,
                         reason=last.message, gives_up_in_s=s.discovery_timeout_s)
            await self._sleep(0.5)

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)
        return t

    def _task_done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("sglang_driver_task_failed", node=self.node, error=repr(t.exception()))

    async def _sleep(self, delay: float) -> None:
        """Sleep on the driver's clock (the wall clock: real engines)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        timer = self.clock.call_later(delay, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            timer.cancel()


class _SwitchAnswer(msgspec.Struct):
    success: bool = False
    message: str = ""
    safe_to_restore: bool = False


class _HTTPFailure(Exception):
    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure
