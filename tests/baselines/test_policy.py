"""The ``[policy]`` section: presets, overrides, errors, and what each preset is made of."""

import pytest

from evinfra.baselines import POLICIES, PRESETS, PolicyConfig, engine_overrides, resolve
from evinfra.config import load_config, parse_config
from evinfra.errors import ConfigError


def test_every_issue_policy_is_a_preset() -> None:
    assert set(POLICIES) >= {"evinfra", "static-sglang", "dynamo", "dynamo-pool", "arrow",
                             "thunderagent", "evinfra-fixed", "evinfra-lru",
                             "evinfra-fetch-at-start", "evinfra-cache-aware"}
    assert all(spec.about for spec in PRESETS.values())


def test_presets_are_the_systems_of_the_paper() -> None:
    evinfra = resolve(PolicyConfig())
    assert (evinfra.router, evinfra.decode, evinfra.planner, evinfra.switch, evinfra.eviction,
            evinfra.peer_fetch) == ("ttft", "prefill-start", "evinfra", "in-place", "count",
                                    "queued")
    sglang = resolve(PolicyConfig(name="static-sglang"))
    assert (sglang.router, sglang.decode, sglang.planner, sglang.eviction, sglang.peer_fetch) \
        == ("cache-aware", "submit-round-robin", "static", "lru", "none")
    dynamo = resolve(PolicyConfig(name="dynamo"))
    assert (dynamo.planner, dynamo.switch, dynamo.router) == ("dynamo", "relaunch", "cache-aware")
    assert resolve(PolicyConfig(name="dynamo-pool")).peer_fetch == "prefill-start"
    arrow = resolve(PolicyConfig(name="arrow"))
    assert (arrow.router, arrow.planner, arrow.switch, arrow.peer_fetch) == \
        ("full-input", "arrow", "in-place", "none")
    # Each ablation changes exactly one part of evinfra.
    for name, part, value in [("evinfra-fixed", "planner", "evinfra-fixed"),
                              ("evinfra-lru", "eviction", "lru"),
                              ("evinfra-fetch-at-start", "peer_fetch", "prefill-start"),
                              ("evinfra-cache-aware", "router", "cache-aware")]:
        spec = resolve(PolicyConfig(name=name))
        assert getattr(spec, part) == value
        diff = [f for f in spec.__struct_fields__ if f != "about"
                and getattr(spec, f) != getattr(evinfra, f)]
        assert diff == [part], name


def test_overrides_and_engine_settings() -> None:
    p = PolicyConfig(name="dynamo", router="dynamo-kv")
    assert resolve(p).router == "dynamo-kv" and resolve(p).planner == "dynamo"
    assert engine_overrides(p) == {"eviction": "lru", "peer_fetch": "none", "switch": "relaunch",
                                   "decode_prealloc": True}
    assert engine_overrides(PolicyConfig()) == {"eviction": "count", "peer_fetch": "queued",
                                                "switch": "in_place", "decode_prealloc": False}


def test_the_policy_section_in_a_config_file(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[policy]\nname = "thunderagent"\n[policy.thunderagent]\nthreshold = 0.9\n'
                 '[policy.cache_aware]\ncache_threshold = 0.5\n')
    c = load_config(f)
    assert c.policy.name == "thunderagent"
    assert c.policy.thunderagent.threshold == 0.9 and c.policy.cache_aware.cache_threshold == 0.5
    with pytest.raises(ConfigError) as e:
        parse_config({"policy": {"name": "nope"}})
    assert e.value.key == "policy.name"
    with pytest.raises(ConfigError):
        parse_config({"policy": {"routr": "ttft"}})


def test_the_shipped_config_spells_out_the_policy_defaults() -> None:
    assert load_config("etc/cluster.toml").policy == PolicyConfig()
