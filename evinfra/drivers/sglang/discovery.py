"""What an SGLang engine says about itself: ``/server_info`` and ``/model_info``, parsed.

Pure: :func:`parse_engine_info` turns the two JSON bodies into an :class:`EngineInfo` (or
raises :class:`~evinfra.errors.ConfigError` naming the node and what is wrong). The driver
fetches the bodies; nothing here does I/O.

Facts read (SGLang 0.5.23):

* ``/server_info`` is the launch configuration plus live scheduler state. Its ``kv_events``
  block (``runtime_context.describe_kv_events_publisher``) gives the ZMQ publisher's port,
  topic, block size, DP size and replay port; the host may be a wildcard, so we dial the host
  of the node's URL, as SGLang's own gateway does. ``disaggregation_bootstrap_port`` is where a
  decode engine's KV receiver meets this engine when it prefills.
* ``/server_info`` keeps the *launch* role; ``/model_info`` (and ``/v1/loads``) show the current
  one after ``/pd_role_switch``.
* An engine running the evinfra engine patch (``evinfra/engine_patch``) adds
  ``evinfra_engine_patch`` (:class:`~evinfra.engine_patch.wire.PatchInfo`: in-place switch,
  fetch plans, its pool address, the KV resync and iteration log calls) and
  ``evinfra_count_hints`` (the hint path). Stock SGLang has neither.
* ``grammar_backend`` (``xgrammar`` by default, ``none`` when turned off) says whether the
  engine can hold an output to a JSON schema.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

from evinfra.core.types import NodeId, Phase
from evinfra.engine_patch.wire import FETCH_ACTION, FETCH_VERSION, PatchInfo
from evinfra.errors import ConfigError

__all__ = ["EngineInfo", "KVEventsDescriptor", "parse_engine_info"]


class KVEventsDescriptor(msgspec.Struct, frozen=True):
    """``/server_info``'s ``kv_events`` block."""

    publisher: str
    endpoint_port_base: int
    block_size: int
    endpoint_host: str = "*"
    topic: str = ""
    dp_size: int = 1
    replay_endpoint_port_base: int | None = None


class _ServerInfo(msgspec.Struct):
    """The few ``/server_info`` fields the driver uses (SGLang returns hundreds)."""

    page_size: int | None = None
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int | None = None
    enable_pd_role_switch: bool = False
    disaggregation_transfer_backend: str | None = None
    dp_size: int = 1
    radix_eviction_policy: str | None = None
    enable_priority_scheduling: bool = False
    abort_on_priority_when_disabled: bool = False
    disable_radix_cache: bool = False
    max_total_num_tokens: int | None = None
    served_model_name: str | None = None
    model_path: str | None = None
    version: str | None = None
    kv_events: KVEventsDescriptor | None = None
    evinfra_count_hints: str | None = None
    """Path of the count-aware hint call of the evinfra engine patch, when it is loaded (stock
    SGLang has none: the field is absent)."""
    evinfra_engine_patch: PatchInfo | None = None
    grammar_backend: str | None = None


class _ModelInfo(msgspec.Struct):
    disaggregation_mode: str = "null"
    served_model_name: str | None = None
    model_path: str | None = None


class EngineInfo(msgspec.Struct, frozen=True):
    """An engine as the driver uses it."""

    node: NodeId
    url: str
    host: str
    """Host of the node's URL: dialled for ZMQ and given to decode peers as bootstrap host."""
    phase: Phase
    """The engine's current role."""
    model: str
    block_size: int
    kv_endpoint: str | None
    replay_endpoint: str | None
    kv_topic: str
    bootstrap_port: int | None
    role_switch: bool
    max_total_tokens: int
    priority_eviction: bool
    """The radix cache evicts by request priority (``--radix-eviction-policy priority``)."""
    priority_allowed: bool
    """Sending ``priority`` does not get requests aborted (``--abort-on-priority-when-disabled``
    without priority scheduling aborts them)."""
    hints_path: str | None
    version: str
    radix_cache: bool
    """False for a decode engine launched without ``--disaggregation-decode-enable-radix-cache``
    (SGLang's default): it keeps no KV for the next request of a branch."""
    switch_in_place: bool = False
    """The engine patch's switch: drains by itself and keeps the cache (no ``AllBlocksCleared``
    to wait for)."""
    fetch: bool = False
    """The engine honours fetch plans (``kv_hints`` action ``evinfra.fetch``)."""
    pool: str | None = None
    """``host:port`` of the engine's pool server: what a peer's fetch plan names."""
    kv_resync: str | None = None
    """Path of the call that makes the engine republish its whole cache as KV events."""
    iterations: str | None = None
    """Path of the engine's log of forward passes (the planner's reports from it)."""
    grammar: bool = False
    """Launched with a grammar backend (``--grammar-backend`` not ``none``): it holds an
    output to a JSON schema."""
    drain_timeout_s: float | None = None
    """The patched engine's drain limit of an in-place switch (it advertises its own)."""


