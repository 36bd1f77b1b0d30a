"""``etc/partitions.toml``: the partitions of a cluster and the global tier in front of them.

Each partition is one ``evinfra serve`` process (its own router, planner, KV directory and
engines) at an ``address``, started from its own serve ``config``; the global tier is nginx,
whose config ``evinfra partitions nginx`` writes from this file. Unknown keys are errors, as in
every evinfra config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from evinfra.config import Port, read_toml
from evinfra.core.types import PosFloat, PosInt
from evinfra.errors import ConfigError

__all__ = ["GlobalTier", "Partition", "PartitionsConfig", "load_partitions"]

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]+$")]
Host = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:\[\]-]+$")]


class Partition(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Name
    """How logs, the nginx config's comments and the operator name it."""
    host: Host = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    """Where its ``evinfra serve`` listens (``--host``/``--port`` override its config's)."""
    config: str = "etc/cluster.toml"
    """Its ``evinfra serve`` config (nodes, engines, planner): partitions may differ."""

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class GlobalTier(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[nginx]``: the load balancer that binds agents to partitions."""

    host: Host = "127.0.0.1"
    port: Port = 8080
    """Where clients send their requests (the OpenAI, Anthropic and Responses routes)."""
    connect_timeout_s: PosFloat = 2.0
    """A partition that does not accept a connection this fast is taken as down: its agents'
    request goes to the next partition on the hash ring."""
    read_timeout_s: PosFloat = 900.0
    """The longest silence nginx waits for between two reads from a partition: a whole
    (unstreamed) answer may take a partition's ``server.first_token_timeout_s`` (600 s)
    plus its decoding."""
    send_timeout_s: PosFloat = 60.0
    max_fails: PosInt = 1
    """Failed connections within ``fail_timeout_s`` that mark a partition down ..."""
    fail_timeout_s: PosFloat = 10.0
    """... for this long; nginx then tries it again with live traffic (no active checks in
    nginx's open-source build)."""
    max_body_bytes: PosInt = 16 * 1024 * 1024
    """As a partition's ``limits.body_bytes`` (nginx refuses larger bodies with 413)."""
    worker_processes: PosInt | None = None
    """nginx worker processes (None: one per core)."""


class PartitionsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    nginx: GlobalTier = msgspec.field(default_factory=GlobalTier)
    partitions: Annotated[list[Partition], msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        for what, values in (("name", [p.name for p in self.partitions]),
                             ("address", [p.address for p in self.partitions])):
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"two partitions share the {what} {', '.join(twice)}")


def load_partitions(path: str | Path) -> PartitionsConfig:
    """Read and validate ``partitions.toml``; :class:`ConfigError` names the file and key."""
    path = Path(path)
    raw = read_toml(path)
    try:
        return msgspec.convert(raw, PartitionsConfig)
    except msgspec.ValidationError as exc:
        msg, _, where = str(exc).partition(" - at `$.")
        key = where.rstrip("`").replace("[", ".").replace("]", "") or None
        raise ConfigError(msg, path=str(path), key=key) from exc
