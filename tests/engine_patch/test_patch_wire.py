"""The patch's wire contract: count hints, fetch plans in SGLang's ``kv_hints``, the
reuse counts in ``cached_tokens_details`` and the pool's lease messages."""

import msgspec
import pytest

from evinfra.engine_patch.layout import host_layout
from evinfra.engine_patch.wire import (FETCH_ACTION, FetchPlan, FetchRunWire, LeaseReply,
                                       LeaseRequest, Release, Shard, WireError,
                                       decode_count_hints, fetch_kv_hints, find_fetch_plan,
                                       pool_decoder, pool_encoder, restored_tokens,
                                       fetch_seconds)

LAYOUT = host_layout("layer_first", 4096, 64, 2, 32, 4)


def test_count_hints_are_the_directory_delta():
    h = decode_count_hints(b'{"positive": [1, -2], "zero": [3], "later": true}')
    assert h.positive == [1, -2] and h.zero == [3] and not h.replace
    assert decode_count_hints(b'{"positive": [4], "replace": true}').replace
    assert decode_count_hints(b"{}").positive == []
    for bad in (b'{"positive": "x"}', b"[1]", b"not json", b'{"zero": [18446744073709551615]}'):
        with pytest.raises(WireError):
            decode_count_hints(bad)


PLAN = FetchPlan(4, [FetchRunWire("10.0.0.2:5000", 3, [11, 12]),
                     FetchRunWire("10.0.0.3:5000", 5, [13])])


def test_a_fetch_plan_travels_in_kv_hints_and_comes_back():
    env = fetch_kv_hints(PLAN, "req-1")
    assert env["actions"][0]["action_type"] == FETCH_ACTION
    assert find_fetch_plan(env) == PLAN
    assert (PLAN.first_block, PLAN.end_block) == (3, 6)
    # As SGLang hands it over: msgspec structs with attributes, not dicts.
    from types import SimpleNamespace
    action = SimpleNamespace(**env["actions"][0])
    assert find_fetch_plan(SimpleNamespace(actions=[action])) == PLAN


def test_other_actions_are_ignored_and_bad_plans_refused():
    assert find_fetch_plan(None) is None
    other = {"actions": [{"action_type": "someone.else", "action_version": "1", "payload": 1},
                         {"action_type": FETCH_ACTION, "action_version": "2", "payload": 1}]}
    assert find_fetch_plan(other) is None
    bad = fetch_kv_hints(PLAN, "r")
    bad["actions"][0]["payload"]["runs"][1]["start"] = 7  # not consecutive
    with pytest.raises(WireError, match="consecutive"):
        find_fetch_plan(bad)
    with pytest.raises(ValueError, match="host:port"):
        FetchRunWire("no-port", 0, [1])
    with pytest.raises(ValueError, match="at least one block"):
        FetchRunWire("h:1", 0, [])


def test_reuse_counts_from_cached_tokens_details():
    assert restored_tokens(None) == (0, 0)
    assert restored_tokens({"device": 40, "host": 0}) == (0, 0)
    assert restored_tokens({"device": 48, "host": 0, "evinfra_fetched": 48,
                            "evinfra_restored": 48}) == (48, 48)
    # SGLang's own host hits (loaded during the prefill) are restored tokens too.
    assert restored_tokens({"device": 8, "host": 16, "evinfra_restored": 4}) == (0, 20)
    assert restored_tokens({"host": "x", "evinfra_fetched": -3}) == (0, 0)


def test_fetch_seconds_from_cached_tokens_details():
    assert fetch_seconds({"evinfra_fetched": 48, "evinfra_fetch_s": 0.0071}) == 0.0071
    # Nothing fetched, stock SGLang, or a time that is not one: no observation.
    for bad in (None, {}, {"device": 40}, {"evinfra_fetch_s": -1.0}, {"evinfra_fetch_s": 0},
                {"evinfra_fetch_s": "0.1"}, {"evinfra_fetch_s": True},
                {"evinfra_fetch_s": float("nan")}, {"evinfra_fetch_s": float("inf")}):
        assert fetch_seconds(bad) == 0.0, bad


def test_lease_messages_round_trip():
    for msg in (LeaseRequest([1, 2, 3, 4], 0, 1, [9]), Release(7),
                LeaseRequest([1, 2, 3, 4], 0, 1, key="s/7/0", ranks=2),
                LeaseReply(True, lease=3, shards=[Shard("h:1", LAYOUT), Shard("h:2", LAYOUT)],
                           pages=1, slots=[0, 1, 2, 3])):
        assert pool_decoder.decode(pool_encoder.encode(msg)) == msg
    with pytest.raises(msgspec.ValidationError):
        pool_decoder.decode(pool_encoder.encode({"type": "lease", "tokens": "x"}))
