"""``evinfra replay``: agent traffic against any OpenAI-compatible endpoint (issue 8).

The runner of ``runner.py`` plays the workload on a :class:`~evinfra.core.clock.WallClock`
against :class:`~evinfra.workloads.http_backend.HttpBackend`: real requests, real pauses
(divided by ``--speedup``), exact prefix sharing, forced output lengths (paper 6.1, after the
Trie replayer). A run has four steps:

1. **plan** (:func:`plan_from_args`, pure): validate the arguments, build the workloads and
   the arrival policy. Closed loop: ``--agents N`` kept running, a finished agent replaced at
   once; ``--workload shift`` plays the paper's schedule (6.3) scaled so its first phase runs N
   agents. Open loop: Poisson arrivals at ``--arrival-rate`` agents/s, or a trace's own
   timestamps when neither is given, with ``--max-active`` as the admission cap (paper D.3).
2. **probe** the target (``GET /v1/models``, three tries in about 2 s): it must answer, and
   the model is the one asked for or the first it lists.
3. **play** for ``--duration`` seconds of replayed time (``duration / speedup`` of wall time),
   then **drain**: requests in flight get ``--grace`` seconds to finish, then are cut (they stay
   ``unfinished``). Ctrl-C (or SIGTERM) stops at once: sends stop, in-flight requests are cut,
   and what the run has is written (exit 130).
4. **write** ``requests.jsonl`` (one line per request, as each completes, the cut ones last),
   ``summary.json`` (:class:`~evinfra.workloads.summary.Summary`, the simulator's schema, over the
   whole run: first send to the end of the drain) and ``replay.json`` (settings and counters),
   and print the summary on stdout.

Times in the files are wall seconds since the run began; TTFT and E2E are real (never scaled
by the speedup). A request waiting for one of the session's connections (4 per agent slot)
counts that wait in its TTFT, as a client sees it. Exit codes: 0 done, 1 target unreachable
or rejected, 2 bad arguments, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import signal
import sys
import time
from pathlib import Path
from typing import IO, Iterable

import aiohttp
import msgspec
import numpy as np
from yarl import URL

from evinfra.core.clock import Timer, WallClock
from evinfra.errors import ConfigError, EvinfraError
from evinfra.workloads.summary import Summary, summarise
from evinfra.workloads.arrivals import Arrival, Phase, poisson_arrivals
from evinfra.workloads.backend import RequestRecord
from evinfra.workloads.http_backend import Api, HttpBackend, RequestInfo
from evinfra.workloads.program import Workload
from evinfra.workloads.registry import GENERATORS, TRACE_FORMATS, make_workload, read_trace
from evinfra.workloads.runner import Runner
from evinfra.workloads.shift import paper_shift
from evinfra.workloads.tokens import TokenSpace

__all__ = ["Plan", "ReplayResult", "RequestLine", "plan_from_args", "replay", "run"]

WORKLOADS = (*sorted(GENERATORS), "shift")
CONNECTIONS_PER_AGENT = 4  # an agent's sub-agents run in parallel (cc: up to 3 at once)
UNCAPPED_CONNECTIONS = 1024  # open loop without --max-active
PROBE_TRIES = 3
PROBE_TIMEOUT = 5.0


class Plan(msgspec.Struct, kw_only=True):
    """A validated replay: what to play, where, and for how long (wall seconds = ``duration /
    speedup``). ``arrivals`` is None for a closed loop (``schedule`` then)."""

    target: str
    model: str | None
    api: Api
    api_key: str | None
    workloads: dict[str, Workload]
    schedule: list[Phase] | None = None
    arrivals: Iterable[Arrival] | None = None
    max_active: int | None = None
    finite_until: float | None = None
    """For a trace that ends: the replayed time of its last arrival (the run may end early
    once every agent is done after it); None for endless workloads."""
    duration: float
    speedup: float
    timeout: float
    grace: float
    page_size: int
    space: TokenSpace
    connections: int
    out: Path
    progress: bool
    settings: dict
    hints: bool = True
    """Send the branch hints (``--no-hints``: none, as a harness that sends none)."""


def _target(url: str) -> str:
    try:
        parsed = URL(url)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--target {url!r} is not a URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"--target {url!r} must be an http(s) URL such as "
                          "http://127.0.0.1:8000")
    base = str(parsed.with_query(None).with_fragment(None)).rstrip("/")
    # The OpenAI clients' base_url convention (".../v1") is accepted too.
    return base[:-3] if base.endswith("/v1") else base


def _token_space(text: str) -> TokenSpace:
    try:
        low, high = (int(x) for x in text.split(":"))
        return TokenSpace(low, high)
    except ValueError as exc:
        raise ConfigError(f"--token-range {text!r} must be LOW:HIGH with 0 <= LOW < HIGH "
                          "<= 2^32 (the target's vocabulary)") from exc


def plan_from_args(args: argparse.Namespace) -> Plan:
    """Validate ``evinfra replay``'s arguments; :class:`ConfigError` (exit 2) names the bad one."""
    target = _target(args.target)
    for name, value, low in (("--duration", args.duration, 0), ("--speedup", args.speedup, 0),
                             ("--timeout", args.timeout, 0), ("--grace", args.grace, None),
                             ("--page-size", args.page_size, 0)):
        if not ((value > low if low is not None else value >= 0) and value < math.inf):
            need = "positive" if low is not None else "non-negative"
            raise ConfigError(f"{name} must be {need} and finite, got {value}")
    if args.agents is not None and args.agents < 1:
        raise ConfigError(f"--agents must be at least 1, got {args.agents}")
    if args.arrival_rate is not None and not 0 < args.arrival_rate < math.inf:
        raise ConfigError(f"--arrival-rate must be positive, got {args.arrival_rate}")
    if args.max_active is not None:
        if args.agents is not None:
            raise ConfigError("--max-active caps an open loop; with --agents the loop is closed")
        if args.max_active < 1:
            raise ConfigError(f"--max-active must be at least 1, got {args.max_active}")
    space = _token_space(args.token_range)
    schedule: list[Phase] | None = None
    arrivals: Iterable[Arrival] | None = None
    finite_until: float | None = None
    if args.workload is not None:
        if args.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {args.workload!r}; use one of "
                              f"{', '.join(WORKLOADS)}")
        if args.agents is None and args.arrival_rate is None:
            raise ConfigError("give --agents N (closed loop) or --arrival-rate R (open loop)")
        if args.workload == "shift":
            if args.agents is None:
                raise ConfigError("--workload shift is a closed-loop schedule: give --agents")
            workloads = {w: make_workload(w, args.seed, space) for w in ("putnam", "osworld")}
            schedule = _scaled(paper_shift(), args.agents)
        else:
            workloads = {args.workload: make_workload(args.workload, args.seed, space)}
            name = args.workload
    else:
        if args.format not in TRACE_FORMATS:
            raise ConfigError(f"unknown trace format {args.format!r}; use one of "
                              f"{', '.join(sorted(TRACE_FORMATS))}")
        if not Path(args.trace).is_file():
            raise ConfigError(f"--trace {args.trace!r}: no such file")
        trace = read_trace(args.trace, args.format, seed=args.seed, space=space)
        workloads, name = {trace.name: trace}, trace.name
        if args.agents is None and args.arrival_rate is None:
            if trace.starts is None:
                raise ConfigError(f"the {args.format} trace has no timestamps: give --agents N "
                                  "or --arrival-rate R")
            arrivals = trace.arrivals()
        if not trace.cycle:
            finite_until = max(trace.starts or [0.0]) if arrivals is not None else 0.0
    if schedule is None and arrivals is None:
        if args.agents is not None:
            schedule = [Phase(math.inf, {name: args.agents})]
        else:
            arrivals = poisson_arrivals({name: args.arrival_rate}, args.seed)
            if finite_until is not None:
                finite_until = math.inf  # endless arrivals: a finite trace never ends early
    slots = (max(sum(p.agents.values()) for p in schedule) if schedule is not None
             else args.max_active)
    connections = CONNECTIONS_PER_AGENT * slots if slots else UNCAPPED_CONNECTIONS
    settings = {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "api_key")}
    settings["api_key"] = "***" if args.api_key else None
    return Plan(target=target, model=args.model, api=args.api, api_key=args.api_key,
                workloads=workloads, schedule=schedule, arrivals=arrivals,
                max_active=args.max_active, finite_until=finite_until, duration=args.duration,
                speedup=args.speedup, timeout=args.timeout, grace=args.grace,
                page_size=args.page_size, space=space, connections=connections,
                out=Path(args.out), progress=not args.no_progress, settings=settings,
                hints=not args.no_hints)


