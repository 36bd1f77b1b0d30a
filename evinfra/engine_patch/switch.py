"""Switch in place, keep the cache (paper 4.1, 4.2 last paragraph).

Stock SGLang 0.5.23 answers ``POST /pd_role_switch`` only on an idle engine ("not idle" for
any other), then tears down the role's queues and transfer state *and* resets the radix tree,
the KV pools and the host tier (``AllBlocksCleared``). The patched switch:

1. **decides** when the request reaches the scheduler (``t_decision``): the same preconditions
   as stock SGLang (flag set, backend supports it, a valid role...), then the engine stops
   admitting work: a request arriving now is refused with 503 "switching", so the router
   sends it elsewhere;
2. **drains by itself**: the scheduler loop keeps running the requests it holds (queued ones
   included: the router withdrew what it could) until ``Scheduler.is_fully_idle()``, which
   also waits for in-flight host writes, loads and this patch's fetches (``t_idle``);
3. **flips** with SGLang's own ``teardown_disaggregation`` / ``init_disaggregation`` (only the
   role's queues, metadata buffers and KV sender/receiver are rebuilt), except that the prefix
   cache release is skipped: the radix tree, the device KV pool and the host tier stay, and
   no ``AllBlocksCleared`` is published (``t_ready``);
4. **answers** the switch request then (the HTTP call returns when the engine serves the new
   phase) and restarts the scheduler loop in the new role, as stock SGLang does.

``switch_s = t_ready - t_decision`` is what the paper calls the switch time; ``drain_s`` its
drain part, ``rebuild_s`` the rest. Each switch is kept in ``history`` and logged.

Why keeping the tree is safe: the flip happens on an idle engine, so no request row, lock or
in-flight transfer refers to the KV; every cached page is a finished prefix owned by the tree,
whose KV means the same in either role (SGLang's comment on the reset worries about stale
prefixes, but a prefix's KV depends only on its tokens and the weights, which do not change).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from http import HTTPStatus
from typing import Any

import msgspec

from evinfra.engine_patch import faults
from evinfra.engine_patch.ranks import all_ranks

__all__ = ["SwitchController", "SwitchRecord", "running_requests"]

log = logging.getLogger("evinfra.engine_patch.switch")


def running_requests(scheduler: Any) -> int:
    """The requests the scheduler's running batch still decodes. A request that finished in
    the last step stays in the batch until the next step filters it: counting it would have a
    switch decided on an idle engine report one running request."""
    batch = scheduler.running_batch
    return 0 if batch is None else sum(not r.finished() for r in batch.reqs)


class SwitchRecord(msgspec.Struct, frozen=True):
    old_role: str
    new_role: str
    decided_at: float
    """Wall-clock time the engine took the decision (the request reached the scheduler)."""
    drain_s: float
    rebuild_s: float
    switch_s: float
    ok: bool
    message: str = ""
    running_at_decision: int = 0
    queued_at_decision: int = 0


class _Pending:
    __slots__ = ("req", "new_role", "old_role", "t0", "wall0", "running", "queued", "rejected")

    def __init__(self, req: Any, old_role: str, new_role: str, running: int, queued: int):
        self.req = req
        self.old_role = old_role
        self.new_role = new_role
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        self.running = running
        self.queued = queued
        self.rejected = 0


class SwitchController:
    """The in-place switch of one scheduler."""

    def __init__(self, scheduler: Any, drain_timeout_s: float) -> None:
        self.scheduler = scheduler
        self.drain_timeout_s = drain_timeout_s
        self.pending: _Pending | None = None
        self.keep_cache = False
        """True while the patch flips: the prefix-cache release of the flip is skipped."""
        self.history: deque[SwitchRecord] = deque(maxlen=64)

    @property
    def draining(self) -> bool:
        return self.pending is not None

    # -- the request --------------------------------------------------------------------

    def request(self, recv_req: Any) -> Any | None:
        """Handle a ``PdRoleSwitchReqInput``: the answer now (refused, or nothing to do), or
        None: the answer is sent when the switch is done."""
        from sglang.srt.disaggregation import role_switch
        from sglang.srt.managers.io_struct import PdRoleSwitchReqOutput

        s = self.scheduler
        old = s.disaggregation_mode.value
        new = (recv_req.new_role or "").lower()

        def answer(ok: bool, msg: str, safe: bool = True) -> Any:
            if not ok:
                log.warning("evinfra switch refused (%s -> %s): %s", old, new, msg)
            return PdRoleSwitchReqOutput(success=ok, message=msg, old_role=old, new_role=new,
                                         safe_to_restore=safe)

        rejection = role_switch._reject_reason(s, new)
        if rejection is not None:
            return answer(False, *rejection)
        if new == old:
            return answer(True, "already in target role")
        graph_problem = self._graph_headroom_problem(recv_req, new)
        if graph_problem is not None:
            return answer(False, graph_problem)
        if recv_req.prepare_only:
            return answer(True, "ready")
        running = running_requests(s)
        queued = len(s.waiting_queue)
        self.pending = _Pending(recv_req, old, new, running, queued)
        # A second switch request is refused as "in progress" by SGLang's own checks.
        s._pd_role_switch_in_progress = True
        log.info("evinfra switch %s -> %s decided: draining (%d running, %d queued)",
                 old, new, running, queued)
        return None

    def _graph_headroom_problem(self, recv_req: Any, new: str) -> str | None:
        """SGLang's decode CUDA-graph headroom precondition, unchanged."""
        s = self.scheduler
        if not (new == "decode" and not s.tp_worker.get_decode_cuda_graph_bs()):
            return None
        gb = recv_req.decode_cuda_graph_memory_gb
        if gb is None:
            return "decode_cuda_graph_memory_gb is required before capturing decode graphs"
        if gb < 0:
            return "decode_cuda_graph_memory_gb must be non-negative"
        if gb == 0:
            return None
        try:
            from sglang.srt.runtime_context import get_device
            from sglang.srt.utils import get_available_gpu_memory

            avail = get_available_gpu_memory(s.device, get_device().gpu_id)
        except Exception as exc:  # noqa: BLE001 - reported as SGLang does
            return f"failed to check decode CUDA graph headroom: {exc}"
        if avail < gb:
            return (f"insufficient decode CUDA graph headroom: required={gb:.3f} GB, "
                    f"available={avail:.3f} GB")
        return None

    # -- while draining -----------------------------------------------------------------

    def should_refuse(self, req: Any, is_retracted: bool) -> bool:
        """A request arriving while the engine drains is refused (the router routes it
        again); a retracted one is the engine's own and stays."""
        if self.pending is None or is_retracted:
            return False
        self.pending.rejected += 1
        return True

    def refuse(self, req: Any) -> None:
        from sglang.srt.managers.scheduler import _make_abort_req

        s = self.scheduler
        p = self.pending
        msg = (f"engine is switching from {p.old_role} to {p.new_role}; "
               "send this request to another node")
        s.send_abort_output(_make_abort_req(req, finished_reason={
            "type": "abort", "status_code": HTTPStatus.SERVICE_UNAVAILABLE, "message": msg}),
            req)
        s._release_aborted_request(req)

    def tick(self) -> bool:
        """Flip once drained. True when the caller must restart the scheduler loop."""
        p = self.pending
        if p is None:
            return False
        s = self.scheduler
        now = time.monotonic()
        # Every TP rank flips in the same iteration, or none does (``ranks``).
        idle, in_time = all_ranks([s.is_fully_idle(), now - p.t0 <= self.drain_timeout_s],
                                  getattr(s, "tp_cpu_group", None))
        if not idle:
            if not in_time:
                self._finish(p, ok=False, t_idle=now, t_ready=now,
                             message=f"drain did not finish in {self.drain_timeout_s:g} s; "
                                     f"the engine keeps its role {p.old_role}")
            return False
        return self._flip(p, t_idle=now)

    def _flip(self, p: _Pending, t_idle: float) -> bool:
        from sglang.srt.disaggregation import role_switch
        from sglang.srt.runtime_context import get_context

        s = self.scheduler
        self.keep_cache = True
        try:
            role_switch.teardown_disaggregation(s)
            get_context().override("role_switch.flip", disaggregation_mode=p.new_role)
            s.init_disaggregation()
            s._sync_disaggregation_mode_to_subcomponents()
            if faults.armed("switch"):
                faults.zero_kv_pools(s)
        except Exception as exc:  # noqa: BLE001 - as stock SGLang: no rollback possible
            s._pd_role_switch_unhealthy = True
            log.critical("evinfra switch %s -> %s failed during teardown/rebuild: %s",
                         p.old_role, p.new_role, exc)
            self._finish(p, ok=False, t_idle=t_idle, t_ready=time.monotonic(),
                         message=f"role switch failed; instance unhealthy, restart "
                                 f"required: {exc}", safe=False)
            return False
        finally:
            self.keep_cache = False
        if p.new_role == "decode":
            try:
                s.tp_worker.ensure_decode_cuda_graphs(p.req.decode_cuda_graph_bs)
            except Exception:  # noqa: BLE001 - best effort, as stock: eager decode
                log.exception("decode CUDA graph capture on switch failed")
        self._finish(p, ok=True, t_idle=t_idle, t_ready=time.monotonic(), message="ok")
        return True

    def _finish(self, p: _Pending, ok: bool, t_idle: float, t_ready: float, message: str,
                safe: bool = True) -> None:
        from sglang.srt.managers.io_struct import PdRoleSwitchReqOutput

        s = self.scheduler
        self.pending = None
        s._pd_role_switch_in_progress = False
        rec = SwitchRecord(p.old_role, p.new_role, p.wall0, drain_s=t_idle - p.t0,
                           rebuild_s=t_ready - t_idle, switch_s=t_ready - p.t0, ok=ok,
                           message=message, running_at_decision=p.running,
                           queued_at_decision=p.queued)
        self.history.append(rec)
        log.info("evinfra_switch %s", json.dumps(msgspec.to_builtins(rec)))
        out = PdRoleSwitchReqOutput(
            success=ok, message=message if not ok else json.dumps(msgspec.to_builtins(rec)),
            old_role=p.old_role, new_role=p.new_role if ok else p.old_role,
            safe_to_restore=safe)
        s.send_control_output(out, p.req)
