"""Engine failures, mapped at the boundary into what the control plane acts on (pure).

Every way an engine call can fail ends as a :class:`Failure`: a message a client can read
(it reaches them as the ``EngineError`` of a 502/504), and two facts the driver acts on:

* ``unreachable`` — the engine itself may be gone (refused or reset connections, a stream
  cut mid-way, timeouts): the driver probes it at once and reports ``NodeDown`` if it does not
  answer;
* ``status`` — the HTTP status when the engine answered one (or put in an abort): 400,
  413 and 422 mean the request itself is bad (``rejected``), and no engine would take it.

::

    aiohttp.ClientConnectorError     "unreachable: connection refused"          unreachable
    aiohttp.ServerDisconnectedError  "closed the connection"                    unreachable
    aiohttp.ClientPayloadError       "stream cut"                               unreachable
    asyncio.TimeoutError             "timed out after N s"                      unreachable
    HTTP 4xx / 5xx                   "HTTP 503: <the engine's own message>"
    finish_reason abort              "aborted: <message>"
    {"error": ...} in a stream       "<message>"
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec

__all__ = ["Failure", "from_exception", "from_http", "engine_message"]


class Failure(msgspec.Struct, frozen=True):
    message: str
    unreachable: bool = False
    status: int | None = None

    @property
    def rejected(self) -> bool:
        """The engine refused the request as bad (not itself failing)."""
        return self.status in (400, 413, 422)


class _Detail(msgspec.Struct):
    message: str | None = None


class _Body(msgspec.Struct):
    """The error shapes SGLang answers with: ``{"error": {"message"}}`` (most routes),
    ``{"error": "..."}`` (the /generate contract check), ``{"message": ...}`` (OpenAI-style
    and role switch), ``{"detail": ...}`` (FastAPI validation)."""

    error: _Detail | str | None = None
    message: str | None = None
    detail: object = None


_body = msgspec.json.Decoder(_Body)


def engine_message(body: bytes, limit: int = 300) -> str:
    """The human part of an engine's error body (its raw text when it is not JSON)."""
    try:
        b = _body.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body.decode("utf-8", errors="replace").strip()
        return text[:limit] or "(empty body)"
    if isinstance(b.error, str):
        msg = b.error
    elif b.error is not None and b.error.message:
        msg = b.error.message
    elif b.message:
        msg = b.message
    elif b.detail is not None:
        msg = msgspec.json.encode(b.detail).decode()
    else:
        msg = body.decode("utf-8", errors="replace")
    return msg[:limit]


def from_http(status: int, body: bytes, what: str) -> Failure:
    return Failure(f"{what}: HTTP {status}: {engine_message(body)}", status=status)


def from_exception(exc: BaseException, what: str) -> Failure:
    if isinstance(exc, aiohttp.ClientConnectorError):
        reason = exc.os_error.strerror if exc.os_error is not None else str(exc)
        return Failure(f"{what}: engine unreachable ({reason or 'connection failed'})",
                       unreachable=True)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return Failure(f"{what}: the engine closed the connection", unreachable=True)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return Failure(f"{what}: the engine's stream was cut ({exc})", unreachable=True)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return Failure(f"{what}: the engine did not answer in time", unreachable=True)
    if isinstance(exc, aiohttp.ClientOSError):
        return Failure(f"{what}: connection error ({exc.strerror or exc})", unreachable=True)
    if isinstance(exc, aiohttp.ClientError):
        return Failure(f"{what}: {type(exc).__name__}: {exc}", unreachable=True)
    if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError)):
        return Failure(f"{what}: malformed answer from the engine ({exc})")
    return Failure(f"{what}: {type(exc).__name__}: {exc}")
