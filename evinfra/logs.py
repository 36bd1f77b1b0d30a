"""structlog set-up: JSON lines in production, a readable console on a terminal.

The standard library's loggers (aiohttp's among them) go through the same renderer, so in
JSON mode every line of the log is one JSON object, a traceback included (as a field).
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging"]


class _Stderr(logging.StreamHandler):
    """``sys.stderr`` as it is when a line is written, not when the handler was made."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = (structlog.dev.ConsoleRenderer() if fmt == "console"
                else structlog.processors.JSONRenderer())
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[structlog.processors.add_log_level, stamp,
                    structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # Resolve sys.stderr when a logger is made, not now: a caller that swaps stderr (a
        # test harness capturing it) must not leave loggers writing to a closed file.
        logger_factory=lambda *args: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = _Stderr()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name,
                           stamp],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(getattr(logging, level.upper()))
