"""Workloads and trace formats by name, as the CLI and configs name them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from evinfra.errors import ConfigError
from evinfra.workloads.agentic import read_agentic
from evinfra.workloads.cc import CC
from evinfra.workloads.codex import Codex
from evinfra.workloads.osworld import OSWorld
from evinfra.workloads.program import Workload
from evinfra.workloads.putnam import Putnam
from evinfra.workloads.tokens import DEFAULT_SPACE, TokenSpace
from evinfra.workloads.traces import TraceWorkload, read_mooncake, read_trie

__all__ = ["GENERATORS", "TRACE_FORMATS", "make_workload", "read_trace"]

GENERATORS: dict[str, Callable[..., Workload]] = {"cc": CC, "codex": Codex,
                                                  "osworld": OSWorld, "putnam": Putnam}
TRACE_FORMATS: dict[str, Callable[..., TraceWorkload]] = {
    "agentic": read_agentic, "mooncake": read_mooncake, "trie": read_trie,
}


def make_workload(name: str, seed: int = 0, space: TokenSpace = DEFAULT_SPACE) -> Workload:
    """The generator ``name`` (``cc``, ``codex``, ``osworld``, ``putnam``) for ``seed``."""
    if name not in GENERATORS:
        raise ConfigError(f"unknown workload {name!r}; use one of {sorted(GENERATORS)}")
    return GENERATORS[name](seed, space)


def read_trace(path: str | Path, fmt: str, **options: Any) -> TraceWorkload:
    """Read ``path`` as ``fmt`` (``mooncake``, ``agentic`` or ``trie``); ``options`` go to the
    reader (``name``, ``seed``, ``space``, and ``block_size`` for Mooncake)."""
    if fmt not in TRACE_FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; use one of {sorted(TRACE_FORMATS)}")
    return TRACE_FORMATS[fmt](path, **options)
