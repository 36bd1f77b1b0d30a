"""Pure parts of the SGLang driver: discovery, /v1/loads, /generate bodies and streams, errors."""

import asyncio
import json

import aiohttp
import msgspec
import numpy as np
import pytest

from evinfra.core.contracts import Sampling
from evinfra.core.events import TokenLogprobs
from evinfra.core.types import Phase
from evinfra.drivers.sglang.discovery import parse_engine_info
from evinfra.drivers.sglang.errors import engine_message, from_exception, from_http
from evinfra.drivers.sglang.loads import LoadsTracker, parse_loads
from evinfra.drivers.sglang.pairs import PairBook
from evinfra.drivers.sglang.requests import (DONE, Bootstrap, Chunk, MetaInfo, OutputCursor,
                                             StreamError, generate_body, parse_sse_line,
                                             priority_for, prompt_logprobs)
from evinfra.errors import ConfigError

# Trimmed from a real SGLang 0.5.23 prefill engine's answers.
SERVER_INFO = {
    "disaggregation_mode": "prefill", "disaggregation_bootstrap_port": 44321, "page_size": 4,
    "served_model_name": "tiny-llama", "enable_pd_role_switch": True, "dp_size": 1,
    "radix_eviction_policy": "lru", "enable_priority_scheduling": False,
    "abort_on_priority_when_disabled": False, "disable_radix_cache": False,
    "max_total_num_tokens": 4096, "version": "0.5.23", "host": "0.0.0.0",
    "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 51705,
                  "topic": "", "block_size": 4, "dp_size": 1,
                  "replay_endpoint_port_base": 53659},
}
MODEL_INFO = {"model_path": "/m", "served_model_name": "tiny-llama",
              "disaggregation_mode": "decode"}


def info(server=None, model=None, page_size=4):
    return parse_engine_info("n0", "http://10.1.2.3:30000/", json.dumps(server or SERVER_INFO).encode(),
                             json.dumps(model or MODEL_INFO).encode(), page_size)


def test_discovery_reads_endpoints_role_and_block_size():
    i = info()
    # The wildcard publisher host is replaced by the node URL's host; the *current* role
    # comes from /model_info (server_info keeps the launch role).
    assert i.kv_endpoint == "tcp://10.1.2.3:51705"
    assert i.replay_endpoint == "tcp://10.1.2.3:53659"
    assert i.phase is Phase.DECODE and i.bootstrap_port == 44321 and i.host == "10.1.2.3"
    assert i.block_size == 4 and i.role_switch and not i.priority_eviction
    assert i.url == "http://10.1.2.3:30000" and i.hints_path is None
    # A grammar backend holds outputs to JSON schemas; "none" (or an old engine) does not.
    assert not i.grammar
    assert info(server={**SERVER_INFO, "grammar_backend": "xgrammar"}).grammar
    assert not info(server={**SERVER_INFO, "grammar_backend": "none"}).grammar


def test_discovery_refuses_what_cannot_work():
    with pytest.raises(ConfigError, match="blocks of 4 tokens but cluster.page_size is 64"):
        info(page_size=64)
    with pytest.raises(ConfigError, match="without PD disaggregation"):
        info(model={**MODEL_INFO, "disaggregation_mode": "null"})
    with pytest.raises(ConfigError, match="dp_size=2"):
        info(server={**SERVER_INFO, "dp_size": 2})
    with pytest.raises(ConfigError, match="unexpected"):
        parse_engine_info("n0", "http://h:1", b"<html>", b"{}", 4)


def test_discovery_without_kv_events_or_replay():
    i = info(server={**SERVER_INFO, "kv_events": None})
    assert i.kv_endpoint is None and i.replay_endpoint is None
    kv = {**SERVER_INFO["kv_events"], "replay_endpoint_port_base": None}
    assert info(server={**SERVER_INFO, "kv_events": kv}).replay_endpoint is None


