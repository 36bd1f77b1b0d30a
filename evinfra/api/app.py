"""The aiohttp application: OpenAI-compatible (chat, completions, responses) and
Anthropic-compatible routes, agent and admin routes, health, metrics.

Errors leave as OpenAI-style JSON (``{"error": {"message", "type", "param", "code"}}``), or
Anthropic's (``{"type": "error", "error": {"type", "message"}}``) on its routes, with the
status of :mod:`evinfra.errors`' tree: bad requests 4xx, no node 503, engine failures 502,
timeouts 504. Anything unexpected is logged and answered 500; it never takes the process down.

Auth: ``server.api_key`` guards the inference routes (``Authorization: Bearer`` or
``x-api-key``), ``server.admin_key`` the routes that change the cluster (``auth.py``).
Every request gets an id and one access-log line (``access.py``); its body is read once,
within ``limits.read_timeout_s``, before its handler runs.
"""

from __future__ import annotations

import asyncio
import re
import time

import msgspec
import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from evinfra.api.access import access_log, echo_id
from evinfra.api.anthropic import AnthropicRoutes
from evinfra.api.dashboard import Dashboard
from evinfra.api.auth import auth
from evinfra.api.metrics import Metrics
from evinfra.api.openai import OpenAIRoutes
from evinfra.api.openapi import serve_document
from evinfra.api.responses import ResponsesRoutes
from evinfra.api.schemas import SplitRequest, decode_body
from evinfra.api.tokenizer import Tokenizer
from evinfra.config import LimitsConfig
from evinfra.core.types import Phase
from evinfra.errors import EngineError, EvinfraError, NoNodeError, RequestError
from evinfra.control import Service
from evinfra.control.status import status as cluster_status
from evinfra.partitions.identity import AGENTS_KEY, AgentBook, agents_middleware

__all__ = ["build_app"]

log = structlog.get_logger(__name__)

_MISSING = re.compile(r"missing required field `([^`]+)`")
_MAX_BODY = web.AppKey("max_body", int)
_ANTHROPIC = "/v1/messages"
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def _error(status: int, message: str, type_: str, param: str | None = None,
           code: str | None = None) -> web.Response:
    return web.Response(status=status, content_type="application/json", body=msgspec.json.encode(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}))


