"""The patch's switches and knobs, read from the engine's environment (pure).

Nothing of the patch is active unless ``EVINFRA_ENGINE_PATCH=1`` is set for the engine
process: the plugin entry point is loaded by every SGLang that finds it, and without the
variable it registers no hook at all (stock behaviour, byte for byte).

============================  =======  ==================================================
variable                      default  meaning
============================  =======  ==================================================
EVINFRA_ENGINE_PATCH          (unset)  ``1`` turns the patch on
EVINFRA_PATCH_FEATURES        all      comma list of parts to turn on: ``switch``,
                                       ``evict``, ``pool``, ``fetch``, ``cpu_host``,
                                       ``iterations``
EVINFRA_POOL_HOST             the engine's ``--host``; for a wildcard (``0.0.0.0``), the
                                       address of its Mooncake session (SGLang's own pick:
                                       ``SGLANG_HOST_IP`` or the first non-loopback NIC):
                                       the address peers dial for this engine's pool server
EVINFRA_POOL_PORT             0        pool server port (0: a free one)
EVINFRA_FETCH_TIMEOUT_S       10       a queued request waits at most this long for its
                                       fetch and load before it is prefilled without them
EVINFRA_LEASE_TTL_S           30       a peer's lease on host pages ends by itself after
EVINFRA_DRAIN_TIMEOUT_S       300      an in-place switch that cannot drain by then fails
                                       (the engine keeps its role and serves on); the
                                       engine advertises it and the SGLang driver waits
                                       for a switch at least this long
EVINFRA_PATCH_ON_MISMATCH     refuse   on an SGLang the patch does not fit (``compat``):
                                       ``refuse`` to start, or run ``stock`` (no hook)
============================  =======  ==================================================
"""

from __future__ import annotations

import os
from typing import Mapping

import msgspec

from evinfra.engine_patch.wire import DRAIN_TIMEOUT_S

__all__ = ["ENABLE_ENV", "FEATURES", "PatchSettings", "enabled"]

ENABLE_ENV = "EVINFRA_ENGINE_PATCH"
FEATURES = ("switch", "evict", "pool", "fetch", "cpu_host", "iterations")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class PatchSettings(msgspec.Struct, frozen=True, kw_only=True):
    features: frozenset[str] = frozenset(FEATURES)
    pool_host: str | None = None
    pool_port: int = 0
    fetch_timeout_s: float = 10.0
    lease_ttl_s: float = 30.0
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    on_mismatch: str = "refuse"

    def on(self, feature: str) -> bool:
        return feature in self.features

    def pool_endpoint(self, bind_host: str | None, mooncake_session: str) -> tuple[str, str]:
        """``(bind, advertise)`` hosts of the pool server. Peers on other hosts must reach
        the advertised one: an explicit ``--host`` is; behind a wildcard it is the host
        this engine's Mooncake session advertises (peers read the pages from there too),
        never loopback."""
        wildcard = bind_host in (None, "", "0.0.0.0", "::")
        bind = "0.0.0.0" if wildcard else bind_host
        if self.pool_host:
            return bind, self.pool_host
        if not wildcard:
            return bind, bind_host
        host = mooncake_session.rpartition(":")[0].strip("[]")
        if not host:
            raise ValueError(f"mooncake session {mooncake_session!r} names no host: set "
                             "EVINFRA_POOL_HOST to the address peers reach this engine at")
        return bind, host

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "PatchSettings":
        env = os.environ if environ is None else environ

        def number(name: str, default: float, cast=float):
            raw = env.get(name)
            if raw is None or raw.strip() == "":
                return default
            try:
                value = cast(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if value < 0:
                raise ValueError(f"{name}={raw!r} must not be negative")
            return value

        raw = env.get("EVINFRA_PATCH_FEATURES", "").strip()
        if raw and raw != "all":
            features = frozenset(x.strip() for x in raw.split(",") if x.strip())
            unknown = features - set(FEATURES)
            if unknown:
                raise ValueError(f"EVINFRA_PATCH_FEATURES: unknown {sorted(unknown)} "
                                 f"(known: {', '.join(FEATURES)})")
            if "fetch" in features:
                features |= {"pool"}  # a fetch reads peers' pools and serves its own
        else:
            features = frozenset(FEATURES)
        on_mismatch = env.get("EVINFRA_PATCH_ON_MISMATCH", "").strip() or "refuse"
        if on_mismatch not in ("refuse", "stock"):
            raise ValueError(f"EVINFRA_PATCH_ON_MISMATCH={on_mismatch!r}: refuse or stock")
        return cls(features=features, on_mismatch=on_mismatch,
                   pool_host=env.get("EVINFRA_POOL_HOST") or None,
                   pool_port=int(number("EVINFRA_POOL_PORT", 0, int)),
                   fetch_timeout_s=number("EVINFRA_FETCH_TIMEOUT_S", 10.0),
                   lease_ttl_s=number("EVINFRA_LEASE_TTL_S", 30.0),
                   drain_timeout_s=number("EVINFRA_DRAIN_TIMEOUT_S",
                                          DRAIN_TIMEOUT_S))
