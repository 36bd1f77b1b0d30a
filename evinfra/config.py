"""The service configuration: TOML -> msgspec Structs, validated once at the edge.

It lives at the top of the package rather than in ``core/`` (as DESIGN.md first placed it) because
it composes the components' own config structs: ``core`` must not import the components.

Errors name the file and the key (``etc/cluster.toml: key 'planner.t_win': Expected
float >= 0...``). Unknown keys are errors: in a config a typo is the bigger risk. Every
default comes from the paper and says where in its comment; ``etc/cluster.toml`` spells
them out.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import msgspec.inspect

from evinfra.baselines.policy import PolicyConfig
from evinfra.core.types import NonNegFloat, PosFloat, PosInt
from evinfra.drivers.fake.config import FakeEngineConfig
from evinfra.errors import ConfigError
from evinfra.planner.planner import PlannerConfig
from evinfra.router.router import RouterConfig

__all__ = ["ClusterConfig", "Config", "LimitsConfig", "ModelConfig", "NodeConfig", "Port",
           "ServerConfig", "load_config", "read_toml"]

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_MiB = 1024 * 1024


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    """Loopback unless configured: the admin routes can change the cluster."""
    port: Port = 8000
    api_key: str = ""
    """Bearer token for the inference routes (empty: open)."""
    admin_key: str = ""
    """Bearer token for the admin routes. Empty: open if ``api_key`` is empty too (a
    loopback bind, or ``open_network``), else refused to every caller."""
    open_network: bool = False
    """Serve on a non-loopback ``host`` with both keys empty (anyone who reaches the port
    may change the cluster). False: such a server refuses to start."""
    first_token_timeout_s: PosFloat | None = 600.0
    """A request with no first token by then fails with 504 (a stalled or overloaded node)."""
    token_timeout_s: PosFloat | None = 60.0
    """A running request that produces nothing for this long fails with 504."""
    shutdown_grace_s: NonNegFloat = 30.0
    """On SIGTERM: stop accepting, let in-flight requests finish this long, fail the rest."""
    branch_idle_s: PosFloat | None = 7200.0
    """An agent branch with no request for this long is ended, its KV counts released, as if
    its harness had reported the end (one that never does would hold them, and the branch's
    last context, for ever). Longer than any tool or user pause worth keeping KV for."""
    infer_branches: bool = True
    """Requests without branch hints join the branch whose last prompt theirs extends
    (``evinfra/directory/chains.py``); false: each is a branch of one."""
    inferred_branch_idle_s: PosFloat = 1800.0
    """An inferred branch with no request for this long is ended: no harness reports its end
    or its compaction. Much shorter ends agents' branches during their pauses (measure with
    ``evinfra simulate --no-hints``)."""


class LimitsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[limits]``: every bound the HTTP front puts on what one client may make it hold (the
    README lists them). What a running request holds (its KV, its branch's counts) is bounded
    by ``model.max_context_tokens`` and the branch timeouts of ``[server]``."""

    body_bytes: PosInt = 16 * _MiB
    """A request body, after decompression (413 above it): a 262 k-token chat history is
    about 1 MB of JSON, a token-id prompt of that length about 2 MB."""
    bodies_bytes: PosInt = 512 * _MiB
    """The request bodies held at once, each from its headers until its answer is over
    (counted at its Content-Length, or ``body_bytes`` when it sends none): a request past it
    is a 503 with ``Retry-After`` before its body is read."""
    tokenize_bytes: PosInt = 4 * _MiB
    """The text ``/tokenize`` tokenizes (413 above it; its answer is some four times as
    big). A prompt past ``model.max_context_tokens`` is refused too (400, with its count)."""
    header_bytes: PosInt = 16 * 1024
    """The request line, and each header line (aiohttp's default is 8 KiB)."""
    idle_timeout_s: PosFloat = 75.0
    """A connection with no request in progress (idle between keep-alive requests, or still
    sending its headers) is closed after this long."""
    read_timeout_s: PosFloat = 60.0
    """A request's body must arrive within this long of its headers (else 408): a client
    stalled mid-body holds a connection and its buffer."""
    stored_responses: Annotated[int, msgspec.Meta(ge=0)] = 1000
    """Responses API answers kept in memory for ``previous_response_id`` (the least recently
    used go first; 0: none) ..."""
    stored_response_bytes: Annotated[int, msgspec.Meta(ge=0)] = 256 * _MiB
    """... in at most this many bytes (each counted as its answer and conversation in JSON:
    a long agent session stores its conversation once per response)."""


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: str = "evinfra-fake"
    """The model name clients send and ``/v1/models`` lists."""
    dir: str = ""
    """A Hugging Face model directory (``tokenizer.json``, ``tokenizer_config.json`` with a
    chat template). Empty: the built-in byte-level tokenizer (fake engines)."""
    max_context_tokens: PosInt = 262_144
    tool_call_parser: Literal["hermes", "qwen3_coder"] | None = None
    """How the model writes tool calls (``evinfra/api/tool_calls.py``): ``hermes`` for the
    ``<tool_call>`` JSON blocks of Qwen2.5, Qwen3 and Hermes models, ``qwen3_coder`` for
    Qwen3-Coder's ``<function=...>`` blocks. None: see :attr:`tool_calls`."""
    reasoning_parser: Literal["think"] | None = None
    """``think``: a thinking model's ``<think>...</think>`` block (Qwen3, DeepSeek-R1, QwQ)
    is returned as the chat message's ``reasoning_content`` (``evinfra/api/reasoning.py``).
    None: the output is all content."""

    @property
    def tool_calls(self) -> str | None:
        """The parser in force: the configured one, else ``hermes`` for the built-in byte
        model (its template writes calls that way); None for a model dir, whose chat requests
        with ``tools`` are refused, as this server could not read the calls back."""
        return self.tool_call_parser or (None if self.dir else "hermes")


class NodeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    """How the API, metrics and logs name the node."""
    url: str = ""
    """The engine's HTTP base URL (SGLang driver); unused by fake engines."""


class ClusterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    driver: Literal["fake", "sglang"] = "fake"
    """``fake``: simulated engines in-process (no GPU). ``sglang``: real SGLang engines at
    each node's ``url`` (the ``evinfra[sglang]`` extra)."""
    nodes: list[NodeConfig] = msgspec.field(
        default_factory=lambda: [NodeConfig(name=f"n{i}") for i in range(9)])
    """Nine nodes, as the paper's testbed (6.1: nine 4xGB300 nodes)."""
    initial_prefill: PosInt = 6
    """Prefill nodes of the initial split: the first ones listed (6.1: both systems start
    from the prefill-heavy 6P3D)."""
    page_size: PosInt = 64
    """Tokens per KV block, as the engines page their KV (SGLang ``--page-size``). It is the
    fake engines' page size too: ``[fake].page_size`` is replaced by this one."""
    seed: int = 0

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"node names must be distinct: {names}")
        if len(names) < 2:
            raise ValueError("a PD cluster needs at least two nodes")
        if self.initial_prefill >= len(names):
            raise ValueError(f"initial_prefill={self.initial_prefill} leaves no decode node "
                             f"among {len(names)}")


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    server: ServerConfig = ServerConfig()
    limits: LimitsConfig = LimitsConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    planner: PlannerConfig = PlannerConfig()
    router: RouterConfig = RouterConfig()
    fake: FakeEngineConfig = FakeEngineConfig()
    policy: PolicyConfig = PolicyConfig()
    """Which system runs: evinfra or a baseline (``evinfra.baselines``)."""


def read_toml(path: str | Path) -> dict:
    """A TOML file's table; :class:`ConfigError` names the file when it is missing or bad."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError("no such file", path=str(path)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", path=str(path)) from exc


def load_config(path: str | Path) -> Config:
    """Read and validate a TOML config; :class:`ConfigError` names the file and the key."""
    return parse_config(read_toml(path), str(path))


def parse_config(raw: dict, path: str = "<config>") -> Config:
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        key = None
        if " - at `$." in msg:
            msg, _, where = msg.partition(" - at `$.")
            key = where.rstrip("`").replace("[", ".").replace("]", "")
            if msg.startswith("Invalid enum value"):
                choices = _choices(key)
                if choices:
                    msg += f": one of {', '.join(map(repr, choices))}"
        raise ConfigError(msg, path=path, key=key) from exc


def _choices(key: str) -> tuple | None:
    """The values the config field at ``key`` (``a.b.0.c``) takes, if it is a Literal."""
    t: object = msgspec.inspect.type_info(Config)
    for part in key.split("."):
        if isinstance(t, msgspec.inspect.ListType):
            t = t.item_type
            continue
        fields = {f.name: f.type for f in getattr(t, "fields", ())}
        if part not in fields:
            return None
        t = fields[part]
    for u in t.types if isinstance(t, msgspec.inspect.UnionType) else (t,):
        if isinstance(u, msgspec.inspect.LiteralType):
            return u.values
    return None