def _scaled(schedule: list[Phase], agents: int) -> list[Phase]:
    """The schedule with every count scaled so its first phase runs ``agents`` (at least one
    agent of each workload a phase names)."""
    scale = agents / sum(schedule[0].agents.values())
    return [Phase(p.duration, {w: max(1, round(n * scale)) if n else 0
                               for w, n in p.agents.items()}) for p in schedule]


# ---- the pieces of a run -------------------------------------------------------------------

class RunClock(WallClock):
    """The loop's time, from the run's start: records and the summary read as offsets."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(loop)
        self.origin = self._loop.time()

    def now(self) -> float:
        return self._loop.time() - self.origin

    def call_at(self, when: float, callback, *args) -> Timer:
        return self._loop.call_at(when + self.origin, callback, *args)


class RequestLine(msgspec.Struct):
    """One line of ``requests.jsonl``: the runner's record and the backend's
    :class:`~evinfra.workloads.http_backend.RequestInfo`. ``status`` is ``ok``, ``error`` or
    ``unfinished`` (cut at the end of the run). Seconds since the run began; ``ttft`` and
    ``e2e`` from the send (``queued``, an open-loop agent's admission wait, is apart)."""

    request_id: str
    agent_id: str
    workload: str
    branch_id: str
    parent_branch_id: str | None
    tag: str
    final: bool
    status: str
    error: str | None
    error_kind: str | None
    http_status: int | None
    send_time: float
    queued: float
    ttft: float | None
    e2e: float | None
    done_time: float | None
    input_tokens: int
    max_tokens: int
    output_tokens: int
    cached_tokens: int | None
    ideal_cached: int
    finish_reason: str | None
    output_ids: str | None
    target_prompt_tokens: int | None
    target_cached_tokens: int | None
    response_id: str | None
    attempts: int

    @classmethod
    def of(cls, r: RequestRecord, info: RequestInfo | None) -> "RequestLine":
        info = info or RequestInfo(attempts=0)
        e2e = r.e2e
        return cls(
            r.request_id, r.agent_id, r.workload, r.branch_id, r.parent_branch_id, r.tag,
            r.final, "unfinished" if r.status == "pending" else r.status, r.error,
            info.error_kind, info.http_status, _us(r.send_time), _us(r.queued), _us(r.ttft),
            _us(e2e), _us(r.done_time), r.input_tokens, r.max_tokens, r.output_tokens,
            r.cached_tokens, r.ideal_cached, info.finish_reason, info.output_ids,
            info.target_prompt_tokens, info.target_cached_tokens, info.response_id,
            info.attempts)


def _us(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


class RecordWriter:
    """Writes each completed record to ``requests.jsonl`` at once (the runner's
    ``on_record``), and keeps the counts and recent TTFTs the progress line shows."""

    def __init__(self, path: Path, backend: HttpBackend) -> None:
        self.path = path
        self.backend = backend
        self.file: IO[bytes] = open(path, "wb")
        self.enc = msgspec.json.Encoder()
        self.ok = self.errors = 0
        self.ttfts: collections.deque[float] = collections.deque(maxlen=256)

    def write(self, record: RequestRecord) -> None:
        info = self.backend.info.pop(record.request_id, None)
        if record.status == "ok":
            self.ok += 1
            if record.ttft is not None:
                self.ttfts.append(record.ttft)
        else:
            self.errors += 1
        self.file.write(self.enc.encode(RequestLine.of(record, info)) + b"\n")

    def finish(self, records: Iterable[RequestRecord]) -> int:
        """Append the requests that never completed; how many."""
        cut = 0
        for r in records:
            if r.done_time is None:
                self.file.write(self.enc.encode(RequestLine.of(r, None)) + b"\n")
                cut += 1
        self.file.close()
        return cut


class Progress:
    """A live status line on stderr: redrawn in place on a terminal, a plain line every few
    seconds otherwise. No dependency; ``--no-progress`` turns it off."""

    def __init__(self, stream: IO[str], runner: Runner, backend: HttpBackend,
                 writer: RecordWriter, end: float) -> None:
        self.stream = stream
        self.runner = runner
        self.backend = backend
        self.writer = writer
        self.end = end
        self.tty = stream.isatty()
        self.every = 0.25 if self.tty else 5.0
        self.last = -math.inf

    def line(self, now: float, phase: str, grace: float = 0.0) -> str:
        w = self.writer
        ttft = f"{np.median(w.ttfts):.3f}s" if w.ttfts else "-"
        if phase == "play":
            frac = min(1.0, now / self.end) if self.end > 0 else 1.0
            bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
            head = f"replay {now:7.1f}/{self.end:.1f}s [{bar}] {100 * frac:3.0f}%"
        else:
            head = f"{phase} {now - self.end:5.1f}/{grace:g}s"
        waiting = self.runner.waiting_agents
        head += f"  waiting {waiting}" if waiting else ""
        return (f"{head}  agents {self.runner.active_agents}  in flight "
                f"{self.backend.in_flight}  ok {w.ok}  err {w.errors}  ttft p50 {ttft}")

    def show(self, now: float, phase: str, grace: float = 0.0, force: bool = False) -> None:
        if not force and now - self.last < self.every:
            return
        self.last = now
        text = self.line(now, phase, grace)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class ReplayResult(msgspec.Struct):
    summary: Summary
    interrupted: bool
    cut: int
    records: int


async def probe(session: aiohttp.ClientSession, plan: Plan) -> str:
    """Check that the target answers and find the model; :class:`EvinfraError` if not."""
    url = plan.target + "/v1/models"
    headers = {"Authorization": f"Bearer {plan.api_key}"} if plan.api_key else {}
    last = ""
    for attempt in range(PROBE_TRIES):
        if attempt:
            await asyncio.sleep(0.5 * attempt)
        try:
            async with session.get(url, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)) as resp:
                body = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            continue
        if status in (401, 403):
            raise EvinfraError(f"{plan.target} rejected the credentials (HTTP {status}); "
                               "check --api-key")
        models: list[str] = []
        if status == 200:
            try:
                data = msgspec.json.decode(body)
                models = [m["id"] for m in data.get("data", []) if isinstance(m, dict)]
            except (msgspec.DecodeError, AttributeError, KeyError, TypeError):
                models = []
        if plan.model is not None:
            if models and plan.model not in models:
                raise ConfigError(f"--model {plan.model!r} is not served by {plan.target}; "
                                  f"it serves {models}")
            return plan.model
        if not models:
            raise EvinfraError(f"{url} answered HTTP {status} with no model list; give --model")
        return models[0]
    raise EvinfraError(f"cannot reach {plan.target}: {last}")


async def replay(plan: Plan, *, stop: asyncio.Event | None = None,
                 stderr: IO[str] | None = None, stdout: IO[str] | None = None) -> ReplayResult:
    """Run ``plan`` (probe, play, drain, write); ``stop`` ends it early as Ctrl-C does."""
    stop = stop or asyncio.Event()
    stderr = stderr or sys.stderr
    plan.out.mkdir(parents=True, exist_ok=True)
    connector = aiohttp.TCPConnector(limit=plan.connections, limit_per_host=plan.connections)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
            total=None, connect=min(plan.timeout, 30.0))) as session:
        model = await probe(session, plan)
        clock = RunClock()
        backend = HttpBackend(session, clock, base_url=plan.target, model=model, api=plan.api,
                              api_key=plan.api_key, timeout=plan.timeout, space=plan.space,
                              hints=plan.hints)
        writer = RecordWriter(plan.out / "requests.jsonl", backend)
        end = plan.duration / plan.speedup
        runner = Runner(backend, plan.workloads, page_size=plan.page_size, stop_at=end,
                        speedup=plan.speedup, on_record=writer.write)
        progress = Progress(stderr, runner, backend, writer, end) if plan.progress else None
        started = time.time()
        try:
            if plan.schedule is not None:
                runner.closed_loop(plan.schedule)
            else:
                runner.open_loop(plan.arrivals, plan.max_active)
            interrupted = await _play(plan, clock, runner, backend, progress, stop, end)
            if not interrupted:
                interrupted = await _drain(plan, clock, backend, progress, stop, end)
        finally:
            runner.stop_at = min(runner.stop_at, clock.now())  # no send after this
            cut = await backend.cancel()
            if progress is not None:
                progress.close()
            stopped = clock.now()
            writer.finish(runner.records)
        if backend.failure is not None:
            raise backend.failure
    # The window ends just after the last answer: every answered request counts in it.
    last = max((r.done_time for r in runner.records if r.done_time is not None), default=0.0)
    end_s = round(max(stopped, last + 1e-6), 6)  # rounding keeps it above last
    summary = summarise(runner.records, 0.0, end_s)
    (plan.out / "summary.json").write_bytes(_pretty(summary))
    meta = {"target": plan.target, "model": model, "api": plan.api,
            "started_unix": round(started, 3), "wall_s": round(stopped, 6),
            "replayed_s": round(min(stopped, end) * plan.speedup, 6),
            "interrupted": interrupted, "cut_at_end": cut, "runner": runner.stats,
            "dropped_fields": backend.dropped, "synthesized_outputs": backend.synthesized,
            "connections": plan.connections, "settings": plan.settings}
    (plan.out / "replay.json").write_bytes(_pretty(meta))
    print(_pretty(summary).decode(), file=stdout or sys.stdout, flush=True)
    return ReplayResult(summary, interrupted, cut, len(runner.records))


