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
EVINFRA_POOL_HOST             the engine's ``--host`` (``127.0.0.1`` for a wildcard)
                                       address peers dial for this engine's pool server
EVINFRA_POOL_PORT             0        pool server port (0: a free one)
EVINFRA_FETCH_TIMEOUT_S       10       a queued request waits at most this long for its
                                       fetch and load before it is prefilled without them
EVINFRA_LEASE_TTL_S           30       a peer's lease on host pages ends by itself after
EVINFRA_DRAIN_TIMEOUT_S       300      an in-place switch that cannot drain by then fails
                                       (the engine keeps its role and serves on)
============================  =======  ==================================================
"""

from __future__ import annotations

import os
from typing import Mapping

import msgspec

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
    drain_timeout_s: float = 300.0

    def on(self, feature: str) -> bool:
        return feature in self.features

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
        return cls(features=features, pool_host=env.get("EVINFRA_POOL_HOST") or None,
                   pool_port=int(number("EVINFRA_POOL_PORT", 0, int)),
                   fetch_timeout_s=number("EVINFRA_FETCH_TIMEOUT_S", 10.0),
                   lease_ttl_s=number("EVINFRA_LEASE_TTL_S", 30.0),
                   drain_timeout_s=number("EVINFRA_DRAIN_TIMEOUT_S", 300.0))
