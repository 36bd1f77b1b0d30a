"""The ``[policy]`` section: which system the service runs, evinfra or a baseline (issue 7).

A policy is a named composition of six parts, each a hook point of the one control plane:

==============  ============================================================================
``router``      the prefill strategy: ``ttft`` (Eq. 7, evinfra), ``cache-aware`` (SGLang
                Model Gateway), ``sticky`` (the gateway's sticky sessions), ``dynamo-kv``
                (Dynamo's KV router cost), ``full-input`` (Arrow), ``thunderagent``
                (program pausing around cache-aware)
``decode``      when and where decode binds: ``prefill-start`` (KV room, fewest requests;
                evinfra, D.1) or ``submit-round-robin`` (SGLang PD: at submit, round robin,
                the decode node reserving the KV while the request queues)
``planner``     ``evinfra`` (5.2), ``evinfra-fixed`` (its fit, no adaptation: 6.4),
                ``static`` (no warm-up, a fixed split), ``dynamo`` (load planner), ``arrow``
                (SLO-reactive resizing)
``switch``      ``in-place`` (symmetric engine, KV kept: 4.1) or ``relaunch`` (Dynamo: out of
                service for minutes, KV lost: A.1, C.1)
``eviction``    host eviction ``count`` (5.3) or ``lru`` (HiCache)
``peer_fetch``  ``queued`` (the shared pool, 4.2), ``prefill-start`` (the pool loaded when the
                prefill starts: D.6, 3.3 "+ memory pool"), ``none`` (private host memory)
==============  ============================================================================

``name`` picks a preset (:data:`PRESETS`, each naming its sources); any part may be
overridden by its own key. The first three parts are control-plane objects built by
:func:`build`; the last three shape the engines (:func:`engine_overrides`), which for real
SGLang engines are the engines' own settings.

``dynamo`` is Dynamo as the paper ran it in 6.1 ("in the configuration of Section 3"): its
load planner and relaunching switches, behind the SGLang Model Gateway's cache-aware routing
("All baselines use the SGLang Model Gateway ..., the setup with the lowest P95 TTFT in
Section 3.3"). Dynamo's own KV router is ``dynamo-kv``, and with the pool ``dynamo-pool``,
both at a fixed split as Fig. 3c compares them; ``router = "dynamo-kv"`` puts it under the
planner.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

import msgspec

from evinfra.baselines.arrow import ArrowConfig, FullInputRouter, SLOPlanner
from evinfra.baselines.dynamo import KVRouter, KVRouterConfig, LoadPlanner, LoadPlannerConfig
from evinfra.baselines.sglang import CacheAware, CacheAwareConfig, RoundRobin
from evinfra.baselines.static import StaticPlanner
from evinfra.baselines.sticky import Sticky, StickyConfig
from evinfra.baselines.thunderagent import ProgramScheduler, ThunderAgentConfig
from evinfra.core.types import NodeId
from evinfra.planner.planner import Planner, PlannerConfig, SplitPlanner
from evinfra.router.strategy import (DecodeStrategy, FewestRequests, PrefillStrategy,
                                     TTFTStrategy)

__all__ = ["POLICIES", "PRESETS", "Components", "PolicyConfig", "PolicySpec", "build",
           "engine_overrides", "resolve"]

RouterKind = Literal["ttft", "cache-aware", "sticky", "dynamo-kv", "full-input",
                     "thunderagent"]
DecodeKind = Literal["prefill-start", "submit-round-robin"]
PlannerKind = Literal["evinfra", "evinfra-fixed", "static", "dynamo", "arrow"]
SwitchKind = Literal["in-place", "relaunch"]
EvictionKind = Literal["count", "lru"]
FetchKind = Literal["queued", "prefill-start", "none"]
PolicyName = Literal["evinfra", "evinfra-fixed", "evinfra-lru", "evinfra-fetch-at-start",
                     "evinfra-cache-aware", "static-sglang", "sticky-sglang", "dynamo",
                     "dynamo-kv", "dynamo-pool", "arrow", "thunderagent"]


class PolicySpec(msgspec.Struct, frozen=True, kw_only=True):
    """A policy resolved to its parts (module docstring)."""

    router: RouterKind
    decode: DecodeKind
    planner: PlannerKind
    switch: SwitchKind
    eviction: EvictionKind
    peer_fetch: FetchKind
    about: str = ""


_EVINFRA = PolicySpec(router="ttft", decode="prefill-start", planner="evinfra", switch="in-place",
                      eviction="count", peer_fetch="queued",
                      about="Evolving Infra: Eq. 7 routing, online split planner, counts, the "
                            "shared pool fetched while queued (paper 4, 5)")
_SGLANG = PolicySpec(router="cache-aware", decode="submit-round-robin", planner="static",
                     switch="in-place", eviction="lru", peer_fetch="none",
                     about="SGLang PD at a fixed split behind the SGLang Model Gateway "
                           "(cache-aware prefill, round-robin decode), HiCache with private "
                           "L2 and LRU eviction (paper 6.1, D.1)")

PRESETS: dict[str, PolicySpec] = {
    "evinfra": _EVINFRA,
    "evinfra-fixed": msgspec.structs.replace(
        _EVINFRA, planner="evinfra-fixed",
        about="evinfra without online phase-split adaptation (paper 6.4, Fig. 8b)"),
    "evinfra-lru": msgspec.structs.replace(
        _EVINFRA, eviction="lru", about="evinfra with LRU host eviction instead of counts"),
    "evinfra-fetch-at-start": msgspec.structs.replace(
        _EVINFRA, peer_fetch="prefill-start",
        about="evinfra with peer KV loaded when the prefill starts, not while queued (D.6)"),
    "evinfra-cache-aware": msgspec.structs.replace(
        _EVINFRA, router="cache-aware",
        about="evinfra with the SGLang gateway's cache-aware routing instead of Eq. 7 (D.5)"),
    "static-sglang": _SGLANG,
    "sticky-sglang": msgspec.structs.replace(
        _SGLANG, router="sticky",
        about="SGLang PD at a fixed split behind the SGLang Model Gateway's sticky sessions "
              "(its manual policy keyed by agent; paper 3.3, Fig. 3c: sticky)"),
    "dynamo": msgspec.structs.replace(
        _SGLANG, planner="dynamo", switch="relaunch",
        about="Dynamo v1.5.1 as run in paper 6.1: its load planner (throughput target) with "
              "relaunching switches, behind the SGLang Model Gateway, HiCache LRU"),
    "dynamo-kv": msgspec.structs.replace(
        _SGLANG, router="dynamo-kv", switch="relaunch",
        about="SGLang PD at a fixed split behind Dynamo's KV router (paper 3.3, Fig. 3c)"),
    "dynamo-pool": msgspec.structs.replace(
        _SGLANG, router="dynamo-kv", switch="relaunch", peer_fetch="prefill-start",
        about="Dynamo's KV router with a shared host pool loaded at prefill start "
              "(paper 3.3, Fig. 3c: + memory pool)"),
    "arrow": PolicySpec(
        router="full-input", decode="prefill-start", planner="arrow", switch="in-place",
        eviction="lru", peer_fetch="none",
        about="Arrow reimplemented on the symmetric engines: full-input TTFT routing, "
              "SLO-reactive resizing, KV private to each node (paper 3, A.1)"),
    "thunderagent": msgspec.structs.replace(
        _SGLANG, router="thunderagent",
        about="ThunderAgent's program pausing on the prefill choice, cache-aware routing, "
              "SGLang PD at a fixed split (paper D.5)"),
}
POLICIES: tuple[str, ...] = tuple(PRESETS)


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[policy]``: a preset by ``name``, optional overrides of its parts, and the baselines'
    parameters (each struct's docstring names its source)."""

    name: PolicyName = "evinfra"
    router: RouterKind | None = None
    decode: DecodeKind | None = None
    planner: PlannerKind | None = None
    switch: SwitchKind | None = None
    eviction: EvictionKind | None = None
    peer_fetch: FetchKind | None = None
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    sticky: StickyConfig = StickyConfig()
    dynamo_router: KVRouterConfig = KVRouterConfig()
    dynamo_planner: LoadPlannerConfig = LoadPlannerConfig()
    arrow: ArrowConfig = ArrowConfig()
    thunderagent: ThunderAgentConfig = ThunderAgentConfig()


