"""One JSON access-log line per HTTP request, its request id, and the count of answers by
route and status class.

The request id is the client's ``x-request-id`` (up to 128 visible ASCII characters) or one
made up here; it is echoed in the answer's ``x-request-id`` and on the log line, so an
operator can grep one request from the client's log to the server's. What the request did in
the cluster (its branch, nodes, tokens, TTFT and E2E) comes from the service's
:class:`RequestDone` records of the requests it submitted, which each :class:`Channel` adds to
the list :data:`RECORDS` holds for the HTTP request being served.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from contextvars import ContextVar

import structlog
from aiohttp import web

from evinfra.core.events import RequestDone

__all__ = ["RECORDS", "REQUEST_ID", "access_log", "echo_id", "request_id", "route_of"]

log = structlog.get_logger("evinfra.access")

REQUEST_ID = web.RequestKey("request_id", str)
RECORDS: ContextVar[list[RequestDone] | None] = ContextVar("evinfra_records", default=None)
"""The service's records of the requests the HTTP request being served submitted."""

_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")
CLIENT_CLOSED = 499
"""nginx's status for a request whose client went away before its answer."""


def request_id(request: web.BaseRequest) -> str:
    """The request's id: the client's ``x-request-id`` if it is a sane one, else a new one."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        got = request.headers.get("x-request-id", "")
        rid = got if _CLIENT_ID.fullmatch(got) else uuid.uuid4().hex
        request[REQUEST_ID] = rid
    return rid


def route_of(request: web.BaseRequest) -> str:
    """The route's pattern (``/v1/branches/{branch}``), a label of few values: a path that
    matches no route is ``unmatched``, whatever it is."""
    info = getattr(request, "match_info", None)
    if info is None or info.http_exception is not None:
        return "unmatched"
    resource = info.route.resource
    return "unmatched" if resource is None else resource.canonical


def _cluster_fields(records: list[RequestDone]) -> dict[str, object]:
    if not records:
        return {}
    first = [r.first_token - r.arrival for r in records if r.first_token is not None]
    return {
        "requests": len(records),
        "branch": records[0].branch if len({r.branch for r in records}) == 1
        else sorted({r.branch for r in records}),
        "prefill_nodes": sorted({r.prefill_node for r in records if r.prefill_node}),
        "decode_nodes": sorted({r.decode_node for r in records if r.decode_node}),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "cached_tokens": sum(r.cached_tokens for r in records),
        "output_tokens": sum(r.output_tokens for r in records),
        "ttft_s": round(min(first), 6) if first else None,
        "e2e_s": round(max(r.end for r in records) - min(r.arrival for r in records), 6),
        "outcome": sorted({r.status for r in records}),
    }


def access_log(count):
    """The outermost middleware: ``count(route, status)`` counts each answer."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        rid = request_id(request)
        records: list[RequestDone] = []
        token = RECORDS.set(records)
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED
            raise
        finally:
            RECORDS.reset(token)
            route = route_of(request)
            count(route, status)
            log.info("http_request", request_id=rid, method=request.method, route=route,
                     path=request.path, status=status,
                     duration_s=round(time.perf_counter() - start, 6),
                     **_cluster_fields(records))

    return middleware


async def echo_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the answer carries the request id, and a ``Server`` header
    that does not advertise the aiohttp version."""
    response.headers["x-request-id"] = request_id(request)
    response.headers["Server"] = "evinfra"
