"""The replay client against a scripted in-process target: what is sent, how failures of every
kind become records, the fallbacks, the output files, the end of a run and Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
import pytest
from aiohttp import web

from evinfra.core.clock import WallClock
from evinfra.errors import ConfigError, EvinfraError
from evinfra.workloads.summary import Summary
from evinfra.workloads import AgentRequest
from evinfra.workloads.http_backend import HttpBackend, render_words
from evinfra.workloads.replay import plan_from_args, replay


class Target:
    """An OpenAI-compatible target whose answer to the ``k``-th request is ``script(k, body)``:
    ``ok``, ``500``, ``reset`` (closes the connection before answering), ``cut`` (closes it
    mid-stream), ``hang``. ``reject`` names optional fields answered with a 400 (as a strict
    OpenAI server does)."""

    def __init__(self, script=lambda k, body: "ok", reject: tuple[str, ...] = ()) -> None:
        self.script = script
        self.reject = reject
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.kinds: list[str] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> "Target":
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                    shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        for field in self.reject:
            if field in body:
                return web.json_response({"error": {
                    "message": f"Unrecognized request argument supplied: {field}"}}, status=400)
        self.bodies.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        kind = self.script(len(self.kinds), body)
        self.kinds.append(kind)
        if kind == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if kind == "reset":
            request.transport.close()
            await asyncio.sleep(1)
        if kind == "hang":
            await asyncio.sleep(3600)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in body
        n = body["max_tokens"]
        for i in range(n):
            choice = ({"index": 0, "delta": {"content": "x"}} if chat else
                      {"index": 0, "text": "x"})
            choice["finish_reason"] = "length" if i == n - 1 else None
            if body.get("return_token_ids"):
                choice["token_ids"] = [100 + i]
            await resp.write(b"data: " + json.dumps({"id": "r", "choices": [choice]}).encode()
                             + b"\n\n")
            if kind == "cut" and i == 0:
                request.transport.close()
                return resp
        prompt = len(body["prompt"]) if not chat else len(body["messages"][0]["content"])
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": {
            "prompt_tokens": prompt, "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": prompt // 2}}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def target():
    made: list[Target] = []

    async def make(*args, **kwargs) -> Target:
        t = await Target(*args, **kwargs).start()
        made.append(t)
        return t

    yield make
    for t in made:
        await t.stop()


def req(rid: str = "a-0:0.1#1", parent: str | None = "a-0:0", final: bool = True,
        n: int = 3) -> AgentRequest:
    return AgentRequest(rid, "a-0", "a", "a-0:0.1", parent, final,
                        np.arange(1000, 1020, dtype=np.uint32), n)


async def backend_for(t: Target, **kw) -> tuple[aiohttp.ClientSession, HttpBackend]:
    session = aiohttp.ClientSession()
    return session, HttpBackend(session, WallClock(), base_url=t.url, model="m", **kw)


# ---- the HTTP backend ----------------------------------------------------------------------

async def test_sends_token_prompts_forced_lengths_and_branch_hints(target):
    t = await target()
    session, backend = await backend_for(t, api_key="k")
    async with session:
        outcome, info = await backend.call(req())
    body, headers = t.bodies[0], t.headers[0]
    assert body["prompt"] == list(range(1000, 1020)) and body["max_tokens"] == 3
    assert body["ignore_eos"] is True and body["return_token_ids"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert headers["x-evinfra-branch-id"] == "a-0:0.1"
    assert headers["x-evinfra-parent-branch-id"] == "a-0:0"
    assert headers["x-evinfra-branch-final"] == "true"
    assert headers["x-request-id"] == "a-0:0.1#1" and headers["authorization"] == "Bearer k"
    assert outcome.ok and outcome.tokens.tolist() == [100, 101, 102]
    assert outcome.cached_tokens == 10 and outcome.ttft > 0
    assert info.http_status == 200 and info.output_ids == "target"


async def test_a_later_request_of_a_branch_sends_no_parent_and_no_final(target):
    t = await target()
    session, backend = await backend_for(t)
    async with session:
        await backend.call(req(parent=None, final=False))
    assert "x-evinfra-parent-branch-id" not in t.headers[0]
    assert "x-evinfra-branch-final" not in t.headers[0]


async def test_a_rejected_optional_field_is_dropped_and_outputs_are_synthesized(target):
    t = await target(reject=("return_token_ids",))
    session, backend = await backend_for(t)
    async with session:
        first, info = await backend.call(req("r#1"))
        second, info2 = await backend.call(req("r#2"))
    assert backend.dropped == ["return_token_ids"]
    assert info.attempts == 2 and info2.attempts == 1
    assert all("return_token_ids" not in b and b["ignore_eos"] for b in t.bodies)
    assert first.ok and info.output_ids == "synth" and first.tokens.size == 3
    assert first.tokens.tolist() != second.tokens.tolist()  # keyed by the request id


async def test_chat_sends_one_user_message_of_pseudo_words(target):
    t = await target()
    session, backend = await backend_for(t, api="chat")
    async with session:
        outcome, info = await backend.call(req())
    (message,) = t.bodies[0]["messages"]
    assert message == {"role": "user",
                       "content": render_words(np.arange(1000, 1020, dtype=np.uint32))}
    assert outcome.ok and outcome.tokens.tolist() == [100, 101, 102]
    # The target's cached count (half its prompt) is scaled onto our 20 input tokens.
    assert info.target_cached_tokens == info.target_prompt_tokens // 2
    assert outcome.cached_tokens == 10


@pytest.mark.parametrize("kind,timeout,error", [
    ("500", 30.0, "HTTP 500: boom"),
    ("reset", 30.0, "connection: "),
    ("cut", 30.0, "connection: "),
    ("hang", 0.3, "timeout after 0.3 s"),
])
async def test_transport_failures_become_errors(target, kind, timeout, error):
    # Only the hang waits for its timeout: a short one on the others would race a loaded machine.
    t = await target(lambda k, body: kind)
    session, backend = await backend_for(t, timeout=timeout)
    async with session:
        outcome, info = await backend.call(req())
    assert not outcome.ok and outcome.error.startswith(error), outcome.error
    assert outcome.tokens.size == 0


async def test_a_refused_connection_is_an_error_not_an_exception():
    async with aiohttp.ClientSession() as session:
        backend = HttpBackend(session, WallClock(), base_url="http://127.0.0.1:9", model="m")
        outcome, info = await backend.call(req())
    assert outcome.error.startswith("connection: ") and info.error_kind == "connection"


async def test_send_answers_later_and_a_client_bug_fails_only_its_request(target, monkeypatch):
    t = await target()
    session, backend = await backend_for(t)
    got: list = []
    async with session:
        backend.send(req("ok#1"), got.append)
        assert got == [] and backend.in_flight == 1  # done is never called inside send

        async def broken(request):
            raise RuntimeError("parser bug")

        while backend.in_flight:
            await asyncio.sleep(0.01)
        monkeypatch.setattr(backend, "call", broken)
        backend.send(req("bug#1"), got.append)

        def runner_bug(outcome):
            raise ValueError("runner bug")

        backend.send(req("bug#2"), runner_bug)
        while backend.in_flight:
            await asyncio.sleep(0.01)
    assert got[0].ok and got[1].error == "client: RuntimeError: parser bug"
    assert isinstance(backend.failure, ValueError)  # kept for the run to raise at its end
    assert backend.info["bug#1"].error_kind == "client"


# ---- a whole replay ------------------------------------------------------------------------

def args(tmp_path: Path, url: str, **kw) -> argparse.Namespace:
    """``evinfra replay``'s namespace with the parser's defaults."""
    base = dict(target=url, api_key=None, workload=None, trace=None, format="mooncake",
                agents=None, arrival_rate=None, max_active=None, duration=10.0, speedup=1.0,
                model=None, api="completions", timeout=600.0, grace=30.0, page_size=64,
                token_range="1000:32000", seed=0, out=str(tmp_path / "out"), no_progress=True,
                no_hints=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_args_helper_matches_the_cli_parser(tmp_path, monkeypatch):
    import structlog

    import evinfra.workloads.replay as replay_module
    from evinfra.cli import main

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(replay_module, "run", lambda a: seen.append(a) or 0)
    config = structlog.get_config()
    try:
        assert main(["replay", "--target", "http://h:1", "--workload", "cc", "--agents", "2",
                     "--duration", "10", "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    finally:
        structlog.configure(**config)  # main() configured logging for a process
    mine = vars(args(tmp_path, "http://h:1", workload="cc", agents=2))
    parsed = vars(seen[0])
    assert {k: parsed[k] for k in mine} == mine


def trie(tmp_path: Path, agents: int = 3, turns: int = 3, pause: float = 1.0) -> str:
    path = tmp_path / "trie.jsonl"
    path.write_text("".join(json.dumps({
        "num_turns": turns, "input_prompt_length": 100 + 10 * i,
        "assistant_response_length": [3] * turns, "tool_call_output_length": [20] * turns,
        "tool_call_latency": [pause] * turns, "final_assistant_response_length": 2}) + "\n"
        for i in range(agents)))
    return str(path)


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]


async def test_replay_writes_every_request_the_summary_and_prints_it(target, tmp_path):
    t = await target(lambda k, body: "500" if k % 4 == 3 else "ok")
    plan = plan_from_args(args(tmp_path, t.url, trace=trie(tmp_path), format="trie",
                               agents=3, duration=20.0, speedup=20.0))
    stdout = io.StringIO()
    result = await replay(plan, stdout=stdout)
    out = plan.out
    rows = lines(out)
    summary = msgspec.json.decode((out / "summary.json").read_bytes(), type=Summary)
    assert json.loads(stdout.getvalue()) == json.loads((out / "summary.json").read_text())
    assert len(rows) == result.records == len(t.kinds) > 12
    assert summary.requests == sum(r["status"] == "ok" for r in rows) == t.kinds.count("ok")
    assert summary.errors == sum(r["status"] == "error" for r in rows) == t.kinds.count("500")
    assert summary.unfinished == 0 and summary.cached_reported
    for r in rows:
        assert r["status"] in ("ok", "error")
        if r["status"] == "ok":
            assert r["output_tokens"] == r["max_tokens"] and r["ttft"] <= r["e2e"]
            assert r["output_ids"] == "target" and r["http_status"] == 200
        else:
            assert r["error"] == "HTTP 500: boom" and r["http_status"] == 500
    meta = json.loads((out / "replay.json").read_text())
    assert meta["model"] == "m" and not meta["interrupted"] and meta["cut_at_end"] == 0
    assert meta["runner"]["sent"] == len(rows)


async def test_requests_in_flight_past_the_grace_are_cut_and_counted(target, tmp_path):
    # Every agent's second request hangs: at the end they are cut after the grace.
    t = await target(lambda k, body: "hang" if len(body["prompt"]) > 150 else "ok")
    plan = plan_from_args(args(tmp_path, t.url, trace=trie(tmp_path, pause=0.1),
                               format="trie", agents=3, duration=1.0, grace=0.2))
    result = await replay(plan, stdout=io.StringIO())
    rows = lines(plan.out)
    cut = [r for r in rows if r["status"] == "unfinished"]
    assert len(cut) == 3 == result.cut == result.summary.unfinished
    assert all(r["done_time"] is None and r["e2e"] is None for r in cut)
    assert rows[-3:] == cut  # written last


async def test_stop_event_cuts_at_once_and_writes_what_it_has(target, tmp_path):
    t = await target(lambda k, body: "ok" if k < 3 else "hang")
    plan = plan_from_args(args(tmp_path, t.url, trace=trie(tmp_path, pause=0.05),
                               format="trie", agents=3, duration=3600.0))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.5, stop.set)
    result = await asyncio.wait_for(replay(plan, stop=stop, stdout=io.StringIO()), 10)
    assert result.interrupted and result.cut == 3
    rows = lines(plan.out)
    assert [r["status"] for r in rows].count("ok") == 3
    assert json.loads((plan.out / "replay.json").read_text())["interrupted"]


async def test_open_loop_with_a_cap_and_a_progress_line(target, tmp_path):
    t = await target()
    plan = plan_from_args(args(tmp_path, t.url, trace=trie(tmp_path, agents=4, pause=0.05),
                               format="trie", arrival_rate=20.0, max_active=2, duration=1.0))
    plan.progress = True
    stderr = io.StringIO()
    result = await replay(plan, stdout=io.StringIO(), stderr=stderr)
    rows = lines(plan.out)
    assert result.summary.requests == len(rows) > 0 and plan.connections == 8
    assert any(r["queued"] > 0 for r in rows)  # arrivals beyond the cap waited
    assert "replay" in stderr.getvalue() and "ok" in stderr.getvalue()


async def test_probe_failures(target, tmp_path):
    with pytest.raises(EvinfraError, match="cannot reach http://127.0.0.1:9"):
        await replay(plan_from_args(args(tmp_path, "http://127.0.0.1:9", workload="cc",
                                         agents=1)), stdout=io.StringIO())
    t = await target()
    with pytest.raises(ConfigError, match="not served"):
        await replay(plan_from_args(args(tmp_path, t.url, workload="cc", agents=1,
                                         model="other")), stdout=io.StringIO())


# ---- arguments -----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(target="localhost:8000"), "http"),
    (dict(target="ftp://x"), "http"),
    (dict(duration=0.0), "--duration"),
    (dict(duration=math.inf), "--duration"),
    (dict(speedup=-1.0), "--speedup"),
    (dict(agents=0), "--agents"),
    (dict(agents=None, arrival_rate=-1.0), "--arrival-rate"),
    (dict(max_active=3), "--max-active caps an open loop"),
    (dict(workload="nope"), "unknown workload"),
    (dict(workload=None, trace="/no/such/file"), "no such file"),
    (dict(agents=None), "give --agents"),
    (dict(workload="shift", agents=None, arrival_rate=1.0), "closed-loop"),
    (dict(token_range="5"), "--token-range"),
    (dict(token_range="9:3"), "--token-range"),
])
def test_bad_arguments_are_config_errors(tmp_path, kw, match):
    a = args(tmp_path, "http://127.0.0.1:8000", workload="cc", agents=2)
    for k, v in kw.items():
        setattr(a, k, v)
    with pytest.raises(ConfigError, match=match):
        plan_from_args(a)


def test_plans(tmp_path):
    plan = plan_from_args(args(tmp_path, "http://h:1/v1/", workload="shift", agents=8))
    assert plan.target == "http://h:1"
    assert [p.agents for p in plan.schedule] == [
        {"putnam": 8}, {"putnam": 4, "osworld": 2}, {"osworld": 4}]
    assert plan.connections == 32 and set(plan.workloads) == {"putnam", "osworld"}
    uncapped = plan_from_args(args(tmp_path, "http://h:1", workload="cc", arrival_rate=0.5))
    assert uncapped.schedule is None and uncapped.connections == 1024
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text('{"timestamp": 0, "hash_ids": [1], "output_length": 2}\n'
                        '{"timestamp": 2500, "hash_ids": [1, 2], "output_length": 2}\n')
    own_times = plan_from_args(args(tmp_path, "http://h:1", trace=str(mooncake)))
    assert [a.time for a in own_times.arrivals] == [0.0, 2.5] and own_times.finite_until == 2.5
    assert plan_from_args(args(tmp_path, "http://h:1", api_key="s", workload="cc", agents=1)
                          ).settings["api_key"] == "***"