_server_decoder = msgspec.json.Decoder(_ServerInfo)
_model_decoder = msgspec.json.Decoder(_ModelInfo)

_ROLES = {"prefill": Phase.PREFILL, "decode": Phase.DECODE}


def parse_engine_info(node: NodeId, url: str, server_info: bytes, model_info: bytes,
                      page_size: int) -> EngineInfo:
    """Validate what an engine reports against what the control plane needs.

    ``page_size`` is the cluster's: block hashes only match when the engine pages its KV the
    same way, so a mismatch is a configuration error, not something to tolerate.
    """

    def bad(msg: str) -> ConfigError:
        return ConfigError(f"engine {node} ({url}): {msg}", key="cluster.nodes")

    try:
        si = _server_decoder.decode(server_info)
        mi = _model_decoder.decode(model_info)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise bad(f"unexpected /server_info or /model_info: {exc}") from exc
    host = urlsplit(url).hostname
    if not host:
        raise bad("the node's url has no host")
    phase = _ROLES.get(mi.disaggregation_mode)
    if phase is None:
        raise bad(f"runs without PD disaggregation (disaggregation_mode "
                  f"{mi.disaggregation_mode!r}); the SGLang driver needs PD engines "
                  "(--disaggregation-mode prefill|decode --enable-pd-role-switch)")
    if si.dp_size != 1:
        # Each DP rank keeps its own prefix cache and publishes its own event stream; the
        # directory models one cache per node, so a rank's AllBlocksCleared would wipe the
        # node's whole view. Run one engine per DP rank instead.
        raise bad(f"dp_size={si.dp_size}: the driver supports one DP rank per node")
    kv = si.kv_events
    if kv is not None and kv.publisher != "zmq":
        kv = None
    block = kv.block_size if kv is not None else si.page_size
    if block != page_size:
        raise bad(f"pages its KV in blocks of {block} tokens but cluster.page_size is "
                  f"{page_size}: block hashes would never match")
    if si.disaggregation_bootstrap_port is None:
        raise bad("reports no disaggregation_bootstrap_port")
    wrap = f"[{host}]" if ":" in host else host
    kv_ep = f"tcp://{wrap}:{kv.endpoint_port_base}" if kv is not None else None
    replay_ep = (f"tcp://{wrap}:{kv.replay_endpoint_port_base}"
                 if kv is not None and kv.replay_endpoint_port_base else None)
    priority_allowed = si.enable_priority_scheduling or not si.abort_on_priority_when_disabled
    patch = si.evinfra_engine_patch
    return EngineInfo(
        node=node, url=url.rstrip("/"), host=host, phase=phase,
        model=mi.served_model_name or si.served_model_name or mi.model_path or "?",
        block_size=block, kv_endpoint=kv_ep, replay_endpoint=replay_ep,
        kv_topic=kv.topic if kv is not None else "",
        bootstrap_port=si.disaggregation_bootstrap_port, role_switch=si.enable_pd_role_switch,
        max_total_tokens=si.max_total_num_tokens or 0,
        priority_eviction=si.radix_eviction_policy == "priority",
        priority_allowed=priority_allowed, hints_path=si.evinfra_count_hints,
        version=si.version or "?", radix_cache=not si.disable_radix_cache,
        switch_in_place=patch is not None and patch.switch_in_place,
        fetch=patch is not None and patch.fetch_action == f"{FETCH_ACTION}/{FETCH_VERSION}",
        pool=patch.pool if patch is not None else None,
        kv_resync=patch.kv_resync if patch is not None else None,
        iterations=patch.iterations if patch is not None else None,
        grammar=si.grammar_backend not in (None, "none"),
        drain_timeout_s=patch.drain_timeout_s if patch is not None else None)
