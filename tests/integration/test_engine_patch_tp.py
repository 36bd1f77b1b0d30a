"""Tensor parallelism: the ranks of one engine flip at the same scheduler iteration, deciding
together over their own gloo group (``engine_patch/ranks.py``), in two processes of the SGLang
venv (``sglang_cpu/ranks_probe.py``; torch.distributed as SGLang's TP ranks use it).

Rank 0 has drained at iteration 2, rank 1 at iteration 5: with the joint decision both flip
at 5; each deciding alone (the control), rank 0 would flip at 2, before rank 1 can. With rank 1
never draining and a 0.25 s drain limit, both give up at the same iteration, and neither
flips (alone, rank 0 would have flipped at 2 and rank 1 given up).

A fetch's steps are taken together the same way (``engine_patch/fetch.py``,
``sglang_cpu/fetch_ranks_probe.py``): a read is used once every rank's is over, with the pages
every rank read (none when one rank's read failed), and every rank stops waiting for it in the
same iteration; each against the control of ranks deciding alone.

Then (``heavy``) a real SGLang engine with ``--tp-size 2`` on CPU (SGLang runs it there: gloo
all-reduce, one core per rank through ``SGLANG_CPU_OMP_THREADS_BIND``) runs the patch: it
switches P->D->P in place, both ranks flipping (each logs its ``evinfra_switch``), and is
healthy after each, with its host-tier features on; and two such engines, the prefill one's
ranks each fetching their shard of the other's host pool (README: "Tensor parallelism").
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _require_sglang
from engines import HICACHE_ARGS, REPO, SHADOW, Engine, free_port, sglang_python
from pd_client import http

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).parent / "sglang_cpu" / "ranks_probe.py"
FETCH_PROBE = Path(__file__).parent / "sglang_cpu" / "fetch_ranks_probe.py"


def run(mode: str, case: str = "", probe: Path = PROBE) -> dict[int, list]:
    _require_sglang()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVINFRA_")}
    # (SHADOW: the CPU stand-ins of SGLang's GPU-only imports; fetch.py imports SGLang.)
    env.update(PYTHONPATH=os.pathsep.join(map(str, (SHADOW, REPO))), GLOO_SOCKET_IFNAME="lo",
               OMP_NUM_THREADS="1")
    args = [mode, case] if case else [mode]
    procs = [subprocess.Popen([str(sglang_python()), str(probe), str(r), str(port), *args],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=str(REPO)) for r in (0, 1)]
    out = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        line = next((x for x in stdout.splitlines() if x.startswith("PROBE ")), None)
        assert p.returncode == 0 and line, stdout[-2000:] + stderr[-3000:]
        got = json.loads(line[6:])
        out[got["rank"]] = (got["events"] if isinstance(got["events"], dict)
                            else [tuple(e) for e in got["events"]])
    return out


def test_both_ranks_flip_when_the_last_one_has_drained():
    assert run("agree", "drain") == {0: [("flip", 5)], 1: [("flip", 5)]}
    assert run("alone", "drain") == {0: [("flip", 2)], 1: [("flip", 5)]}  # the control


def test_both_ranks_give_up_together_when_one_cannot_drain():
    agreed = run("agree", "timeout")
    assert agreed[0] == agreed[1] and agreed[0][0][0] == "gave_up"
    alone = run("alone", "timeout")
    assert alone[0] == [("flip", 2)] and alone[1][0][0] == "gave_up"  # the control


@functools.cache
def fetch_steps(mode: str) -> dict[str, dict[int, list]]:
    """Per case of ``fetch_ranks_probe.py``, each rank's events (one pair of processes for
    all cases: each start imports SGLang)."""
    out = run(mode, probe=FETCH_PROBE)
    return {case: {r: [tuple(e) for e in out[r][case]] for r in out} for case in out[0]}


def test_a_fetched_read_is_used_by_both_ranks_once_both_have_read_it():
    """Rank 0's read of its shard is over at iteration 1, rank 1's at 3: both use the 12
    pages at 3 (alone, the control: rank 0 at 1, before rank 1 has its heads)."""
    assert fetch_steps("agree")["read"] == {0: [("used", 3, 12)], 1: [("used", 3, 12)]}
    assert fetch_steps("alone")["read"] == {0: [("used", 1, 12)], 1: [("used", 3, 12)]}


def test_a_read_that_failed_on_one_rank_is_used_by_no_rank():
    """Rank 1's read fails: neither rank uses the pages (alone: rank 0 would use its 12, and
    its tree would hold pages rank 1's does not). A rank that read fewer pages than the
    other cuts both to its count."""
    assert fetch_steps("agree")["fail"] == {0: [("used", 2, 0)], 1: [("used", 2, 0)]}
    assert fetch_steps("alone")["fail"] == {0: [("used", 1, 12)], 1: [("used", 2, 0)]}
    assert fetch_steps("agree")["short"] == {0: [("used", 2, 8)], 1: [("used", 2, 8)]}
    assert fetch_steps("alone")["short"] == {0: [("used", 1, 12)], 1: [("used", 2, 8)]}


def test_both_ranks_stop_waiting_for_a_fetch_in_the_same_iteration():
    """Rank 1's clock passes the fetch limit at iteration 3, rank 0's never: both let the
    request go at 3 (alone: only rank 1, and the ranks' queues would differ)."""
    assert fetch_steps("agree")["timeout"] == {0: [("gave_up", 3)], 1: [("gave_up", 3)]}
    assert fetch_steps("alone")["timeout"] == {0: [], 1: [("gave_up", 3)]}


def test_a_pool_shard_that_fails_to_start_on_one_rank_starts_on_none():
    """Rank 1 cannot open its Mooncake engine: no rank serves (alone, the control: rank 0
    would serve one shard of two)."""
    refused = ("refused", "rank 1: RuntimeError: no mooncake here")
    assert fetch_steps("agree")["pool_start"] == {0: [refused], 1: [refused]}
    alone = fetch_steps("alone")["pool_start"]  # (each rank knows of itself only)
    assert alone == {0: [("serving", 1)], 1: [("refused", "rank 0: RuntimeError: no mooncake "
                                                          "here")]}


@pytest.mark.heavy  # a tp=2 engine on two cores: three minutes (make test-heavy)
def test_a_tp2_engine_switches_in_place_on_both_ranks(tmp_path_factory):
    from tiny_model import write_model_dir

    _require_sglang()
    model = write_model_dir(tmp_path_factory.mktemp("tiny-llama-tp"))
    logs = Path(os.environ.get("EVINFRA_SGLANG_LOGS") or tmp_path_factory.mktemp("tp-logs"))
    e = Engine("tp2", "prefill", model, logs, patch=True,
               extra_args=HICACHE_ARGS + ("--tp-size", "2"),
               env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        e.start()
        e.wait_ready(timeout=400)
        info = http("GET", e.url + "/server_info")[1]
        assert info["tp_size"] == 2 and info["evinfra_engine_patch"]["switch_in_place"]
        for role in ("decode", "prefill"):
            body = {"new_role": role, "decode_cuda_graph_memory_gb": 0}
            code, out = http("POST", e.url + "/pd_role_switch", body, timeout=120)
            assert code == 200 and out["success"], out
            assert http("GET", e.url + "/model_info")[1]["disaggregation_mode"] == role
            assert http("GET", e.url + "/health")[0] == 200
        # Two switches, each logged by both ranks (SGLang prefixes rank 1's lines "TP1"; the
        # answer comes from rank 0, whose line may be written first).
        deadline = time.monotonic() + 20
        while True:
            log = e.log_path.read_bytes()[e._log_start:].decode(errors="replace")  # this start
            flips = [line for line in log.splitlines() if "evinfra_switch {" in line]
            if len(flips) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(flips) == 4 and sum("TP1]" in line for line in flips) == 2, flips
        assert all('"ok": true' in line for line in flips)
        # The host-tier features are on at tp=2: each rank serves its shard of the pool.
        assert "evinfra engine patch: pool off" not in log
        patch = http("GET", e.url + "/server_info")[1]["evinfra_engine_patch"]
        assert patch["fetch_action"] == "evinfra.fetch/1" and patch["pool"]
    finally:
        e.stop()


@pytest.mark.heavy  # two tp=2 engines on two cores: minutes (make test-heavy)
def test_a_tp2_prefill_fetches_every_ranks_shard_from_a_tp2_peer(tmp_path_factory):
    """Two patched tp = 2 engines (each rank's host pool holds one of the model's two KV
    heads): engine ``a``'s ranks each read their shard of ``b``'s host pool, and the output
    is the one computed from scratch; with the fetched pages zeroed (on every rank) it is not.
    Each equivalence is trusted only after the control: another prefix changes the output."""
    from context_model import write_context_model_dir
    from test_engine_patch_sglang import (CORRUPT, LP, P, assert_context_matters,
                                          assert_same_output, corrupted, differences, flush,
                                          gen, status, tokens)

    from evinfra.core.hashing import block_hashes
    from evinfra.engine_patch.wire import FetchPlan, FetchRunWire, fetch_kv_hints

    _require_sglang()
    model = write_context_model_dir(tmp_path_factory.mktemp("context-llama-tp"),
                                    sglang_python())
    logs = Path(os.environ.get("EVINFRA_SGLANG_LOGS") or tmp_path_factory.mktemp("tp-logs"))
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "EVINFRA_TEST_CORRUPT_KV": str(model / CORRUPT)}
    es = {n: Engine(f"tp2{n}", role, model, logs, patch=True, env=env,
                    extra_args=HICACHE_ARGS + ("--tp-size", "2", "--load-format", "safetensors"),
                    max_total_tokens=2048)
          for n, role in (("a", "prefill"), ("b", "decode"))}
    try:
        for e in es.values():
            e.start()
        for e in es.values():
            e.wait_ready(timeout=600)
        a, b = es["a"], es["b"]
        for e in (a, b):
            st = status(e)
            assert st["disabled"] == {}, st["disabled"]
            shards = st["pool"]["shards"]
            assert len(shards) == 2 and shards[0]["session"] != shards[1]["session"]
            # Each rank's host pool holds one KV head (of the model's two) per token, layer
            # and plane: head_dim 16 in the engine's float16 KV cache.
            assert [x["layout"]["token_bytes"] for x in shards] == [16 * 2, 16 * 2]
        prompt = tokens(31, 48) + tokens(32, 9)
        base = gen(a, b, prompt, 8, logprob_start=LP)
        assert base["prefill"]["cached_tokens"] == 0
        assert_context_matters(a, b, prompt, 48, base)
        flush(a)
        peer = http("GET", b.url + "/server_info")[1]["evinfra_engine_patch"]["pool"]
        plan = FetchPlan(P, [FetchRunWire(peer, 0, block_hashes(prompt, P)[:12])])
        r = gen(a, b, prompt, 8, kv_hints=fetch_kv_hints(plan, "t-tp"), decode_delay_s=0.5,
                logprob_start=LP)
        details = r["prefill"]["cached_tokens_details"]
        assert details["evinfra_fetched"] == 48 and r["prefill"]["cached_tokens"] >= 48
        assert_same_output(r, base)
        rec = next(x for x in status(a)["fetch"]["recent"] if x["rid"] == r["rid"])
        assert rec["outcome"] == "fetched" and rec["fetched_pages"] == 12, rec
        pool = status(b)["pool"]
        # One lease for both ranks of a, released by both.
        assert pool["leases"] == 1 and pool["released"] == 1 and pool["open_leases"] == 0
        flush(a)
        prompt2 = tokens(33, 48) + tokens(34, 9)
        base2 = gen(a, b, prompt2, 8, logprob_start=LP)
        flush(a)
        plan2 = FetchPlan(P, [FetchRunWire(peer, 0, block_hashes(prompt2, P)[:12])])
        try:
            with corrupted(model, "fetch"):
                bad = gen(a, b, prompt2, 8, kv_hints=fetch_kv_hints(plan2, "t-tp-bad"),
                          decode_delay_s=0.5, logprob_start=LP)
            assert bad["prefill"]["cached_tokens_details"]["evinfra_fetched"] == 48
            diffs = differences(bad, base2)
            assert any(d.startswith("input_logprobs") for d in diffs), diffs
            print(f"\ntp=2 fetch: same output; zeroed fetched pages: {diffs}")
        finally:
            flush(a)
    finally:
        for e in es.values():
            e.stop()