def _anthropic_error(status: int, message: str, type_: str, param: str | None = None,
                     code: str | None = None) -> web.Response:
    """An error as Anthropic writes it: its type follows from the status."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    if param is not None and not message.startswith(param):  # (Anthropic's has no param field)
        message = f"{param}: {message}"
    return web.Response(status=status, content_type="application/json", body=msgspec.json.encode(
        {"type": "error", "error": {"type": kind, "message": message}}))


def _writer(request: web.Request):
    return _anthropic_error if request.path.startswith(_ANTHROPIC) else _error


def error_response(exc: BaseException, write=_error) -> web.Response:
    """The response to a failed request, written by ``write`` (OpenAI's shape by default)."""
    if isinstance(exc, RequestError):
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return write(exc.status, exc.message, kind, exc.param, exc.code)
    if isinstance(exc, NoNodeError):
        return write(503, exc.message, "service_unavailable", code="no_node")
    if isinstance(exc, EngineError):
        return write(504 if exc.timeout else 502, exc.message,
                     "timeout" if exc.timeout else "engine_error", code=exc.node)
    if isinstance(exc, (msgspec.ValidationError, msgspec.DecodeError)):
        msg = str(exc)
        param = None
        if " - at `$." in msg:
            msg, _, where = msg.partition(" - at `$.")
            param = where.rstrip("`")
        missing = _MISSING.search(msg)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return write(400, f"invalid request body: {msg}", "invalid_request_error", param)
    if isinstance(exc, EvinfraError):
        return write(500, exc.message, "server_error")
    return write(500, "internal server error", "server_error")


@web.middleware
async def _errors(request: web.Request, handler):
    write = _writer(request)
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            return write(404, f"no route {request.method} {request.path}", "not_found_error")
        if exc.status == 405:
            return write(405, f"{request.method} is not served on {request.path}",
                         "invalid_request_error")
        return write(exc.status, exc.reason if exc.status != 413 else
                     f"request body too large (limit {request.app[_MAX_BODY]} bytes, "
                     "limits.body_bytes)", "invalid_request_error")
    except (EvinfraError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        return error_response(exc, write)
    except RequestPayloadError as exc:  # a body that does not decompress, or cut short
        cause = exc.__cause__ or exc
        return write(400, f"could not read the request body: {type(cause).__name__}",
                     "invalid_request_error")
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001 - one request must not take the server down
        log.exception("handler_failed", path=request.path)
        return error_response(exc, write)


def _body(limits: LimitsConfig):
    """Read the body whole before the handler (which reads it again, from memory): a client
    that stalls mid-body is answered 408 and let go. The bodies held at once are bounded
    (``limits.bodies_bytes``): past it a request is a 503 before its body is read."""
    timeout, held = limits.read_timeout_s, 0

    @web.middleware
    async def body(request: web.Request, handler):
        nonlocal held
        if not request.body_exists:
            return await handler(request)
        size = min(request.content_length or limits.body_bytes, limits.body_bytes)
        if held + size > limits.bodies_bytes:
            response = _writer(request)(
                503, f"busy: {held} bytes of request bodies held, {limits.bodies_bytes} at "
                "most (limits.bodies_bytes); retry shortly", "service_unavailable",
                code="bodies_full")
            response.headers["Retry-After"] = "1"
            response.force_close()  # its body, unread, is not drained
            return response
        held += size
        try:
            try:
                async with asyncio.timeout(timeout):
                    await request.read()
            except TimeoutError:
                response = _writer(request)(
                    408, f"the request body did not arrive within {timeout:g} s "
                    "(limits.read_timeout_s)", "invalid_request_error", code="read_timeout")
                response.force_close()
                return response
            return await handler(request)
        finally:
            held -= size

    return body


class _Admin:
    def __init__(self, service: Service, metrics: Metrics) -> None:
        self.service = service
        self.metrics = metrics

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        s = self.service
        phases = {s.router.phase(n) for n in s.nodes if s.router.routable(n)}
        ok = s.accepting and (Phase.COLLOCATED in phases
                              or {Phase.PREFILL, Phase.DECODE} <= phases)
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def metrics_(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def status(self, request: web.Request) -> web.Response:
        # The agents this partition served (evinfra/partitions/identity.py): nginx in front
        # binds each to one partition, and this is where an operator sees which.
        status = {**cluster_status(self.service, time.time()),
                  "agents": request.app[AGENTS_KEY].status()}
        return web.Response(body=msgspec.json.encode(status),
                            content_type="application/json")

    async def split(self, request: web.Request) -> web.Response:
        body = decode_body(await request.read(), SplitRequest)
        split = self.service.force_split(body.prefill)
        return web.json_response({"split": split.label, "prefill": list(split.prefill),
                                  "decode": list(split.decode)})

    async def cordon(self, request: web.Request) -> web.Response:
        """``POST /v1/evinfra/nodes/{node}/cordon`` or ``/uncordon``; the node's view after
        (``queued``, ``prefilling`` and ``decoding`` at 0: it is idle). Cordoning the last
        routable node of a phase is a 409 unless ``?force=true``."""
        node, action = request.match_info["node"], request.match_info["action"]
        force = request.query.get("force", "false").lower()
        if force not in ("true", "false"):
            raise RequestError(f"force must be true or false, not {force!r}", param="force")
        withdrawn = self.service.cordon(node, action == "cordon", force == "true")
        return web.json_response({"node": node, **self.service.router.node_view(node),
                                  "withdrawn": len(withdrawn)})

    async def end_branch(self, request: web.Request) -> web.Response:
        branch = request.match_info["branch"]
        self.service.end_branch(branch)
        return web.json_response({"branch": branch, "ended": True})

    async def branch(self, request: web.Request) -> web.Response:
        branch = request.match_info["branch"]
        chains = self.service.chains
        return web.json_response({"branch": branch,
                                  "counted_blocks": self.service.branch_counts(branch),
                                  "inferred": chains is not None and branch in chains})


def build_app(service: Service, tokenizer: Tokenizer) -> web.Application:
    limits = service.config.limits
    metrics = Metrics(service)
    app = web.Application(client_max_size=limits.body_bytes,
                          middlewares=[access_log(metrics.answered), _errors,
                                       auth(service.config.server, _writer),
                                       _body(limits),
                                       agents_middleware(book := AgentBook(), service.clock.now)])
    app.on_response_prepare.append(echo_id)
    app[AGENTS_KEY] = book
    app[_MAX_BODY] = limits.body_bytes
    admin = _Admin(service, metrics)
    OpenAIRoutes(service, tokenizer).add_to(app)
    AnthropicRoutes(service, tokenizer).add_to(app)
    ResponsesRoutes(service, tokenizer).add_to(app)
    Dashboard(service).add_to(app)
    app.router.add_get("/health", admin.health)
    app.router.add_get("/ready", admin.ready)
    app.router.add_get("/metrics", admin.metrics_)
    app.router.add_get("/openapi.json", serve_document)
    app.router.add_get("/v1/evinfra/status", admin.status)
    app.router.add_post("/v1/evinfra/split", admin.split)
    app.router.add_post("/v1/evinfra/nodes/{node}/{action:cordon|uncordon}", admin.cordon)
    app.router.add_post("/v1/branches/{branch}/end", admin.end_branch)
    app.router.add_get("/v1/branches/{branch}", admin.branch)
    return app
