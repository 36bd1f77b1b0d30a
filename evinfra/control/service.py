"""The control-plane process of one partition: config -> bus, directory, router, planner,
engines; the commands ``serve`` and ``simulate`` give it.

One :class:`Service` runs in ``evinfra serve`` (wall clock, asyncio, HTTP in front) and in
``evinfra simulate`` (virtual clock, workload in front): the same object, the same handlers,
the same event order. It builds the parts and hands each command to the module that owns it:

* :mod:`~evinfra.control.lifecycle`: a request from acceptance to its end (engine events,
  timeouts, aborts), over the :mod:`~evinfra.control.ledger`;
* :mod:`~evinfra.control.branches`: inferred branches and the ends no harness reports;
* :mod:`~evinfra.control.switching`: the warm-up, the planner's windows, forced splits,
  cordons and drains;
* :mod:`~evinfra.control.status`: what ``/v1/evinfra/status`` shows.

Every command runs to completion on the bus (``Bus.running``): the engines' answers to the
orders it gives are delivered after it returns, as from a handler.

The system it runs is the ``[policy]`` of the config (``evinfra.baselines``): evinfra, or a
baseline's prefill strategy, decode binding, planner and switch, built once here; the
handlers are the same for all of them.
"""

from __future__ import annotations

import itertools
from typing import Callable, Mapping

import msgspec
import numpy as np
import structlog

from evinfra.baselines import build as build_policy
from evinfra.baselines import engine_overrides
from evinfra.config import Config
from evinfra.control.branches import BranchKeeper, Inference
from evinfra.control.counters import Counters
from evinfra.control.engines import Engines
from evinfra.control.ledger import Ledger
from evinfra.control.lifecycle import Lifecycle, RequestSink
from evinfra.control.status import status
from evinfra.control.switching import Switching
from evinfra.core.bus import Bus
from evinfra.core.clock import Clock, Timer
from evinfra.core.contracts import Sampling
from evinfra.core.events import IterationReport, PhaseSwitched
from evinfra.core.types import BranchId, NodeId, Phase, RequestId
from evinfra.directory import Directory
from evinfra.drivers.base import EngineDriver
from evinfra.errors import EngineError, EvinfraError, NoNodeError, RequestError, UnknownBranchError
from evinfra.planner.planner import Split
from evinfra.router.router import Router

__all__ = ["RequestSink", "Service", "Submission"]

log = structlog.get_logger(__name__)


class Submission(msgspec.Struct, frozen=True, gc=False):
    """A request as the front end hands it over: tokenized, validated."""

    tokens: object
    """uint32 numpy array."""
    sampling: Sampling
    branch: BranchId | None = None
    """None: no hint; the branch is inferred (``server.infer_branches``) or a branch of one."""
    parent: BranchId | None = None
    final: bool = False
    """The branch ends after this request (the harness said so)."""
    request: RequestId | None = None