LOADS = {"timestamp": "2026-11-29T14:52:07Z", "version": "0.5.23", "loads": [{
    "timestamp": 1000.0, "dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2,
    "num_used_tokens": 500, "num_total_tokens": 900, "max_total_num_tokens": 4096,
    "token_usage": 0.12, "total_prefill_uncached_tokens": 100, "total_prefill_busy_us": 5000,
    "decode_moments": [10.0, 40.0, 50000.0, 160.0, 200000.0, 40.0],
    "disaggregation": {"mode": "decode", "prefill_bootstrap_queue_reqs": 0,
                       "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 1,
                       "decode_transfer_queue_reqs": 1, "decode_retracted_queue_reqs": 0,
                       "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0},
    "queues": {"waiting": 0, "grammar": 0, "paused": 0, "retracted": 0, "prealloc_ready": 0}}]}


def loads(**core):
    body = json.loads(json.dumps(LOADS))
    body["loads"][0].update(core)
    return parse_loads(json.dumps(body).encode())


def test_loads_become_node_state_with_its_age():
    t = LoadsTracker("n0")
    s = t.state(loads(), now=50.0, wall_now=1002.0)
    assert s.phase == "decode" and s.queued == 2 and s.decoding == 3 + 1
    assert s.kv_room == 4096 - 900 and s.l1_used == 500 and s.l1_capacity == 4096
    assert s.time == pytest.approx(48.0)  # the snapshot was 2 s old
    # A clock skew between hosts is not taken as an age.
    assert t.state(loads(), now=50.0, wall_now=900.0).time == 50.0


def test_loads_rejects_what_is_not_a_loads_answer():
    with pytest.raises(msgspec.ValidationError):
        parse_loads(b'{"loads": []}')
    with pytest.raises(msgspec.DecodeError):
        parse_loads(b"oops")


def test_decode_moments_summarise_the_iterations_between_polls():
    t = LoadsTracker("n0")
    assert t.decode_report(loads(), now=10.0) is None  # the first snapshot is the baseline
    r = t.decode_report(loads(decode_moments=[30.0, 100.0, 110000.0, 400.0, 500000.0, 100.0]),
                        now=10.5)
    assert r.count == 20 and r.batch == 3 and r.duration == pytest.approx(0.003)
    assert r.accepted == 60 and not r.is_prefill
    # Counters that went back (a new engine process) give no report.
    assert t.decode_report(loads(decode_moments=[1.0] * 6), now=11.0) is None


def test_prefill_report_only_when_one_prefill_explains_the_counters():
    t = LoadsTracker("n0")
    prev = loads()
    t.prefill_finished("r1", t_uc=37, t_c=4)
    r = t.prefill_report(loads(total_prefill_uncached_tokens=137, total_prefill_busy_us=9000),
                         prev, now=20.0)
    assert r is not None and r.duration == pytest.approx(0.004)
    assert r.prefill[0].t_uc == 37 and r.prefill[0].t_c == 4
    # Two prefills inside one poll: their busy time cannot be split, no report.
    t.prefill_finished("r2", 10, 0)
    t.prefill_finished("r3", 10, 0)
    assert t.prefill_report(loads(total_prefill_uncached_tokens=120), prev, now=21.0) is None


def test_generate_body_pairs_both_engines_on_one_room():
    s = Sampling(max_tokens=8, temperature=0.0, stop_token_ids=[2], seed=5)
    body = generate_body(np.array([5, 6, 7], dtype="uint32"), s, "r-1",
                         Bootstrap("10.0.0.1", 8998, 123), priority=1)
    assert body["input_ids"] == [5, 6, 7] and body["stream"] is True and body["rid"] == "r-1"
    assert (body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]) == \
        ("10.0.0.1", 8998, 123)
    assert body["sampling_params"] == {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0,
                                       "ignore_eos": False, "stop_token_ids": [2],
                                       "sampling_seed": 5}
    assert body["priority"] == 1
    assert "priority" not in generate_body([1], s, "r", Bootstrap("h", 1, 2))
    assert priority_for(final=False) == 1 and priority_for(final=True) == 0


def test_pair_book_gives_the_decode_side_the_prefill_room():
    book = PairBook()
    book.register_engine("p", "10.0.0.1", 8998)
    b1 = book.open("r", "p", now=0.0)
    assert book.find("r", "p") == b1 and book.find("r", "other") is None
    assert 0 <= b1.room < 2**63
    b2 = book.open("r", "p", now=1.0)  # a re-dispatch never reuses the room
    assert b2.room != b1.room
    book.prefill_over("r", "p", b2.room)
    assert asyncio.run(book.wait_prefill("r", "p", b2.room, 0.1))
    book.close("r", "p", b2.room)
    assert book.find("r", "p") is None


