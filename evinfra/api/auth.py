"""Who may call what: ``server.api_key`` guards the inference routes, ``server.admin_key`` the
routes that change the cluster (split, cordon, branch end); ``/health``, ``/ready``,
``/metrics``, the API description and the dashboard (to look, not to act) are open.

An operator who sets an API key wants the admin routes guarded too: with ``api_key`` set and
no ``admin_key`` they are refused (403) to every caller, the user key included. Both keys empty
is the loopback default, open; on any other address such a server refuses to start unless
``server.open_network`` says the operator means it (:func:`exposure`).
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import web

from evinfra.api.dashboard import OPEN_PATHS as DASHBOARD
from evinfra.config import ServerConfig
from evinfra.errors import EvinfraError

__all__ = ["ADMIN", "OPEN", "auth", "exposure", "is_loopback"]

ADMIN = ("/v1/evinfra/split", "/v1/evinfra/nodes/", "/v1/branches/")
# The dashboard is for looking: its page, assets and JSON need no key (issue 42).
OPEN = ("/health", "/ready", "/metrics", "/openapi.json", *DASHBOARD)
ADMIN_OFF = ("the admin routes are disabled: server.api_key is set and server.admin_key is "
             "not (set an admin key to use them)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "" (every address)
        return False


def exposure(server: ServerConfig) -> str | None:
    """What the operator should know at start about the keys (None: nothing); raises
    :class:`EvinfraError` for a server that must not start: open on the network unasked."""
    if not server.api_key and not server.admin_key and not is_loopback(server.host):
        if not server.open_network:
            raise EvinfraError(
                f"refusing to serve on {server.host!r} with no api_key and no admin_key: "
                "anyone who reaches it could change the cluster. Set the keys, bind "
                "127.0.0.1, or set server.open_network = true")
        return (f"serving on {server.host!r} with no API keys (server.open_network): every "
                "route, admin ones included, is open to whoever reaches the port")
    if server.api_key and not server.admin_key:
        return ADMIN_OFF
    return None


def _has_key(request: web.Request, key: str) -> bool:
    # Anthropic's clients send the key as ``x-api-key``.
    got = request.headers.get("Authorization", "").encode()
    alt = request.headers.get("x-api-key", "").encode()
    return hmac.compare_digest(got, f"Bearer {key}".encode()) or hmac.compare_digest(
        alt, key.encode())


def auth(server: ServerConfig, write):
    """The middleware; ``write(request)`` gives the error writer of the request's dialect."""
    api_key, admin_key = server.api_key, server.admin_key

    @web.middleware
    async def middleware(request: web.Request, handler):
        path = request.path
        if path in OPEN:
            return await handler(request)
        if path.startswith(ADMIN):
            if admin_key:
                key = admin_key
            elif api_key:
                return write(request)(403, ADMIN_OFF, "permission_error", code="admin_disabled")
            else:
                key = ""
        else:
            key = api_key
        if key and not _has_key(request, key):
            return write(request)(
                401, "missing or invalid API key (Authorization: Bearer ..., or x-api-key)",
                "authentication_error", code="invalid_api_key")
        return await handler(request)

    return middleware
