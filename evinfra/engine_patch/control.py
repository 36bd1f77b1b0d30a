"""The HTTP side of the patch, in SGLang's server process (the one running FastAPI and the
tokenizer manager).

Four routes are added to SGLang's app before it starts serving:

* ``POST /evinfra/hints`` (:data:`~evinfra.engine_patch.wire.COUNT_HINTS_PATH`): count hints,
  validated here (400 with the reason otherwise) and forwarded to the scheduler as an
  ``RpcReqInput(method="evinfra_control")`` on the tokenizer manager's own socket to the
  scheduler. That socket carries the requests too, so hints and requests reach the scheduler
  in the order they were sent, and SGLang broadcasts them to every rank the same way. The
  scheduler-side hook consumes the message (no reply: the route answers 200 once it is sent).
* ``POST /evinfra/kv_resync`` (:data:`~evinfra.engine_patch.wire.KV_RESYNC_PATH`): the same
  way, a message that makes the scheduler republish its whole cache as KV events (the
  publisher sends them with the scheduler's next batch of events, in order with the rest).
* ``GET /evinfra/status``: the scheduler's patch status (switch history, eviction counters,
  pool and fetch records), read through SGLang's ``get_internal_state`` call, where a hook
  adds it as ``evinfra``.
* ``GET /evinfra/iterations?after=N`` (:data:`~evinfra.engine_patch.wire.ITERATIONS_PATH`):
  the forward passes numbered above ``N`` (:class:`~evinfra.engine_patch.wire.IterationLog`),
  read the same way (the hook adds the scheduler's whole log as ``evinfra_iterations``; this
  route keeps the ones asked for).

``/server_info`` needs no route of ours: SGLang merges the scheduler's init info into it, and
a hook adds ``evinfra_engine_patch`` and ``evinfra_count_hints`` there.
"""

import json
import logging

import msgspec

from evinfra.engine_patch.wire import (COUNT_HINTS_PATH, ITERATIONS_PATH, KV_RESYNC_PATH,
                                       STATUS_PATH, WireError, decode_count_hints)

__all__ = ["CONTROL_METHOD", "add_routes"]

log = logging.getLogger("evinfra.engine_patch.control")

CONTROL_METHOD = "evinfra_control"


def add_routes(app) -> None:
    """Add the patch's routes to SGLang's FastAPI ``app`` (idempotent).

    (No ``from __future__ import annotations`` in this module: FastAPI reads the handlers'
    annotations, and ``Request`` is imported here, in the server process only.)"""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    if any(getattr(r, "path", None) == COUNT_HINTS_PATH for r in app.routes):
        return

    def tokenizer_manager():
        from sglang.srt.entrypoints import http_server

        state = getattr(http_server, "_global_state", None)
        return getattr(state, "tokenizer_manager", None)

    async def to_scheduler(tm, message: dict) -> None:
        from sglang.srt.managers.io_struct import RpcReqInput

        await tm._async_dispatch_to_scheduler(
            RpcReqInput(method=CONTROL_METHOD, parameters={"payload": json.dumps(message)}))

    async def hints(request: Request):
        tm = tokenizer_manager()
        if tm is None:
            return JSONResponse({"error": "engine not ready"}, status_code=503)
        try:
            body = decode_count_hints(await request.body())
        except WireError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        await to_scheduler(tm, {"kind": "hints", "body": msgspec.to_builtins(body)})
        return JSONResponse({"ok": True, "positive": len(body.positive),
                             "zero": len(body.zero)})

    async def kv_resync():
        tm = tokenizer_manager()
        if tm is None:
            return JSONResponse({"error": "engine not ready"}, status_code=503)
        await to_scheduler(tm, {"kind": "kv_resync"})
        return JSONResponse({"ok": True})

    async def scheduler_state(key: str):
        """``key`` of each rank's internal state, or the error response to give."""
        tm = tokenizer_manager()
        if tm is None:
            return None, JSONResponse({"error": "engine not ready"}, status_code=503)
        states = await tm.get_internal_state()
        found = [s.get(key) for s in states if isinstance(s, dict)]
        if not found or found[0] is None:
            return None, JSONResponse({"error": f"the evinfra engine patch does not report "
                                                f"{key!r} in the scheduler"}, status_code=404)
        return found, None

    async def status():
        found, error = await scheduler_state("evinfra")
        if error is not None:
            return error
        return JSONResponse(found[0] if len(found) == 1 else {"ranks": found})

    async def iterations(after: int = -1):
        found, error = await scheduler_state("evinfra_iterations")
        if error is not None:
            return error
        passes = found[0]  # the patch drives one rank per engine
        return JSONResponse({"last": passes["last"],
                             "records": [r for r in passes["records"] if r["seq"] > after]})

    app.add_api_route(COUNT_HINTS_PATH, hints, methods=["POST"])
    app.add_api_route(KV_RESYNC_PATH, kv_resync, methods=["POST"])
    app.add_api_route(STATUS_PATH, status, methods=["GET"])
    app.add_api_route(ITERATIONS_PATH, iterations, methods=["GET"])
    log.info("evinfra engine patch routes: POST %s, POST %s, GET %s, GET %s",
             COUNT_HINTS_PATH, KV_RESYNC_PATH, STATUS_PATH, ITERATIONS_PATH)
