"""The live dashboard: ``GET /`` (to ``/dashboard``), the page and its assets, and
``GET /v1/evinfra/dashboard``, the JSON the page polls. No key is needed to look.

The page (``static/dashboard.html``, ``.js``, ``.css``) draws with plotly.js, served from the
installed ``plotly`` package: nothing comes from a CDN, nothing is built.

:class:`Board` is the pure part, on time passed in: small bounded rings of what the bus says
(requests over, split changes, the planner's decisions) and of samples of the service's
status, one per ``sample_every`` at most. :class:`Dashboard` wires it to the service's bus,
samples on a timer of the service clock while the app runs (the series is there when a page
opens), and serves it.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import msgspec
import numpy as np
from aiohttp import web

from evinfra.core.clock import Timer
from evinfra.core.events import RequestDone, SplitChanged
from evinfra.partitions.identity import AGENTS_KEY
from evinfra.planner.planner import Decision

__all__ = ["OPEN_PATHS", "Board", "Dashboard"]

_STATIC = Path(__file__).parent / "static"
_ASSETS = {"dashboard.js": "application/javascript", "dashboard.css": "text/css"}
OPEN_PATHS = ("/", "/dashboard", "/dashboard/plotly.min.js", "/v1/evinfra/dashboard",
              *(f"/dashboard/{name}" for name in _ASSETS))
"""The paths anyone may read (the auth middleware lets them through)."""


class Switch(msgspec.Struct, frozen=True):
    """A split change as it started (``SplitChanged``): the operator's or the planner's."""

    time: float
    label: str
    prefill: list[str]
    decode: list[str]
    reason: str


class Verdict(msgspec.Struct, frozen=True):
    """A planner decision, kept or switched."""

    time: float
    split: str
    chosen: str | None
    reason: str


class Percentiles(msgspec.Struct, frozen=True):
    count: int
    p50: float | None
    p90: float | None
    p99: float | None


class NodeNow(msgspec.Struct, frozen=True):
    name: str
    phase: str
    draining_to: str | None
    healthy: bool
    cordoned: bool
    queued: int
    prefilling: int
    decoding: int
    l1_used: int | None
    """Tokens of GPU KV in use, as the engine last reported (None before any report)."""
    l1_capacity: int | None
    l2_used: int | None
    l2_capacity: int | None
    blocks: int
    """Blocks the directory knows the node holds (GPU and host)."""
    positive_blocks: int
    """Of those, blocks a live branch counts there (``R[b, n] > 0``, paper 4.3)."""


class Sample(msgspec.Struct, frozen=True, array_like=True):
    """One point of the series (``array_like``: a list on the wire, fields in this order)."""

    time: float
    prefill: int
    decode: int
    collocated: int
    queued: dict[str, int]
    decoding: dict[str, int]
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    requests_per_s: float
    errors_per_s: float


class View(msgspec.Struct, frozen=True):
    """``GET /v1/evinfra/dashboard``. Times are the service clock's seconds (``time`` is now)."""

    time: float
    split: str
    prefill: list[str]
    decode: list[str]
    collocated: list[str]
    switching: dict[str, str]
    warming_up: bool
    next_decision_at: float | None
    nodes: list[NodeNow]
    latency_window_s: float
    ttft: Percentiles
    e2e: Percentiles
    rate_window_s: float
    requests_per_s: float
    errors_per_s: float
    counters: dict[str, int]
    in_flight: int
    active_branches: int
    """Branches holding counts in the directory."""
    inferred_branches: int
    branches_seen: int
    """Distinct branches whose requests ended within the latency window."""
    agents: int
    """Agents this partition has served (``AgentBook``: the identity nginx hashes)."""
    split_changes: int
    """Splits started since the board began, the warm-up's exit included."""
    switches: list[Switch]
    """The last split changes."""
    decisions: list[Verdict]
    series: list[Sample]


class _Done(msgspec.Struct, frozen=True, array_like=True, gc=False):
    end: float
    ttft: float | None
    e2e: float
    ok: bool
    error: bool
    """Failed by the cluster (a client that went away is neither ok nor an error)."""
    branch: str


_Figures = tuple[Percentiles, Percentiles, float, float, int]
"""TTFT, E2E, requests and errors per second, distinct branches: over the windows."""


