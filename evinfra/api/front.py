"""The HTTP server around the app: aiohttp's, with the connection limits of ``[limits]``, and
its own protocol errors (a request line or header too long, a malformed request) answered as
JSON and logged as one JSON line rather than aiohttp's plain-text page and traceback.

Limits here, per connection: ``idle_timeout_s`` (aiohttp's keep-alive timeout, which also
closes a connection that never finishes its headers) and ``header_bytes`` (the request line
and each header line). The body's size and read timeout are the app's (``app.py``).
"""

from __future__ import annotations

import msgspec
import structlog
from aiohttp import web, web_protocol, web_server

from evinfra.config import LimitsConfig

__all__ = ["FrontRunner"]

log = structlog.get_logger("evinfra.http")

_LINGER_S = 1.0
"""A client still sending a body after its answer (a 408, a 413) is read from this long
before its connection is closed, so that it sees the answer rather than a reset (aiohttp's
default of 10 s held stalled connections that long)."""


class _Handler(web_protocol.RequestHandler):
    def log_exception(self, *args, **kw) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, web_protocol.RequestPayloadError):
            # A body that does not decompress, read again after its 400 went out (aiohttp
            # drains what is left): the client's fault, already answered. No traceback.
            log.info("bad_request_body", error=str(exc).replace("\n", " "))
            return
        super().log_exception(*args, **kw)

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None
                     ) -> web.StreamResponse:
        if status >= 500:
            log.error("http_error", status=status, peer=request.remote, exc_info=exc)
        else:  # the client's doing (or a scanner's): one line, no traceback
            log.info("bad_http_request", status=status, peer=request.remote,
                     error=message or (str(exc) if exc else None))
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun: no error answer can follow")
        text = ("internal server error" if status >= 500
                else f"malformed HTTP request: {message or exc or status}")
        response = web.Response(status=status, content_type="application/json",
                                headers={"Server": "evinfra"}, body=msgspec.json.encode(
                                    {"error": {"message": text, "type": "invalid_request_error"
                                               if status < 500 else "server_error",
                                               "param": None, "code": None}}))
        response.force_close()
        return response


class _Server(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class FrontRunner(web.AppRunner):
    """``web.AppRunner`` for the app, with ``limits`` on each connection; a client that
    leaves before its answer cancels its handler, which aborts its requests on the engines
    instead of computing them for no one."""

    def __init__(self, app: web.Application, limits: LimitsConfig) -> None:
        super().__init__(app, access_log=None, handle_signals=False, handler_cancellation=True,
                         keepalive_timeout=limits.idle_timeout_s,
                         max_line_size=limits.header_bytes, max_field_size=limits.header_bytes,
                         lingering_time=_LINGER_S)

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, making handlers that answer in JSON
        return server