def _pretty(obj: object) -> bytes:
    return msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n"


_POLL = 0.05


async def _play(plan: Plan, clock: RunClock, runner: Runner, backend: HttpBackend,
                progress: Progress | None, stop: asyncio.Event, end: float) -> bool:
    """Until the end of the duration (or a finite trace is done); whether ``stop`` fired."""
    while (now := clock.now()) < end:
        if stop.is_set() or backend.failure is not None:
            return stop.is_set()
        if (plan.finite_until is not None and now >= plan.finite_until / plan.speedup
                and runner.stats.admitted and not runner.active_agents
                and not runner.waiting_agents and not backend.in_flight):
            return False
        if progress is not None:
            progress.show(now, "play")
        await _wait(stop, min(_POLL, end - now))
    if progress is not None:
        progress.show(clock.now(), "play", force=True)
    return False


async def _drain(plan: Plan, clock: RunClock, backend: HttpBackend, progress: Progress | None,
                 stop: asyncio.Event, end: float) -> bool:
    """Let requests in flight finish within the grace; whether ``stop`` fired."""
    deadline = clock.now() + plan.grace
    while backend.in_flight and (now := clock.now()) < deadline:
        if stop.is_set() or backend.failure is not None:
            return stop.is_set()
        if progress is not None:
            progress.show(now, "drain", plan.grace)
        await _wait(stop, min(_POLL, deadline - now))
    if progress is not None:
        progress.show(clock.now(), "drain", plan.grace, force=True)
    return stop.is_set()


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), max(0.0, seconds))
    except TimeoutError:
        pass


# ---- the command ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """``evinfra replay``: exit 0 when the run ended (errors of the target are data), 1 when
    the target cannot be reached, 2 on bad arguments (raised as ConfigError), 130 on Ctrl-C."""
    plan = plan_from_args(args)
    # The default loop, not uvloop: uvloop's time() has millisecond resolution and is read
    # once per loop iteration, too coarse for TTFTs of a few milliseconds.
    return asyncio.run(_main(plan))


async def _main(plan: Plan) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        result = await replay(plan, stop=stop)
    except ConfigError:
        raise
    except EvinfraError as exc:
        print(f"evinfra replay: error: {exc.message}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return 130 if result.interrupted else 0