def resolve(policy: PolicyConfig) -> PolicySpec:
    """The preset of ``policy.name`` with ``policy``'s overrides applied."""
    spec = PRESETS[policy.name]
    changes = {k: getattr(policy, k) for k in ("router", "decode", "planner", "switch",
                                               "eviction", "peer_fetch")
               if getattr(policy, k) is not None}
    return msgspec.structs.replace(spec, **changes) if changes else spec


class Components(NamedTuple):
    """The control-plane parts of a policy, built for one service."""

    spec: PolicySpec
    prefill: PrefillStrategy
    decode: DecodeStrategy
    pool: bool
    """The router may plan peer fetches (the engines read peers' host memory)."""
    planner: SplitPlanner


def build(policy: PolicyConfig, planner: PlannerConfig, nodes: Sequence[NodeId],
          initial_prefill: Sequence[NodeId], *, start: float, page_size: int,
          context_length: int) -> Components:
    spec = resolve(policy)
    prefill: PrefillStrategy
    if spec.router == "ttft":
        prefill = TTFTStrategy()
    elif spec.router == "cache-aware":
        prefill = CacheAware(policy.cache_aware, page_size)
    elif spec.router == "sticky":
        prefill = Sticky(policy.sticky)
    elif spec.router == "dynamo-kv":
        prefill = KVRouter(policy.dynamo_router, page_size)
    elif spec.router == "full-input":
        prefill = FullInputRouter()
    else:
        prefill = ProgramScheduler(policy.thunderagent, CacheAware(policy.cache_aware, page_size))
    decode: DecodeStrategy = (RoundRobin() if spec.decode == "submit-round-robin"
                              else FewestRequests())
    split_planner: SplitPlanner
    if spec.planner == "evinfra":
        split_planner = Planner(planner, nodes, initial_prefill, start=start)
    elif spec.planner == "evinfra-fixed":
        split_planner = Planner(msgspec.structs.replace(planner, adapt=False), nodes,
                                initial_prefill, start=start)
    elif spec.planner == "static":
        split_planner = StaticPlanner(nodes, initial_prefill, start=start)
    elif spec.planner == "dynamo":
        split_planner = LoadPlanner(policy.dynamo_planner, nodes, initial_prefill, start=start,
                                    context_length=context_length)
    else:
        split_planner = SLOPlanner(policy.arrow, planner, nodes, initial_prefill, start=start)
    return Components(spec, prefill, decode, spec.peer_fetch != "none", split_planner)


def engine_overrides(policy: PolicyConfig) -> dict[str, object]:
    """The fake engines' settings a policy fixes (``FakeEngineConfig`` fields)."""
    spec = resolve(policy)
    return {"eviction": spec.eviction, "peer_fetch": spec.peer_fetch.replace("-", "_"),
            "switch": spec.switch.replace("-", "_"),
            "decode_prealloc": spec.decode == "submit-round-robin"}
