"""``evinfra replay`` as a real process: against ``evinfra serve`` (fake engines), against a
target that fails in every way a target can, and with a target or arguments that are bad."""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web
from engines import free_port  # tests/integration/sglang_cpu, on the path (conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def replay(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evinfra.cli", "replay", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]


def follow_ups(lines: list[dict]) -> list[dict]:
    """Requests after the first of their branch."""
    return [r for r in lines if not r["request_id"].endswith("#1")]


@pytest.fixture(scope="module")
def serve(fake_serve):
    return fake_serve.base


def test_cc_against_evinfra_serve_every_request_answered_and_reused(serve, tmp_path):
    out = tmp_path / "cc"
    done = replay("--target", serve, "--workload", "cc", "--agents", "8", "--duration", "300",
                  "--speedup", "20", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(done.stdout) == summary
    lines = rows(out)
    assert len(lines) >= 12 and all(r["status"] == "ok" for r in lines), [
        r["error"] for r in lines if r["status"] != "ok"]
    print(f"{len(lines)} requests, {len(follow_ups(lines))} follow-ups")
    assert summary["requests"] == len(lines)
    assert summary["errors"] == summary["unfinished"] == 0
    assert {r["agent_id"] for r in lines} == {f"cc-{i}" for i in range(8)}
    for r in lines:
        assert r["output_tokens"] == r["max_tokens"] and r["output_ids"] == "target"
        assert r["finish_reason"] == "length" and 0 < r["ttft"] <= r["e2e"]
        assert r["target_prompt_tokens"] == r["input_tokens"]
    # Every follow-up request of a branch finds its previous prompt in the KV cache.
    follow = follow_ups(lines)
    assert follow and all(r["cached_tokens"] > 0 for r in follow)
    assert sum(r["cached_tokens"] for r in follow) >= 0.9 * sum(r["ideal_cached"] for r in follow)
    assert summary["cached_reported"] and summary["kv_hit_rate"] > 0.3
    meta = json.loads((out / "replay.json").read_text())
    assert meta["model"] == "evinfra-fake" and meta["dropped_fields"] == []
    assert meta["runner"]["sent"] == len(lines) and meta["replayed_s"] == 300.0


def status(base: str) -> dict:
    with urllib.request.urlopen(base + "/v1/evinfra/status", timeout=5) as r:
        return json.loads(r.read())


def test_without_hints_the_server_infers_the_branches(serve, tmp_path):
    before = status(serve)["counters"]
    out = tmp_path / "bare"
    done = replay("--target", serve, "--workload", "cc", "--agents", "4", "--duration", "40",
                  "--speedup", "20", "--out", str(out), "--no-progress", "--no-hints")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = rows(out)
    assert lines and all(r["status"] == "ok" for r in lines)
    after = status(serve)["counters"]
    # A branch's follow-ups join its inferred branch (a compaction's would start a new one).
    follow = follow_ups(lines)
    assert follow and after["requests_chained"] - before["requests_chained"] >= len(follow) // 2
    # Each branch's second request makes its inferred branch (how many branches got that far
    # in the replay's two wall seconds depends on the machine's speed).
    assert after["branches_inferred"] - before["branches_inferred"] >= len(
        {r["branch_id"] for r in follow}) >= 1
    assert json.loads((out / "replay.json").read_text())["settings"]["no_hints"] is True


# ---- a target that fails -------------------------------------------------------------------

KINDS = ("ok", "500", "reset", "cut", "malformed", "error_chunk", "hang", "502_text")


class FaultyTarget:
    """Answers the ``k``-th completion as ``KINDS[k % len(KINDS)]``, on a loop in a thread."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FaultyTarget":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:  # handlers still sleeping ("hang"): end them before the loop closes
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "x"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = KINDS[len(self.kinds) % len(KINDS)]
        self.kinds.append(kind)
        if kind == "500":
            return web.json_response({"error": {"message": "internal"}}, status=500)
        if kind == "502_text":
            return web.Response(text="Bad Gateway", status=502)
        if kind == "reset":
            request.transport.close()
            await asyncio.sleep(1)
        if kind == "hang":
            await asyncio.sleep(600)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        first = {"choices": [{"index": 0, "text": "x", "token_ids": [1000]}]}
        await resp.write(b"data: " + json.dumps(first).encode() + b"\n\n")
        if kind == "cut":
            request.transport.close()
            return resp
        if kind == "malformed":
            await resp.write(b"data: {\"choices\": [\n\n")
        if kind == "error_chunk":
            await resp.write(b'data: {"error": {"message": "decode failed"}}\n\n')
        rest = {"choices": [{"index": 0, "text": "y" * (n - 1), "token_ids": [1001] * (n - 1),
                             "finish_reason": "length"}]}
        await resp.write(b"data: " + json.dumps(rest).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


def test_a_failing_target_never_stops_the_run_and_every_error_is_counted(tmp_path):
    out = tmp_path / "faulty"
    with FaultyTarget() as target:
        # As many agents as kinds: their first requests, all sent at the start, meet every
        # kind however slowly a loaded machine plays the rest of the run.
        done = replay("--target", target.url, "--workload", "cc", "--agents", str(len(KINDS)),
                      "--duration", "60", "--speedup", "10", "--timeout", "3",
                      "--out", str(out), "--no-progress")
        kinds = collections.Counter(target.kinds)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    lines = rows(out)
    print(f"{len(lines)} requests: {dict(kinds)}")
    assert len(lines) == sum(kinds.values()) >= len(KINDS)
    assert summary["requests"] == kinds["ok"] == sum(r["status"] == "ok" for r in lines)
    assert summary["errors"] == sum(kinds.values()) - kinds["ok"]
    assert summary["unfinished"] == 0
    errors = collections.Counter(r["error_kind"] for r in lines if r["status"] == "error")
    assert errors == {"HTTP": kinds["500"] + kinds["502_text"],
                      "connection": kinds["reset"] + kinds["cut"],
                      "malformed stream": kinds["malformed"],
                      "stream error": kinds["error_chunk"], "timeout": kinds["hang"]}
    messages = {r["error"] for r in lines}
    assert {"HTTP 500: internal", "HTTP 502: Bad Gateway", "stream error: decode failed",
            "timeout after 3 s"} <= messages


# ---- bad targets and arguments -------------------------------------------------------------

def test_an_unreachable_target_is_one_line_and_a_nonzero_exit(tmp_path):
    # It must give up rather than retry for the whole run: replay()'s timeout bounds it (no
    # wall-clock assertion of our own: a loaded machine starts Python slowly).
    done = replay("--target", f"http://127.0.0.1:{free_port()}", "--workload", "cc",
                  "--agents", "1", "--duration", "600", "--out", str(tmp_path / "x"))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "cannot reach" in done.stderr, done.stderr


@pytest.mark.parametrize("argv,match", [
    (["--target", "not a url", "--workload", "cc", "--agents", "1"], "--target"),
    (["--target", "http://127.0.0.1:1", "--workload", "cc", "--agents", "x"], "invalid int"),
    (["--target", "http://127.0.0.1:1", "--workload", "cc", "--agents", "1",
      "--arrival-rate", "2"], "not allowed with"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, argv, match):
    done = replay(*argv, "--duration", "5", "--out", str(tmp_path / "x"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and match in done.stderr, done.stderr
