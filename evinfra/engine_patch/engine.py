"""The patch inside one SGLang scheduler: the parts, built when the scheduler is, and the
calls the hooks make into them (engine process only).

:class:`EnginePatch` is attached to the scheduler as ``scheduler._evinfra``. It owns

* the in-place switch (:mod:`~evinfra.engine_patch.switch`), in both roles;
* the count-aware host order (:mod:`~evinfra.engine_patch.eviction`), fed by count hints;
* the pool server (:mod:`~evinfra.engine_patch.pool`), in both roles;
* the fetcher (:mod:`~evinfra.engine_patch.fetch`), acting in the prefill role only;
* the KV resync: on the control plane's call, its whole cache republished as KV events;
* the iteration log (:mod:`~evinfra.engine_patch.iterations`): each forward pass, timed.

What needs the host tier (eviction, pool, fetch) is off, with a logged reason, when the
engine runs without ``--enable-hierarchical-cache``, on SGLang's native TreeCore, with
pipeline or data parallelism, or with a host layout the pool cannot address. With tensor
parallelism each rank serves its shard of the pool and reads its shard of a peer's, the ranks
deciding each step together (``pool``, ``fetch``, ``ranks``).

:meth:`tick` runs once per scheduler loop iteration (after SGLang processed its inputs).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import msgspec

from evinfra.engine_patch import tree_ops
from evinfra.engine_patch.eviction import CountAwareHostOrder
from evinfra.engine_patch.iterations import IterationRecorder
from evinfra.engine_patch.settings import PatchSettings
from evinfra.engine_patch.switch import SwitchController, running_requests
from evinfra.engine_patch.wire import (COUNT_HINTS_PATH, FETCH_ACTION, FETCH_VERSION,
                                       ITERATIONS_PATH, KV_RESYNC_PATH, CountHints, PatchInfo,
                                       WireError)

__all__ = ["EnginePatch", "PATCH_VERSION"]

log = logging.getLogger("evinfra.engine_patch")

PATCH_VERSION = "1"


class EnginePatch:
    def __init__(self, scheduler: Any, settings: PatchSettings) -> None:
        self.scheduler = scheduler
        self.settings = settings
        self.disabled: dict[str, str] = {}
        self.switch = (SwitchController(scheduler, settings.drain_timeout_s)
                       if settings.on("switch") else None)
        self.counts: CountAwareHostOrder | None = None
        self.pool = None
        self.fetcher = None
        self.hints_received = 0
        self.hints_rejected = 0
        self.kv_resyncs = 0
        self.iterations = IterationRecorder() if settings.on("iterations") else None
        self.iteration_failed = False
        host_problem = self._host_tier_problem()
        for part in ("evict", "pool", "fetch"):
            if not settings.on(part):
                self.disabled[part] = "not in EVINFRA_PATCH_FEATURES"
            elif host_problem:
                self.disabled[part] = host_problem
        if "evict" not in self.disabled:
            self.counts = CountAwareHostOrder()
        if "pool" not in self.disabled:
            self._start_pool()
        if "fetch" not in self.disabled and self.pool is not None:
            from evinfra.engine_patch.fetch import Fetcher

            self.fetcher = Fetcher(scheduler, self.pool.engine, self.pool.layout,
                                   settings.fetch_timeout_s, settings.lease_ttl_s,
                                   self.pool.shards, self.pool.rank, self._tp_group())
        elif "fetch" not in self.disabled:
            self.disabled["fetch"] = "needs the pool: " + self.disabled.get("pool", "off")
        for part, why in self.disabled.items():
            log.warning("evinfra engine patch: %s off: %s", part, why)
        log.info("evinfra engine patch on: %s", json.dumps(msgspec.to_builtins(self.info())))

    def _host_tier_problem(self) -> str:
        s = self.scheduler
        tc = s.tree_cache
        if not getattr(s, "enable_hierarchical_cache", False) or \
                getattr(tc, "cache_controller", None) is None:
            return "no host tier (launch with --enable-hierarchical-cache)"
        if not tree_ops.is_python_core(tc):
            return ("the radix tree runs on SGLang's native TreeCore (set "
                    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python; the plugin does unless "
                    "it was set otherwise)")
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        if par.pp_size != 1 or (par.dp_size or 1) != 1:
            return (f"pp={par.pp_size} dp={par.dp_size}: the pool serves one TP group per "
                    "engine (its ranks in step)")
        return ""

    def _start_pool(self) -> None:
        from evinfra.engine_patch.pool import PoolServer, transfer_engine

        def open_engine() -> tuple[Any, str, str]:
            engine = transfer_engine()
            bind, advertise = self.settings.pool_endpoint(self.scheduler.server_args.host,
                                                          engine.get_session_id())
            return engine, bind, advertise

        try:
            self.pool = PoolServer(self.scheduler.tree_cache, open_engine,
                                   self.settings.pool_port, self._tp_group())
        except Exception as exc:  # noqa: BLE001 - the rest of the patch still works
            # (On every rank alike: a rank that failed fails the pool of all of them.)
            log.exception("evinfra pool server failed to start")
            self.disabled["pool"] = f"failed to start: {exc}"

    def _tp_group(self) -> Any:
        return getattr(self.scheduler, "tp_cpu_group", None)

    # -- what the engine advertises --------------------------------------------------------

    def info(self) -> PatchInfo:
        return PatchInfo(
            version=PATCH_VERSION, switch_in_place=self.switch is not None,
            count_hints=COUNT_HINTS_PATH if self.counts is not None else None,
            fetch_action=f"{FETCH_ACTION}/{FETCH_VERSION}" if self.fetcher else None,
            pool=self.pool.address if self.pool is not None else None,
            host_tier="evict" not in self.disabled or "pool" not in self.disabled,
            kv_resync=(KV_RESYNC_PATH if tree_ops.can_republish(self.scheduler.tree_cache)
                       else None),
            iterations=ITERATIONS_PATH if self.iterations is not None else None,
            drain_timeout_s=self.settings.drain_timeout_s if self.switch is not None else None)

    def init_info(self) -> dict:
        info = self.info()
        out = {"evinfra_engine_patch": msgspec.to_builtins(info)}
        if info.count_hints:
            out["evinfra_count_hints"] = info.count_hints
        return out

    def status(self) -> dict:
        s = self.scheduler
        out: dict[str, Any] = {"info": msgspec.to_builtins(self.info()),
                               "role": s.disaggregation_mode.value,
                               "disabled": self.disabled, "time": time.time(),
                               "running": running_requests(s),
                               "waiting": len(s.waiting_queue),
                               "kv_resyncs": self.kv_resyncs}
        if self.switch is not None:
            out["switch"] = {"draining": self.switch.draining,
                             "history": [msgspec.to_builtins(r) for r in self.switch.history]}
        if self.counts is not None:
            out["eviction"] = {"positive_blocks": len(self.counts.positive),
                               "hints_applied": self.counts.hints_applied,
                               "hints_rejected": self.hints_rejected,
                               **self.counts.stats.snapshot()}
        if self.pool is not None:
            out["pool"] = self.pool.status()
        if self.fetcher is not None:
            out["fetch"] = self.fetcher.status()
        host = getattr(getattr(s.tree_cache, "cache_controller", None), "mem_pool_host", None)
        if host is not None:
            out["host_tier"] = {"slots": host.size, "free": host.available_size()}
        return out

    # -- control messages (from the HTTP process) -------------------------------------------

    def on_control(self, payload: str) -> None:
        try:
            msg = json.loads(payload)
            kind = msg.get("kind")
            if kind not in ("hints", "kv_resync"):
                raise WireError(f"unknown control message {kind!r}")
            hints = msgspec.convert(msg.get("body"), CountHints) if kind == "hints" else None
        except (ValueError, msgspec.ValidationError, TypeError, AttributeError) as exc:
            self.hints_rejected += 1
            log.warning("evinfra control message dropped: %s", exc)
            return
        if hints is None:
            self.kv_resync()
            return
        self.hints_received += 1
        if self.counts is not None:
            self.counts.apply(hints)

    def kv_resync(self) -> None:
        """Republish the whole cache as KV events (``wire``: KV resyncs); the scheduler's
        publisher sends them with its next batch."""
        if not tree_ops.can_republish(self.scheduler.tree_cache):
            log.warning("evinfra kv resync asked of an engine that cannot republish its cache")
            return
        try:
            pages = tree_ops.republish(self.scheduler.tree_cache)
        except Exception:  # noqa: BLE001 - the control plane undercounts the node, no worse
            log.exception("evinfra kv resync failed")
            return
        self.kv_resyncs += 1
        log.info("evinfra kv resync: %d pages republished (device and host)", pages)

    # -- forward passes --------------------------------------------------------------------

    def on_batch_done(self, batch: Any, result: Any) -> None:
        """Record a forward pass once its result is processed, launched at SGLang's
        ``launch_ts`` (``iterations`` times it). A decode pass with speculative decoding
        feeds each request its draft tokens and accepts the correct ones plus one."""
        launched = getattr(batch, "launch_ts", None)
        if launched is None:
            return
        done, wall = time.monotonic(), time.time()
        mode = batch.forward_mode
        if mode.is_extend():
            self.iterations.prefill(launched, done, wall, [
                (req.rid, int(t_uc), int(t_c), int(req.host_loaded_length))
                for req, t_uc, t_c in zip(batch.reqs, batch.extend_lens, batch.prefix_lens)])
        elif mode.is_decode():
            n = len(batch.reqs)
            drafts = getattr(result, "num_correct_drafts", 0) or 0
            t_fwd = getattr(result, "speculative_num_draft_tokens", None) or 1
            self.iterations.decode(launched, done, wall, n, t_fwd, n + drafts)

    # -- every loop iteration ------------------------------------------------------------

    def tick(self) -> bool:
        """True when the scheduler loop must restart (a switch flipped the role)."""
        if self.fetcher is not None:
            self.fetcher.tick()
        if self.switch is not None:
            return self.switch.tick()
        return False

    def is_prefill(self) -> bool:
        from sglang.srt.disaggregation.utils import DisaggregationMode

        return self.scheduler.disaggregation_mode == DisaggregationMode.PREFILL
