"""The one exception tree of evinfra.

::

    EvinfraError
    ├── ConfigError            a config file or value is invalid (names the key and the file)
    ├── KVEventDecodeError     an engine's KV event bytes could not be decoded
    ├── RequestError           a client request is invalid (HTTP 4xx)
    │   └── UnknownBranchError     a branch id the directory does not know
    ├── NoNodeError            no node of the needed phase can take work (HTTP 503)
    └── EngineError            an engine failed, timed out or is unreachable (HTTP 502/504)

Errors carry fields, not only a message, so the HTTP layer can map them without parsing text.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "EngineError",
    "EvinfraError",
    "KVEventDecodeError",
    "NoNodeError",
    "RequestError",
    "UnknownBranchError",
]


class EvinfraError(Exception):
    """Base of every error evinfra raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class ConfigError(EvinfraError):
    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        where = ", ".join(x for x in (path, f"key {key!r}" if key else None) if x)
        super().__init__(f"{where}: {message}" if where else message)
        self.path = path
        self.key = key


class KVEventDecodeError(EvinfraError):
    pass


class RequestError(EvinfraError):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class UnknownBranchError(RequestError):
    def __init__(self, branch: str) -> None:
        super().__init__(f"unknown branch {branch!r}", status=404, code="unknown_branch")
        self.branch = branch


class NoNodeError(EvinfraError):
    def __init__(self, phase: str, reason: str = "") -> None:
        msg = f"no {phase} node can take this request"
        super().__init__(f"{msg}: {reason}" if reason else msg)
        self.phase = phase
        self.reason = reason


class EngineError(EvinfraError):
    def __init__(self, node: str, message: str, *, timeout: bool = False) -> None:
        super().__init__(f"engine {node}: {message}")
        self.node = node
        self.timeout = timeout
