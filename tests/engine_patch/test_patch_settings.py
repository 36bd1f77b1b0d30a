"""The patch is off unless enabled; its knobs come from the environment."""

import sys

import pytest

from evinfra.engine_patch.settings import FEATURES, PatchSettings, enabled


def test_off_unless_enabled():
    assert not enabled({})
    assert not enabled({"EVINFRA_ENGINE_PATCH": "0"})
    assert enabled({"EVINFRA_ENGINE_PATCH": "1"}) and enabled({"EVINFRA_ENGINE_PATCH": "true"})


def test_disabled_plugin_registers_nothing(monkeypatch):
    """Without the variable the entry point returns before touching SGLang (not even
    installed here: an import would fail)."""
    monkeypatch.delenv("EVINFRA_ENGINE_PATCH", raising=False)
    from evinfra.engine_patch import plugin

    plugin.register()
    assert "sglang" not in sys.modules and plugin._SETTINGS is None


def test_knobs():
    s = PatchSettings.from_env({})
    assert s.features == frozenset(FEATURES) and s.fetch_timeout_s == 10.0
    s = PatchSettings.from_env({"EVINFRA_PATCH_FEATURES": "switch,fetch",
                                "EVINFRA_FETCH_TIMEOUT_S": "2.5", "EVINFRA_POOL_PORT": "7000"})
    assert s.on("switch") and s.on("pool") and not s.on("evict")  # fetch needs the pool
    assert s.fetch_timeout_s == 2.5 and s.pool_port == 7000
    with pytest.raises(ValueError, match="EVINFRA_PATCH_FEATURES"):
        PatchSettings.from_env({"EVINFRA_PATCH_FEATURES": "warp"})
    with pytest.raises(ValueError, match="EVINFRA_LEASE_TTL_S"):
        PatchSettings.from_env({"EVINFRA_LEASE_TTL_S": "-1"})
    with pytest.raises(ValueError, match="not a number"):
        PatchSettings.from_env({"EVINFRA_DRAIN_TIMEOUT_S": "soon"})


def test_the_pool_advertises_an_address_its_peers_reach():
    s = PatchSettings.from_env({})
    # Behind a wildcard bind: the host of the Mooncake session (never loopback).
    assert s.pool_endpoint("0.0.0.0", "10.77.0.2:15891") == ("0.0.0.0", "10.77.0.2")
    assert s.pool_endpoint(None, "[fd00::2]:15891") == ("0.0.0.0", "fd00::2")
    # An explicit bind address is what peers dial.
    assert s.pool_endpoint("10.77.0.3", "10.77.0.3:1") == ("10.77.0.3", "10.77.0.3")
    assert s.pool_endpoint("127.0.0.1", "192.0.2.2:1") == ("127.0.0.1", "127.0.0.1")
    # The operator's word wins.
    o = PatchSettings.from_env({"EVINFRA_POOL_HOST": "pool.node7"})
    assert o.pool_endpoint("0.0.0.0", "10.77.0.2:1") == ("0.0.0.0", "pool.node7")
    with pytest.raises(ValueError, match="EVINFRA_POOL_HOST"):
        s.pool_endpoint("0.0.0.0", "15891")
