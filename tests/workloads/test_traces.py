"""Trace readers: Mooncake (the shared trace and Dynamo's session rows), Trie, Dynamo agentic v2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from workload_fakes import INF, EchoBackend, output_ids, u32

from evinfra.errors import ConfigError
from evinfra.workloads import Phase, Runner, block_tokens, read_trace, stable_seed, synth

MOONCAKE = Path("/work/shared/data/mooncake_synthetic_trace.jsonl")


def write(tmp_path: Path, rows: list[dict], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def replay(workload, *, closed: int | None = None, delay: float = 1.0, page: int = 64,
           until: float | None = None):
    backend = EchoBackend(delay=delay)
    runner = Runner(backend, {workload.name: workload}, page_size=page, stop_at=until)
    if closed is None:
        runner.open_loop(workload.arrivals())
    else:
        runner.closed_loop([Phase(INF, {workload.name: closed})])
    backend.clock.run(until=until)
    return backend, runner


# ---- Mooncake ---------------------------------------------------------------------------------


@pytest.mark.skipif(not MOONCAKE.exists(), reason="shared Mooncake trace not present")
def test_mooncake_trace_prefix_sharing_is_exact():
    trace = read_trace(MOONCAKE, "mooncake")
    assert len(trace) == 3993
    rows = [json.loads(line) for line in MOONCAKE.read_text().splitlines()]
    # The reference: an unlimited shared cache over 512-token hash-id blocks.
    seen, hit, total = set(), 0, 0
    for row in rows:
        n = 0
        while n < len(row["hash_ids"]) and row["hash_ids"][n] in seen:
            n += 1
        hit += min(n * 512, row["input_length"])
        total += row["input_length"]
        seen.update(row["hash_ids"])
    backend, runner = replay(trace)
    records = runner.records
    ideal = sum(r.ideal_cached for r in records) / sum(r.input_tokens for r in records)
    assert abs(hit / total - 0.65) < 0.01
    assert abs(ideal - hit / total) < 0.01
    # Open loop at the trace's timestamps; lengths as the rows say.
    assert [r.send_time for r in runner.records[:3]] == [0.0, 0.0, 0.04]
    by_agent = {r.agent_id: r for r in backend.requests}
    first = by_agent["mooncake-0"]
    assert first.tokens.size == rows[0]["input_length"]
    assert first.max_tokens == rows[0]["output_length"]
    assert first.final and first.parent_branch_id is None


def test_mooncake_sessions_blocks_and_partial_last_block(tmp_path):
    path = write(tmp_path, [
        {"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [7, 8, 9],
         "session_id": "s"},
        {"timestamp": 1000, "input_length": 9, "output_length": 2, "hash_ids": [4, 5]},
        {"timestamp": 5000, "input_length": 30, "output_length": 4, "hash_ids": [7, 8, 9, 10],
         "session_id": "s", "delay": 2500},
    ])
    trace = read_trace(path, "mooncake", block_size=8, seed=4)
    assert len(trace) == 2 and [a.time for a in trace.arrivals()] == [0.0, 1.0]
    backend, _ = replay(trace)
    reqs = backend.by_id()
    s1, s2, other = reqs["mooncake-0:0#1"], reqs["mooncake-0:0#2"], reqs["mooncake-1:0#1"]
    ns = stable_seed(4, "mooncake")
    assert np.array_equal(s1.tokens, block_tokens(ns, [7, 8, 9], 8, 20))
    assert np.array_equal(s2.tokens[:24], u32(s1.tokens, block_tokens(ns, [9], 8, 8)[4:]))
    assert s2.tokens.size == 30 and other.tokens.size == 9
    # Turn 2 is sent its delay after turn 1's answer; each session row is one request.
    sent = dict(zip((r.request_id for r in backend.requests), backend.sent_at))
    assert sent["mooncake-0:0#2"] == 0 + 1 + 2.5
    assert [s1.final, s2.final, other.final] == [False, True, True]


def test_mooncake_bad_row_names_the_line(tmp_path):
    path = write(tmp_path, [{"timestamp": 0, "output_length": 3, "hash_ids": [1]},
                            {"timestamp": 0, "output_length": 0, "hash_ids": [1]}])
    with pytest.raises(ConfigError, match="line 2"):
        read_trace(path, "mooncake")


# ---- Trie -------------------------------------------------------------------------------------


def trie_rows():
    rows = [{"num_turns": 2, "input_prompt_length": 32, "assistant_response_length": [16, 20],
             "tool_call_output_length": [8, 12], "tool_call_latency": [0.5, 0.0],
             "final_assistant_response_length": 64}]
    return rows


def test_trie_turns_follow_the_client(tmp_path):
    path = write(tmp_path, trie_rows())
    trace = read_trace(path, "trie", seed=2)
    backend, runner = replay(trace, closed=1, until=20.0)
    r = [x for x in backend.requests if x.agent_id == "trie-0"]
    assert [x.max_tokens for x in r] == [16, 20, 64]
    prompt = synth((2, "trie", 0, "prompt"), 32)
    tool0, tool1 = (synth((2, "trie", 0, t, "tool"), n) for t, n in ((0, 8), (1, 12)))
    out0, out1 = output_ids(r[0].request_id, 16), output_ids(r[1].request_id, 20)
    assert np.array_equal(r[0].tokens, prompt)
    assert np.array_equal(r[1].tokens, u32(prompt, out0, tool0))
    assert np.array_equal(r[2].tokens, u32(prompt, out0, tool0, out1, tool1))
    sent = [t for x, t in zip(backend.requests, backend.sent_at) if x.agent_id == "trie-0"]
    assert sent == [0.0, 1.5, 2.5] and [x.final for x in r] == [False, False, True]
    # Closed loop cycles through the rows with fresh prompts per agent, as Trie does.
    again = [x for x in backend.requests if x.agent_id == "trie-1"]
    assert again and not np.array_equal(again[0].tokens, r[0].tokens)
    assert again[0].tokens.size == 32


def test_trie_rejects_inconsistent_rows(tmp_path):
    row = dict(trie_rows()[0], tool_call_latency=[0.5])
    with pytest.raises(ConfigError, match="line 1"):
        read_trace(write(tmp_path, [row]), "trie")


# ---- Dynamo agentic Mooncake v2 ---------------------------------------------------------------

HEADER = {"schema": "dynamo.agentic_mooncake", "version": 2, "block_size": 4,
          "hash_id_scope": "local", "source": {"format": "self-authored-test", "digest": "t1"}}


def row(rid, play, session, start, deps=(), hash_ids=(10, 20), n=8, out=2):
    return {"request_id": rid, "play_id": play, "session_id": session, "model": "m",
            "input_length": n, "output_length": out, "hash_ids": list(hash_ids),
            "not_before_ms": start,
            "dependencies": [{"request_id": d, "relation": rel, "trigger": trig, "delay_ms": ms}
                             for d, rel, trig, ms in deps]}


def agentic_rows():
    """Two plays (same hash ids, independent namespaces): a root that spawns two sub-agents
    (one at dispatch, one at completion) and joins the first; each child has two turns."""
    rows = [dict(HEADER)]
    for play, start in (("a", 0), ("b", 5000)):
        rows += [
            row(f"{play}-root", play, "main", start),
            row(f"{play}-left", play, "left", start + 20,
                [(f"{play}-root", "spawn", "dispatch", 20)], hash_ids=(30, 40)),
            row(f"{play}-right", play, "right", start + 1200,
                [(f"{play}-root", "spawn", "completion", 200)], hash_ids=(50,), n=3),
            row(f"{play}-left-2", play, "left", start + 1500,
                [(f"{play}-left", "sequence", "completion", 500)], hash_ids=(30, 40, 41), n=12),
            row(f"{play}-right-2", play, "right", start + 2600,
                [(f"{play}-right", "sequence", "completion", 400)], hash_ids=(50, 51), n=6),
            row(f"{play}-root-2", play, "main", start + 3000,
                [(f"{play}-root", "sequence", "completion", 300),
                 (f"{play}-left-2", "join", "completion", 700)], hash_ids=(10, 20, 21), n=9),
        ]
    return rows


def test_agentic_v2_dependencies_become_branches(tmp_path):
    trace = read_trace(write(tmp_path, agentic_rows()), "agentic", seed=1)
    assert len(trace) == 2 and [a.time for a in trace.arrivals()] == [0.0, 5.0]
    backend, runner = replay(trace, delay=1.0)
    sent = {r.tag: t for r, t in zip(backend.requests, backend.sent_at)}
    reqs = {r.tag: r for r in backend.requests}
    # left: 20 ms after root's dispatch; right: 200 ms after root's completion (t=1).
    assert sent["a-root"] == 0.0 and sent["a-left"] == pytest.approx(0.02)
    assert sent["a-right"] == pytest.approx(1.2)
    assert sent["a-left-2"] == pytest.approx(0.02 + 1 + 0.5)
    assert sent["a-right-2"] == pytest.approx(1.2 + 1 + 0.4)
    # root-2 waits for the later of root + 300 ms and left-2's end + 700 ms.
    assert sent["a-root-2"] == pytest.approx(max(1 + 0.3, 0.02 + 1 + 0.5 + 1 + 0.7))
    assert sent["b-root"] == 5.0
    assert reqs["a-left"].parent_branch_id == reqs["a-root"].branch_id
    assert reqs["a-right"].parent_branch_id == reqs["a-root"].branch_id
    assert reqs["a-left-2"].parent_branch_id is None
    assert [reqs[k].final for k in ("a-root", "a-root-2", "a-left-2", "a-right-2")] == [
        False, True, True, True]
    # Prompts from hash ids: shared within a play, independent across plays (local scope).
    assert np.array_equal(reqs["a-root-2"].tokens[:8], reqs["a-root"].tokens)
    assert np.array_equal(reqs["a-left-2"].tokens[:8], reqs["a-left"].tokens)
    assert not np.array_equal(reqs["a-root"].tokens, reqs["b-root"].tokens)
    assert reqs["a-right"].tokens.size == 3 and reqs["a-root-2"].tokens.size == 9
    assert runner.stats.finished == 2


@pytest.mark.parametrize("mutate, message", [
    (lambda rows: rows[0].update(version=1), "version 2"),
    (lambda rows: rows[0].pop("hash_id_scope"), "header"),
    (lambda rows: rows[6]["dependencies"][1].update(relation="replay_barrier"), "replay_barrier"),
    (lambda rows: rows[6]["dependencies"][1].update(request_id="a-left"), "not the last request"),
    (lambda rows: rows[3]["dependencies"][0].update(request_id="nope"), "unknown request"),
    (lambda rows: rows[4]["dependencies"][0].update(trigger="dispatch"), "dispatch trigger"),
])
def test_agentic_v2_rejects_what_it_cannot_lower(tmp_path, mutate, message):
    rows = agentic_rows()
    mutate(rows)
    with pytest.raises(ConfigError, match=message):
        read_trace(write(tmp_path, rows), "agentic")


def test_unknown_trace_format():
    with pytest.raises(ConfigError, match="unknown trace format"):
        read_trace("x.jsonl", "csv")
