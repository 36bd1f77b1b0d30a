"""The SGLang plugin: entry point ``evinfra_engine_patch`` in group ``sglang.srt.plugins``.

SGLang calls :func:`register` in every process it starts (server, scheduler, detokenizer),
then applies the hooks registered through ``sglang.srt.plugins.hook_registry.HookRegistry``.
Without ``EVINFRA_ENGINE_PATCH=1`` nothing is registered: the engine is stock SGLang.

This module is the only one that names SGLang targets. Each hook is a thin shim that finds
the scheduler's :class:`~evinfra.engine_patch.engine.EnginePatch` (``scheduler._evinfra``)
and calls it; with no patch object (its construction failed) the original runs alone.

========================================================  ======  ===========================
target (``sglang.srt.`` omitted)                          type    why
========================================================  ======  ===========================
entrypoints.http_server.launch_server                     BEFORE  add /evinfra/* routes
managers.scheduler.Scheduler.__init__                     AFTER   build the EnginePatch
managers.scheduler.Scheduler.get_init_info                AFTER   advertise in /server_info
managers.scheduler.Scheduler.get_internal_state           AFTER   status for /evinfra/status
managers.scheduler.Scheduler.handle_rpc_request           AROUND  count hints and peers'
                                                                  pool messages arrive here
managers.scheduler.Scheduler._poll_timeout_aborts         AFTER   rank 0 hands the pool's
                                                                  messages to every rank
managers.scheduler.Scheduler.process_input_requests       AFTER   once per loop: tick
managers.scheduler.Scheduler.handle_pd_role_switch        AROUND  in-place switch
disaggregation.role_switch._release_prefix_cache_for...   AROUND  keep the cache on a flip
managers.scheduler.Scheduler._add_request_to_queue        AROUND  refuse while draining;
                                                                  start fetches (prefill)
disaggregation.prefill.PrefillBootstrapQueue              AFTER   park requests whose
  .pop_bootstrapped                                               fetch is not loaded yet
managers.scheduler.Scheduler.is_fully_idle                AFTER   parked/fetching = not idle
managers.scheduler.Scheduler.abort_request                BEFORE  abort reaches parked reqs
managers.scheduler.Scheduler.run_batch                    BEFORE  prefill start times
managers.scheduler.Scheduler.process_batch_result         AFTER   the iteration log
managers.scheduler_components.output_streamer             AFTER   fetched/restored tokens
  .SchedulerOutputStreamer.get_cached_tokens_details              in meta_info
disaggregation.decode_hicache_mixin                       AFTER   decode never loads from
  .DecodeHiCachePreallocMixin._build_decode_prefix_match          host (D.6)
mem_cache.unified_cache.components.full.FullComponent     AROUND  host eviction order
  .drive_host_eviction                                            (1[R>0], T_b)
mem_cache.pool_host.common._cuda_host_register            AROUND  CPU: no pinning
mem_cache.pool_host.mha.MHATokenToKVPoolHost              AROUND  CPU: torch copies
  .load_to_device_per_layer / .backup_from_device_all_layer
========================================================  ======  ===========================
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from typing import Any, Callable

import msgspec

from evinfra.engine_patch import compat
from evinfra.engine_patch.settings import ENABLE_ENV, PatchSettings, enabled

__all__ = ["register"]

log = logging.getLogger("evinfra.engine_patch")

_SETTINGS: PatchSettings | None = None
_PATCH: Any = None  # the EnginePatch of this scheduler process
_TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
_REGISTERED: list[str] = []  # the targets this process registered hooks on


def register() -> None:
    """SGLang's plugin entry point.

    Checks this SGLang against the patch (:mod:`~evinfra.engine_patch.compat`) before it
    registers anything: on a mismatch the process exits with the list of problems (SGLang's
    loader catches exceptions, not ``SystemExit``), or, with ``EVINFRA_PATCH_ON_MISMATCH=
    stock``, registers nothing after a loud warning. The server process checks every target
    of every process, so a wrong SGLang stops before any engine process starts."""
    global _SETTINGS
    server = multiprocessing.parent_process() is None
    if not enabled():
        if server:
            # SGLang loads plugins before it configures logging: say it on stderr, once.
            print(f"evinfra engine patch: installed, disabled ({ENABLE_ENV} is not 1): "
                  "no hook registered, stock SGLang", file=sys.stderr, flush=True)
        return
    _SETTINGS = settings = PatchSettings.from_env()
    if not server and "sglang.srt.managers.scheduler" not in sys.modules:
        return  # detokenizer and other helpers: nothing to patch there
    table = hook_table(settings)
    mine = [h for h in table if (h[3] == "server") == server]
    if not _fits(settings, [h[0] for h in (table if server else mine)]):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if (settings.on("evict") or settings.on("pool")) and _TREE_CORE_ENV not in os.environ:
        # The host-eviction hook and the pool's tree walks need the Python TreeCore (see
        # tree_ops); children inherit the variable.
        os.environ[_TREE_CORE_ENV] = "python"
    for target, fn, kind, _ in mine:
        HookRegistry.register(target, fn, HookType[kind])
    _REGISTERED[:] = [h[0] for h in mine]
    log.info("evinfra engine patch enabled (%s process, %d hooks): %s",
             "server" if server else "scheduler", len(mine), sorted(settings.features))


def _fits(settings: PatchSettings, targets: list[str]) -> bool:
    """True when the patch fits this SGLang; else exit (refuse) or False (run stock)."""
    from sglang.version import __version__

    found = compat.problems(__version__, targets)
    if not found:
        return True
    return _mismatch(settings, compat.PatchMismatch(found))


def _mismatch(settings: PatchSettings, err: compat.PatchMismatch) -> bool:
    if settings.on_mismatch == "stock":
        banner = "!" * 78
        print(f"{banner}\nWARNING: {err}\nWARNING: {compat.ON_MISMATCH_ENV}=stock: this engine "
              f"runs STOCK SGLang, without the evinfra engine patch.\n{banner}",
              file=sys.stderr, flush=True)
        log.critical("evinfra engine patch NOT applied (%s=stock): %s",
                     compat.ON_MISMATCH_ENV, err.found)
        return False
    print(str(err), file=sys.stderr, flush=True)
    raise SystemExit(str(err))


def hook_table(settings: PatchSettings) -> list[tuple[str, Callable, str, str]]:
    """Every hook the patch registers with ``settings``: ``(target, hook, HookType name,
    process)``, process ``server`` or ``scheduler``."""
    S = "sglang.srt.managers.scheduler.Scheduler."
    out = [("sglang.srt.entrypoints.http_server.launch_server", _before_launch_server,
            "BEFORE", "server")]

    def reg(target: str, fn: Callable, kind: str) -> None:
        out.append((target, fn, kind, "scheduler"))

    reg(S + "__init__", _after_scheduler_init, "AFTER")
    reg(S + "get_init_info", _after_init_info, "AFTER")
    reg(S + "get_internal_state", _after_internal_state, "AFTER")
    reg(S + "handle_rpc_request", _around_rpc, "AROUND")
    if settings.on("pool"):
        reg(S + "_poll_timeout_aborts", _after_poll_timeout_aborts, "AFTER")
    reg(S + "process_input_requests", _after_process_input, "AFTER")
    reg(S + "is_fully_idle", _after_is_fully_idle, "AFTER")
    if settings.on("switch"):
        reg(S + "handle_pd_role_switch", _around_role_switch, "AROUND")
        reg("sglang.srt.disaggregation.role_switch._release_prefix_cache_for_role_switch",
            _around_release_prefix_cache, "AROUND")
    reg(S + "_add_request_to_queue", _around_add_request, "AROUND")
    if settings.on("iterations"):
        reg(S + "process_batch_result", _after_process_batch_result, "AFTER")
    if settings.on("fetch"):
        reg("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
            _after_pop_bootstrapped, "AFTER")
        reg(S + "abort_request", _before_abort, "BEFORE")
        reg(S + "run_batch", _before_run_batch, "BEFORE")
        reg("sglang.srt.managers.scheduler_components.output_streamer."
            "SchedulerOutputStreamer.get_cached_tokens_details", _after_cached_details,
            "AFTER")
    if settings.on("pool") or settings.on("evict"):
        reg("sglang.srt.disaggregation.decode_hicache_mixin.DecodeHiCachePreallocMixin."
            "_build_decode_prefix_match", _after_decode_prefix_match, "AFTER")
    if settings.on("evict"):
        reg("sglang.srt.mem_cache.unified_cache.components.full.FullComponent."
            "drive_host_eviction", _around_drive_host_eviction, "AROUND")
    if settings.on("cpu_host"):
        from evinfra.engine_patch import host_tier  # (torch: engine processes only)

        reg("sglang.srt.mem_cache.pool_host.common._cuda_host_register",
            host_tier.cuda_host_register, "AROUND")
        H = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost."
        reg(H + "load_to_device_per_layer", host_tier.load_to_device_per_layer, "AROUND")
        reg(H + "backup_from_device_all_layer", host_tier.backup_from_device_all_layer,
            "AROUND")
    return out


def _patch_of(scheduler: Any) -> Any:
    return getattr(scheduler, "_evinfra", None)


# -- server process ------------------------------------------------------------------------


def _before_launch_server(*args, **kwargs):
    from sglang.srt.entrypoints import http_server

    from evinfra.engine_patch.control import add_routes

    add_routes(http_server.app)
    return None


# -- scheduler: life cycle and reporting ------------------------------------------------------


def _after_scheduler_init(result, self, *args, **kwargs):
    global _PATCH
    from evinfra.engine_patch.engine import EnginePatch

    from sglang.srt.plugins.hook_registry import HookRegistry

    settings = _SETTINGS or PatchSettings()
    self._evinfra = None
    # SGLang logs a hook it could not apply and carries on: a partial patch is refused here.
    missing = compat.unapplied(_REGISTERED, HookRegistry._patched)
    if missing and _mismatch(settings, compat.PatchMismatch(missing)) is False:
        return None  # (stock: the hooks that did apply find no patch and call the original)
    try:
        self._evinfra = _PATCH = EnginePatch(self, settings)
    except Exception as exc:
        if settings.on_mismatch != "stock":
            raise RuntimeError(f"evinfra engine patch failed to start: {exc} (set "
                               f"{compat.ON_MISMATCH_ENV}=stock to serve stock instead)") from exc
        log.critical("evinfra engine patch failed to start; %s=stock: this engine runs STOCK",
                     compat.ON_MISMATCH_ENV, exc_info=True)
    return None


def _after_init_info(result, self, *args, **kwargs):
    patch = _patch_of(self)
    if patch is not None and isinstance(result, dict):
        result.update(patch.init_info())
    return result


def _after_internal_state(result, self, *args, **kwargs):
    patch = _patch_of(self)
    state = getattr(result, "internal_state", None)
    if patch is not None and isinstance(state, dict):
        try:
            state["evinfra"] = patch.status()
            if patch.iterations is not None:
                state["evinfra_iterations"] = msgspec.to_builtins(patch.iterations.since(-1))
        except Exception as exc:  # noqa: BLE001 - a status read must not fail the call
            state["evinfra"] = {"error": repr(exc)}
    return result


def _around_rpc(original: Callable, self, recv_req):
    from evinfra.engine_patch.control import CONTROL_METHOD
    from evinfra.engine_patch.pool import POOL_METHOD

    method = getattr(recv_req, "method", None)
    if method not in (CONTROL_METHOD, POOL_METHOD):
        return original(self, recv_req)
    patch = _patch_of(self)
    if patch is None:
        return None
    if method == POOL_METHOD:
        if patch.pool is not None:
            patch.pool.on_message(recv_req.parameters or {})
        return None  # rank 0 answers the peer on the pool's own socket
    patch.on_control((recv_req.parameters or {}).get("payload", ""))
    return None  # fire and forget: no reply travels back


def _after_poll_timeout_aborts(result, self, *args, **kwargs):
    """Rank 0 gathers its inputs: the pool's messages from peers join SGLang's own
    (timeout aborts) in the broadcast to every rank, so that every rank pins and unpins the
    same pages in the same iteration (``pool``)."""
    patch = _patch_of(self)
    if patch is None or patch.pool is None:
        return result
    msgs = patch.pool.take_messages()
    if not msgs:
        return result
    from sglang.srt.managers.io_struct import RpcReqInput

    from evinfra.engine_patch.pool import POOL_METHOD

    return [*(result or []), *(RpcReqInput(method=POOL_METHOD, parameters=m) for m in msgs)]


def _after_process_input(result, self, *args, **kwargs):
    patch = _patch_of(self)
    if patch is not None and patch.tick():
        from sglang.srt.disaggregation import role_switch

        raise role_switch.PdRoleSwitchRestart()
    return result


def _after_process_batch_result(result, self, batch, *args, **kwargs):
    patch = _patch_of(self)
    if patch is not None and patch.iterations is not None and batch is not None:
        try:
            patch.on_batch_done(batch, args[0] if args else kwargs.get("result"))
        except Exception:  # noqa: BLE001 - a record lost, never the batch; said once
            if not patch.iteration_failed:
                patch.iteration_failed = True
                log.exception("evinfra iteration record failed (said once)")
    return result


def _after_is_fully_idle(result, self, for_health_check=False, ignore_waiting=False):
    if not result or for_health_check:
        return result
    patch = _patch_of(self)
    if patch is not None and patch.fetcher is not None and patch.fetcher.busy():
        return False
    return result


# -- scheduler: the switch -------------------------------------------------------------------


def _around_role_switch(original: Callable, self, recv_req):
    patch = _patch_of(self)
    if patch is None or patch.switch is None:
        return original(self, recv_req)
    return patch.switch.request(recv_req)


def _around_release_prefix_cache(original: Callable, scheduler):
    patch = _patch_of(scheduler)
    if patch is not None and patch.switch is not None and patch.switch.keep_cache:
        return None  # the in-place switch keeps the tree, the pools and the host tier
    return original(scheduler)


def _around_add_request(original: Callable, self, req, is_retracted: bool = False):
    patch = _patch_of(self)
    if patch is not None and patch.switch is not None and \
            patch.switch.should_refuse(req, is_retracted):
        patch.switch.refuse(req)
        return None
    out = original(self, req, is_retracted)
    if patch is not None and patch.fetcher is not None and not is_retracted and \
            patch.is_prefill() and not req.finished() and req.to_finish is None:
        try:
            patch.fetcher.on_request(req)
        except Exception:  # noqa: BLE001 - the request is prefilled without its fetch
            log.exception("evinfra fetch setup failed for %s", req.rid)
    return out


# -- scheduler: fetches ----------------------------------------------------------------------


def _after_pop_bootstrapped(result, self, *args, **kwargs):
    patch = _PATCH
    if patch is None or patch.fetcher is None or not result:
        return result
    return patch.fetcher.hold(result)


def _before_abort(self, recv_req):
    patch = _patch_of(self)
    if patch is not None and patch.fetcher is not None and patch.fetcher.parked:
        patch.fetcher.unpark_matching(None if recv_req.abort_all else recv_req.rid)
    return None


def _before_run_batch(self, batch, *args, **kwargs):
    patch = _patch_of(self)
    if patch is not None and patch.fetcher is not None and batch is not None:
        mode = getattr(batch, "forward_mode", None)
        if mode is not None and mode.is_extend():
            patch.fetcher.on_prefill_start(batch.reqs)
    return None


def _after_cached_details(result, self, req, *args, **kwargs):
    patch = _PATCH
    if patch is None or patch.fetcher is None:
        return result
    extra = patch.fetcher.details(req.rid)
    if not extra:
        return result
    out = dict(result) if result else {"device": req.cached_tokens, "host": 0}
    out.update(extra)
    return out


# -- scheduler: host tier --------------------------------------------------------------------


def _after_decode_prefix_match(result, self, *args, **kwargs):
    """A decode engine reuses only what its device memory holds: the rest comes from the
    prefill engine, never from its own host tier (paper 4.2 and D.6: a decode batch must not
    wait for a load from host memory)."""
    if _PATCH is None or result is None or (
            result.l2_host_hit_length == 0 and result.l3_storage_hit_length == 0):
        return result
    import dataclasses

    return dataclasses.replace(result, l2_host_hit_length=0, l3_storage_hit_length=0,
                               last_host_node=None)


def _around_drive_host_eviction(original: Callable, self, num_tokens, tracker, *args,
                                **kwargs):
    patch = _PATCH
    counts = patch.counts if patch is not None else None
    if counts is None:
        return original(self, num_tokens, tracker, *args, **kwargs)
    from evinfra.engine_patch import tree_ops

    core = self.tree_core
    self._ensure_eviction_strategy()
    base = self.session_ref_eviction_strategy
    hashes: dict[int, list[int]] = {}

    def node_hashes(node) -> list[int]:
        h = hashes.get(node.id)
        if h is None:
            h = hashes[node.id] = tree_ops.node_hashes(core, node)
        return h

    def key(node):
        return counts.key(node_hashes(node), base(node))

    # Record each victim (and whether a zero-count leaf was still there) as SGLang evicts it.
    evict_leaf = core._evict_host_leaf

    def recording_evict(node, *a, **kw):
        positive = counts.is_positive(node_hashes(node))
        zero_left = positive and any(
            n is not node and not counts.is_positive(node_hashes(n))
            for n in core.evictable_host_leaves)
        counts.stats.record(node_hashes(node), positive, zero_left, time.time())
        return evict_leaf(node, *a, **kw)

    self.session_ref_eviction_strategy = key
    core._evict_host_leaf = recording_evict
    try:
        return original(self, num_tokens, tracker, *args, **kwargs)
    finally:
        self.session_ref_eviction_strategy = base
        del core._evict_host_leaf