class Service:
    """Router, directory and planner around the bus, driving the engines."""

    def __init__(self, config: Config, clock: Clock, bus: Bus,
                 drivers: Mapping[NodeId, EngineDriver]) -> None:
        self.config = config
        self.clock = clock
        self.bus = bus
        nodes = [n.name for n in config.cluster.nodes]
        if sorted(drivers) != sorted(nodes):
            raise EvinfraError(f"drivers for {sorted(drivers)} but nodes {sorted(nodes)}")
        self.nodes = nodes
        self.initial_prefill = nodes[: config.cluster.initial_prefill]
        self.directory = Directory({n: Phase.COLLOCATED for n in nodes}, config.cluster.page_size)
        parts = build_policy(config.policy, config.planner, nodes, self.initial_prefill,
                             start=clock.now(), page_size=config.cluster.page_size,
                             context_length=config.model.max_context_tokens)
        self.policy = parts.spec
        self.router = Router(self.directory, config.router, prefill=parts.prefill,
                             decode=parts.decode, pool=parts.pool)
        self.planner = parts.planner
        self.engines = Engines(drivers, self.directory)
        self.counters = Counters()
        self.ledger = Ledger()
        self.branches = BranchKeeper(config.server, config.cluster.page_size, self.directory,
                                     self.ledger, self.counters)
        self.switching = Switching(nodes, self.initial_prefill, self.planner, self.router,
                                   self.engines, bus, clock, self.counters,
                                   relaunch=self.policy.switch == "relaunch", at=self._at)
        self.lifecycle = Lifecycle(config.server, self.ledger, self.router, self.directory,
                                   self.planner, self.engines, self.branches, self.switching,
                                   bus, clock, self.counters, at=self._at)
        self.accepting = True
        self._ids = itertools.count()
        self._sweep: Timer | None = None
        self.fake_cluster = None  # the fake engines, when from_config built them
        self.lifecycle.subscribe()
        bus.subscribe(IterationReport, self.planner.observe_iteration)
        bus.subscribe(PhaseSwitched, self.switching.switched)

    @classmethod
    def from_config(cls, config: Config, clock: Clock, bus: Bus | None = None,
                    stream: str = "iteration") -> "Service":
        """A service on the configured engines: real SGLang engines, or the fake cluster
        (``stream`` its output mode: ``"iteration"`` to serve, ``"batched"`` to simulate)."""
        bus = bus or Bus()
        if config.cluster.driver == "sglang":
            from evinfra.drivers.sglang import build_drivers

            urls = {n.name: n.url for n in config.cluster.nodes}
            return cls(config, clock, bus,
                       build_drivers(urls, config.cluster.page_size, clock, bus))
        from evinfra.drivers.fake import FakeCluster

        fake = msgspec.structs.replace(config.fake, streaming=stream,
                                       page_size=config.cluster.page_size,
                                       **engine_overrides(config.policy))
        cluster = FakeCluster([(n.name, Phase.COLLOCATED) for n in config.cluster.nodes], fake,
                              clock, bus, seed=config.cluster.seed)
        service = cls(config, clock, bus, {n.name: cluster.driver(n.name)
                                           for n in config.cluster.nodes})
        service.fake_cluster = cluster
        return service

    @property
    def drivers(self) -> dict[NodeId, EngineDriver]:
        return self.engines.drivers

    @property
    def chains(self):
        """The index of inferred branches (None: ``server.infer_branches`` is off)."""
        return self.branches.chains

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        for d in self.drivers.values():
            await d.start()
        with self.bus.running():
            # Engines may hold count marks from an earlier control plane: this one has none.
            for node in self.nodes:
                self.engines.resync_hints(node)
            self.switching.start()
            if self.branches.limits():
                self._schedule_sweep()
        log.info("service_started", nodes=len(self.nodes), policy=self.config.policy.name,
                 warmup_until=self.planner.warmup_end,
                 initial_split=f"{len(self.initial_prefill)}P{len(self.nodes) - len(self.initial_prefill)}D")

    async def stop(self) -> None:
        """Fail what is still in flight and stop the drivers (call after draining clients)."""
        self.accepting = False
        self.lifecycle.stopping = True
        self.switching.stop()
        if self._sweep is not None:
            self._sweep.cancel()
        with self.bus.running():
            for f in self.ledger:
                self.lifecycle.fail(f, EngineError(f.prefill or "-",
                                                   "the service is shutting down"))
        for d in self.drivers.values():
            await d.stop()

    def _at(self, when: float, fn: Callable[..., None], *args: object) -> Timer:
        """A timer of the service's own (a timeout, a sweep, a planner tick): a command, run
        to completion on the bus like any other."""
        return self.clock.call_at(when, self._command, fn, *args)

    def _command(self, fn: Callable[..., None], *args: object) -> None:
        with self.bus.running():
            fn(*args)

    # -- commands --------------------------------------------------------------------------

    def submit(self, sub: Submission, sink: RequestSink) -> RequestId:
        """Route a request; its output goes to ``sink``. Raises :class:`NoNodeError` (no node
        can take it now) or :class:`RequestError` before anything is accepted."""
        if not self.accepting:
            raise NoNodeError("prefill", "the service is shutting down")
        rid = sub.request or f"req-{next(self._ids)}"
        if rid in self.ledger:
            raise RequestError(f"request id {rid!r} is already in flight", status=409)
        tokens = np.asarray(sub.tokens, dtype=np.uint32)
        if tokens.size == 0:
            raise RequestError("the prompt is empty", param="prompt")
        with self.bus.running():
            if sub.branch is not None:
                guess = Inference(sub.branch, sub.parent, sub.final)
            else:
                guess = self.branches.infer(rid, tokens, sub.parent, sub.final)
            self.lifecycle.submit(rid, tokens, sub.sampling, guess, sub.branch is not None,
                                  sink)
        return rid

    def abort(self, request: RequestId) -> None:
        """The client went away: stop the request everywhere, quietly (its sink has its
        record when this returns)."""
        f = self.ledger.get(request)
        if f is not None:
            with self.bus.running():
                self.lifecycle.abort(f)

    def end_branch(self, branch: BranchId) -> None:
        """The harness says the branch is over (``POST /v1/branches/{id}/end``)."""
        with self.bus.running():
            self.lifecycle.end_branch(branch)

    def force_split(self, prefill: list[NodeId]) -> Split:
        """An operator's split (``POST /v1/evinfra/split``); during the warm-up it ends the
        warm-up now. Raises :class:`RequestError` for a split the cluster cannot take."""
        with self.bus.running():
            return self.switching.force_split(prefill)

    def cordon(self, node: NodeId, cordoned: bool = True, force: bool = False
               ) -> list[RequestId]:
        """An operator takes ``node`` out of routing for maintenance (``POST
        /v1/evinfra/nodes/{node}/cordon``), or puts it back (``.../uncordon``). Its queued
        requests whose prefill has not started are withdrawn and routed elsewhere; what runs
        there finishes, and its KV stays readable by its peers. It keeps its phase; the
        planner's next decisions split the other nodes (as for a node that is down). Returns
        the withdrawn requests.

        Cordoning the last routable node of a phase is refused (:class:`RequestError`, 409)
        unless ``force``: every request would be a 503, its queued ones failed, until an
        uncordon or the planner's next window."""
        if cordoned and not force:
            self._check_cordon(node)
        with self.bus.running():
            return self.switching.cordon(node, cordoned)

    def _check_cordon(self, node: NodeId) -> None:
        r = self.router
        if node not in self.nodes or not r.routable(node):
            return  # unknown (404 below), or out of routing already
        left = {r.phase(n) for n in self.nodes if n != node and r.routable(n)}
        for phase in (Phase.PREFILL, Phase.DECODE):
            if r.phase(node) in (phase, Phase.COLLOCATED) and not left & {phase,
                                                                         Phase.COLLOCATED}:
                raise RequestError(
                    f"cordoning {node} would leave no routable {phase.value} node: every "
                    "request would be refused until one is uncordoned (force it to cordon "
                    "anyway)", status=409, param="node", code="last_routable_node")

    # -- branches their harness forgot ----------------------------------------------------

    def _schedule_sweep(self) -> None:
        self._sweep = self._at(self.clock.now() + self.branches.sweep_every(), self._sweep_idle)

    def _sweep_idle(self) -> None:
        if self.branches.sweep(self.clock.now()):
            self.engines.flush_hints()
        self._schedule_sweep()

    # -- reads -----------------------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self.ledger)

    def constrains_output(self) -> bool:
        """Every engine holds an output to a grammar (``Sampling.json_schema``...): a request
        may go to any of them."""
        return all(d.constrains_output for d in self.drivers.values())

    def status(self) -> dict[str, object]:
        return status(self)

    def branch_counts(self, branch: BranchId) -> dict[NodeId, int]:
        """How many blocks the branch counts on each node (for tests and debugging)."""
        if branch not in self.directory:
            raise UnknownBranchError(branch)
        return self.directory.branch_counts(branch)

    def check_invariants(self) -> None:
        """The ledger's, the router's and the directory's, and that they agree."""
        self.ledger.check_invariants()
        self.router.check_invariants()
        self.directory.check_invariants()
        assert set(self.router.requests()) == {f.id for f in self.ledger}, \
            "the router's books and the ledger disagree on what is in flight"