def test_stream_lines_and_cumulative_or_incremental_outputs():
    line = (b'data: {"text":"_E","output_ids":[65,39],"meta_info":{"id":"r","finish_reason":'
            b'null,"prompt_tokens":37,"completion_tokens":2,"cached_tokens":0}}')
    c = parse_sse_line(line)
    assert isinstance(c, Chunk) and c.output_ids == [65, 39]
    assert parse_sse_line(b"data: [DONE]") is DONE and parse_sse_line(b"") is None
    err = parse_sse_line(b'data: {"error": {"message": "too long", "code": 400}}')
    assert isinstance(err, StreamError) and err.message == "too long" and err.code == 400
    with pytest.raises(msgspec.DecodeError):
        parse_sse_line(b"data: {broken")
    fin = parse_sse_line(b'data: {"output_ids":[1],"meta_info":{"finish_reason":'
                         b'{"type":"abort","message":"bootstrap timeout","status_code":500},'
                         b'"completion_tokens":1}}')
    assert fin.meta_info.finish_reason.type == "abort"

    def chunk(ids, total):
        return Chunk(ids, MetaInfo(completion_tokens=total))

    cum = OutputCursor()
    assert [cum.new_tokens(chunk(ids, n)) for ids, n in
            (([1], 1), ([1, 2], 2), ([1, 2, 3], 3))] == [[1], [2], [3]]
    inc = OutputCursor()
    assert [inc.new_tokens(chunk(ids, n)) for ids, n in
            (([1], 1), ([2], 2), ([3, 4], 4))] == [[1], [2], [3, 4]]


def test_logprobs_and_a_grammar_are_asked_for_and_logprobs_read_in_either_mode():
    s = Sampling(max_tokens=8, logprobs=2, json_schema='{"type": "object"}')
    body = generate_body([1], s, "r", Bootstrap("h", 1, 2))
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2
    assert body["sampling_params"]["json_schema"] == '{"type": "object"}'
    assert "return_logprob" not in generate_body([1], Sampling(max_tokens=8), "r",
                                                 Bootstrap("h", 1, 2))
    for name in ("regex", "ebnf"):
        params = generate_body([1], Sampling(max_tokens=8, **{name: "x"}), "r",
                               Bootstrap("h", 1, 2))["sampling_params"]
        assert params[name] == "x" and "json_schema" not in params
    # SGLang's entries are (logprob, id, text); a position without alternatives is null.
    line = (b'data: {"output_ids":[7,9],"meta_info":{"completion_tokens":2,'
            b'"output_token_logprobs":[[-0.5,7,null],[-1.25,9,null]],'
            b'"output_top_logprobs":[[[-0.5,7,null],[-2.0,3,null]],null]}}')
    c = parse_sse_line(line)
    cur = OutputCursor()
    assert cur.new_tokens(c) == [7, 9]
    assert cur.new_logprobs(c) == TokenLogprobs([-0.5, -1.25], [[(7, -0.5), (3, -2.0)], []])

    def chunk(ids, total, lps):
        return Chunk(ids, MetaInfo(completion_tokens=total,
                                   output_token_logprobs=[(lp, i, None) for lp, i in lps]))

    cum, inc = OutputCursor(), OutputCursor()
    got = []
    for ids, n in (([1], 1), ([1, 2], 2), ([1, 2, 3, 4], 4)):
        c = chunk(ids, n, [(-i / 10, i) for i in ids])
        cum.new_tokens(c)
        got.append(cum.new_logprobs(c).sampled)
    assert got == [[-0.1], [-0.2], [-0.3, -0.4]]
    got = []
    for ids, n in (([1], 1), ([2], 2), ([3, 4], 4)):
        c = chunk(ids, n, [(-i / 10, i) for i in ids])
        inc.new_tokens(c)
        got.append(inc.new_logprobs(c).sampled)
    assert got == [[-0.1], [-0.2], [-0.3, -0.4]]
    assert cum.new_logprobs(Chunk([], MetaInfo())) is None  # not asked for


def test_the_prompts_logprobs_are_asked_of_the_prefill_engine_and_read_from_its_answer():
    s = Sampling(max_tokens=8, logprobs=1, prompt_logprobs=True)
    assert generate_body([1, 2], s, "r", Bootstrap("h", 1, 2), prefill=True)[
        "logprob_start_len"] == 0
    assert "logprob_start_len" not in generate_body([1, 2], s, "r", Bootstrap("h", 1, 2))
    assert "logprob_start_len" not in generate_body(
        [1, 2], Sampling(max_tokens=8, logprobs=1), "r", Bootstrap("h", 1, 2), prefill=True)
    # A prefill's last chunk: the first prompt token has no log-probability.
    line = (b'data: {"output_ids":[4],"meta_info":{"prompt_tokens":3,"completion_tokens":1,'
            b'"finish_reason":{"type":"length","length":1},'
            b'"input_token_logprobs":[[null,5,null],[-0.5,6,null],[-1.5,7,null]],'
            b'"input_top_logprobs":[null,[[-0.25,8,null]],[[-1.5,7,null]]]}}')
    assert prompt_logprobs(parse_sse_line(line).meta_info) == TokenLogprobs(
        [-0.5, -1.5], [[(8, -0.25)], [(7, -1.5)]])
    assert prompt_logprobs(MetaInfo(prompt_tokens=3)) == TokenLogprobs([], [])  # none sent