def _pct(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(0, None, None, None)
    p50, p90, p99 = (float(x) for x in np.percentile(values, [50, 90, 99]))
    return Percentiles(len(values), p50, p90, p99)


class Board:
    """What the dashboard shows, from the bus's events and the service's status."""

    def __init__(self, start: float, latency_window_s: float = 300.0,
                 rate_window_s: float = 60.0, sample_every: float = 1.0, samples: int = 600,
                 events: int = 50, requests: int = 100_000) -> None:
        self.start = start
        self.latency_window_s = latency_window_s
        self.rate_window_s = rate_window_s
        self.sample_every = sample_every
        self._done: deque[_Done] = deque(maxlen=requests)
        self._samples: deque[Sample] = deque(maxlen=samples)
        self._switches: deque[Switch] = deque(maxlen=events)
        self._decisions: deque[Verdict] = deque(maxlen=events)
        self.split_changes = 0

    # -- from the bus ---------------------------------------------------------------------

    def request_done(self, d: RequestDone) -> None:
        ttft = d.first_token - d.arrival if d.first_token is not None else None
        self._done.append(_Done(d.end, ttft, d.end - d.arrival, d.status == "ok",
                                d.status not in ("ok", "aborted"), d.branch))

    def split_changed(self, ev: SplitChanged) -> None:
        self.split_changes += 1
        label = f"{len(ev.prefill)}P{len(ev.decode)}D"
        self._switches.append(Switch(ev.time, label, list(ev.prefill), list(ev.decode),
                                     ev.reason))

    def decided(self, d: Decision) -> None:
        self._decisions.append(Verdict(d.at, d.split.label,
                                       d.chosen.label if d.chosen is not None else None,
                                       d.reason))

    # -- the view -------------------------------------------------------------------------

    def sample(self, now: float, status: dict) -> None:
        """A point of the series from ``status`` (``Service.status()``), when the last one is
        ``sample_every`` old."""
        if self._due(now):
            self._sample(now, status, self._figures(now), self._nodes(status))

    def _due(self, now: float) -> bool:
        return not self._samples or now - self._samples[-1].time >= self.sample_every

    def _sample(self, now: float, status: dict, figures: _Figures, nodes: list[NodeNow]) -> None:
        split, (ttft, e2e, rps, eps, _) = status["split"], figures
        self._samples.append(Sample(
            now, len(split["prefill"]), len(split["decode"]), len(split["collocated"]),
            {n.name: n.queued for n in nodes}, {n.name: n.decoding for n in nodes},
            ttft.p50, ttft.p99, e2e.p50, e2e.p99, rps, eps))

    def _figures(self, now: float) -> _Figures:
        while self._done and self._done[0].end < now - self.latency_window_s:
            self._done.popleft()
        recent = [d for d in self._done if d.end <= now]
        ok = [d for d in recent if d.ok]
        in_rate = [d for d in recent if d.end >= now - self.rate_window_s]
        # Over the time the board has been up when that is shorter than the window.
        span = max(min(self.rate_window_s, now - self.start), 1e-9)
        return (_pct([d.ttft for d in ok if d.ttft is not None]), _pct([d.e2e for d in ok]),
                len(in_rate) / span, sum(d.error for d in in_rate) / span,
                len({d.branch for d in recent}))

    @staticmethod
    def _nodes(status: dict) -> list[NodeNow]:
        summary = status["directory"]["nodes"]
        nodes = []
        for name, v in status["nodes"].items():
            held = summary.get(name, {})
            nodes.append(NodeNow(
                name, v["phase"], v["draining_to"], v["healthy"], v["cordoned"], v["queued"],
                v["prefilling"], v["decoding"], v.get("l1_used"), v.get("l1_capacity"),
                v.get("l2_used"), v.get("l2_capacity"), held.get("blocks", 0),
                held.get("positive_count_blocks", 0)))
        return nodes

    def view(self, now: float, status: dict, agents: int) -> View:
        """The page's data at ``now``, from ``status`` (``Service.status()``) and the count of
        ``agents`` served; samples too, when due."""
        figures, nodes = self._figures(now), self._nodes(status)
        if self._due(now):
            self._sample(now, status, figures, nodes)
        ttft, e2e, rps, eps, branches = figures
        split = status["split"]
        return View(
            time=now, split=split["label"], prefill=split["prefill"], decode=split["decode"],
            collocated=split["collocated"], switching=split["switching"],
            warming_up=status["warming_up"], next_decision_at=status["next_decision_at"],
            nodes=nodes, latency_window_s=self.latency_window_s, ttft=ttft, e2e=e2e,
            rate_window_s=self.rate_window_s, requests_per_s=rps, errors_per_s=eps,
            counters=status["counters"], in_flight=status["in_flight"],
            active_branches=status["directory"]["active_branches"],
            inferred_branches=status["inferred_branches"],
            branches_seen=branches, agents=agents,
            split_changes=self.split_changes, switches=list(self._switches), decisions=list(self._decisions),
            series=list(self._samples))


def _plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class Dashboard:
    """The board on a service's bus, and its routes."""

    def __init__(self, service, board: Board | None = None) -> None:
        self.service = service
        self.board = board or Board(service.clock.now())
        self._timer: Timer | None = None
        bus = service.bus
        bus.subscribe(RequestDone, self.board.request_done)
        bus.subscribe(SplitChanged, self.board.split_changed)
        bus.subscribe(Decision, self.board.decided)

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/", self.root)
        app.router.add_get("/dashboard", self.page)
        app.router.add_get("/dashboard/plotly.min.js", self.plotly)
        app.router.add_get("/dashboard/{asset:dashboard\\.(?:js|css)}", self.asset)
        app.router.add_get("/v1/evinfra/dashboard", self.data)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        self._tick()

    async def _stop(self, app: web.Application) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _tick(self) -> None:
        """The series fills whether or not a page is open (next tick first: a failed sample
        must not end the series)."""
        clock = self.service.clock
        self._timer = clock.call_later(self.board.sample_every, self._tick)
        self.board.sample(clock.now(), self.service.status())

    async def root(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/dashboard")

    async def page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(_STATIC / "dashboard.html",
                                headers={"Content-Type": "text/html; charset=utf-8"})

    async def asset(self, request: web.Request) -> web.FileResponse:
        name = request.match_info["asset"]
        return web.FileResponse(_STATIC / name, headers={"Content-Type": _ASSETS[name]})

    async def plotly(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(_plotly_js(),
                                headers={"Content-Type": "application/javascript",
                                         "Cache-Control": "max-age=86400"})

    async def data(self, request: web.Request) -> web.Response:
        agents = request.app[AGENTS_KEY].status()["count"]
        view = self.board.view(self.service.clock.now(), self.service.status(), agents)
        return web.Response(body=msgspec.json.encode(view), content_type="application/json")