def test_errors_map_to_clear_messages():
    assert engine_message(b'{"error": {"message": "Input too long"}}') == "Input too long"
    assert engine_message(b'{"error": "bad contract"}') == "bad contract"
    assert engine_message(b'{"object": "error", "message": "m", "code": 400}') == "m"
    assert "loc" in engine_message(b'{"detail": [{"loc": ["body"], "msg": "x"}]}')
    assert engine_message(b"Internal Server Error") == "Internal Server Error"
    f = from_http(503, b'{"error": {"message": "overloaded"}}', "prefill")
    assert f.message == "prefill: HTTP 503: overloaded" and f.status == 503
    assert not f.unreachable and not f.rejected  # the engine's trouble, not the request's
    assert from_http(400, b'{"error": {"message": "bad schema"}}', "prefill").rejected
    refused = aiohttp.ClientConnectorError(
        aiohttp.client_reqrep.ConnectionKey("h", 1, False, True, None, None, None),
        ConnectionRefusedError(111, "Connection refused"))
    f = from_exception(refused, "decode")
    assert f.unreachable and "unreachable" in f.message and "refused" in f.message
    f = from_exception(aiohttp.ServerDisconnectedError(), "decode")
    assert f.unreachable and "closed the connection" in f.message
    assert from_exception(asyncio.TimeoutError(), "poll").unreachable
    assert not from_exception(ValueError("x"), "poll").unreachable


PATCH_INFO = {"version": "1", "switch_in_place": True, "count_hints": "/evinfra/hints",
              "fetch_action": "evinfra.fetch/1", "pool": "10.1.2.3:6001", "host_tier": True,
              "kv_resync": "/evinfra/kv_resync", "iterations": "/evinfra/iterations"}


def test_discovery_reads_the_engine_patch():
    i = info(server={**SERVER_INFO, "evinfra_engine_patch": PATCH_INFO,
                     "evinfra_count_hints": "/evinfra/hints"})
    assert i.switch_in_place and i.fetch and i.pool == "10.1.2.3:6001"
    assert i.hints_path == "/evinfra/hints" and i.kv_resync == "/evinfra/kv_resync"
    assert i.iterations == "/evinfra/iterations"
    stock = info()
    assert not stock.switch_in_place and not stock.fetch and stock.pool is None
    assert stock.kv_resync is None and stock.iterations is None
    # A future fetch protocol this driver does not speak is not used.
    newer = info(server={**SERVER_INFO, "evinfra_engine_patch": {**PATCH_INFO,
                                                                 "fetch_action": "evinfra.fetch/9"}})
    assert not newer.fetch and newer.switch_in_place


def test_generate_body_carries_the_fetch_plan_and_the_reply_its_reuse():
    s = Sampling(max_tokens=2)
    hints = {"protocol_version": "1", "message_id": "r", "actions": []}
    assert generate_body([1], s, "r", Bootstrap("h", 1, 2), kv_hints=hints)["kv_hints"] == hints
    assert "kv_hints" not in generate_body([1], s, "r", Bootstrap("h", 1, 2))
    chunk = parse_sse_line(b'data: {"output_ids": [], "meta_info": {"cached_tokens": 48, '
                           b'"cached_tokens_details": {"device": 48, "host": 0, '
                           b'"evinfra_fetched": 40, "evinfra_restored": 48, '
                           b'"evinfra_fetch_s": 0.0071}}}')
    assert chunk.meta_info.cached_tokens_details["evinfra_fetched"] == 40
    assert chunk.meta_info.cached_tokens_details["evinfra_fetch_s"] == 0.0071


def test_pair_book_names_each_engines_pool():
    book = PairBook()
    book.register_engine("p", "10.0.0.1", 8998, pool="10.0.0.1:6001")
    book.register_engine("d", "10.0.0.2", 8999)
    assert book.pool("p") == "10.0.0.1:6001" and book.pool("d") is None
    book.register_engine("p", "10.0.0.1", 8998)  # restarted stock: no pool any more
    assert book.pool("p") is None


def test_a_prefill_report_carries_restored_tokens():
    t = LoadsTracker("n0")
    prev = parse_loads(json.dumps({"loads": [{"total_prefill_uncached_tokens": 100,
                                              "total_prefill_busy_us": 1000}]}).encode())
    t.prefill_finished("r1", 9, 48, 48)
    now = parse_loads(json.dumps({"loads": [{"total_prefill_uncached_tokens": 109,
                                             "total_prefill_busy_us": 3000}]}).encode())
    report = t.prefill_report(now, prev, now=5.0)
    assert report is not None and report.prefill[0].t_rst == 48 and report.prefill[0].t_c == 48
