"""Prometheus metrics of one service, on a registry of its own.

Per-request figures are updated from the bus's ``RequestDone`` events (one pass per request,
off the routing path); the cluster's state (split, queues, directory, planner) is read from
the service when ``/metrics`` is scraped, so nothing keeps gauges in sync by hand. HTTP
answers are counted by the access log (``access.py``), by route pattern and status class;
the process's own figures (RSS, CPU, open fds, GC) are prometheus_client's collectors.

Label values are few and stable: route patterns, status classes (``2xx``...), and request
statuses named here (:data:`OUTCOMES`), never a Python class name.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from evinfra.core.events import RequestDone, SplitChanged
from evinfra.core.types import Phase
from evinfra.control import Service

__all__ = ["OUTCOMES", "Metrics", "outcome"]

OUTCOMES = {"ok": "ok", "aborted": "aborted", "RequestError": "bad_request",
            "UnknownBranchError": "bad_request", "NoNodeError": "no_node",
            "EngineError": "engine_error"}
"""A request's end (``RequestDone.status``: ``ok``, ``aborted`` or an error's class) as the
``status`` label of ``evinfra_requests_total`` writes it; any other error is ``error``."""


def outcome(status: str) -> str:
    return OUTCOMES.get(status, "error")

_LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
_PER_TOKEN = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)


class Metrics:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("evinfra_requests", "Requests over, by status (ok, aborted, "
                                "bad_request, no_node, engine_error, error)", ["status"],
                                registry=r)
        self.answers = Counter("evinfra_http_responses", "HTTP answers by route pattern and "
                               "status class (499: the client went away first)",
                               ["route", "code"], registry=r)
        self.ttft = Histogram("evinfra_ttft_seconds", "Time to first token", buckets=_LATENCY,
                              registry=r)
        self.e2e = Histogram("evinfra_e2e_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY, registry=r)
        self.tpot = Histogram("evinfra_tpot_seconds",
                              "Time per output token after the first, per request",
                              buckets=_PER_TOKEN, registry=r)
        self.queued = Histogram("evinfra_prefill_queue_seconds",
                                "Arrival to prefill start, by prefill node (paper C.3)",
                                ["node"], buckets=_LATENCY, registry=r)
        self.prompt = Counter("evinfra_prompt_tokens", "Input tokens of finished requests", registry=r)
        self.cached = Counter("evinfra_cached_tokens", "Input tokens whose KV was reused", registry=r)
        self.fetched = Counter("evinfra_fetched_tokens", "Reused tokens fetched from peers", registry=r)
        self.output = Counter("evinfra_output_tokens", "Output tokens", registry=r)
        self.splits = Counter("evinfra_split_changes", "Split changes started", registry=r)
        r.register(_ClusterCollector(service))
        ProcessCollector(registry=r)  # RSS, CPU seconds, open fds...
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        service.bus.subscribe(RequestDone, self._on_done)
        service.bus.subscribe(SplitChanged, lambda _: self.splits.inc())

    def answered(self, route: str, status: int) -> None:
        """One HTTP answer (the access log's count)."""
        self.answers.labels(route, f"{status // 100}xx" if status != 499 else "499").inc()

    def _on_done(self, d: RequestDone) -> None:
        self.requests.labels(outcome(d.status)).inc()
        if d.status != "ok":
            return
        if d.first_token is not None:
            self.ttft.observe(d.first_token - d.arrival)
            if d.output_tokens > 1:
                self.tpot.observe((d.end - d.first_token) / (d.output_tokens - 1))
        if d.prefill_start is not None and d.prefill_node is not None:
            self.queued.labels(d.prefill_node).observe(d.prefill_start - d.arrival)
        self.e2e.observe(d.end - d.arrival)
        self.prompt.inc(d.prompt_tokens)
        self.cached.inc(d.cached_tokens)
        self.fetched.inc(d.fetched_tokens)
        self.output.inc(d.output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ClusterCollector:
    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self):
        s = self.service
        router = s.router
        phase = GaugeMetricFamily("evinfra_node_phase", "1 for the phase each node serves",
                                  labels=["node", "phase"])
        queued = GaugeMetricFamily("evinfra_node_queued", "Prefill requests queued per node",
                                   labels=["node"])
        decoding = GaugeMetricFamily("evinfra_node_decoding", "Requests bound to decode per node",
                                     labels=["node"])
        routable = GaugeMetricFamily("evinfra_node_routable", "1 if new work may go to the node "
                                     "(healthy, not cordoned, not switching)", labels=["node"])
        kv_used = GaugeMetricFamily("evinfra_node_kv_used_tokens", "KV tokens in use per node "
                                    "and tier (l1: GPU, l2: host), as last reported",
                                    labels=["node", "tier"])
        kv_capacity = GaugeMetricFamily("evinfra_node_kv_capacity_tokens",
                                        "KV capacity per node and tier", labels=["node", "tier"])
        branches = GaugeMetricFamily("evinfra_node_branches", "Agent branches with KV counts "
                                     "on the node", labels=["node"])
        directory = s.directory.summary()
        per_node = directory["nodes"]
        for n in s.nodes:
            view = router.node_view(n)
            phase.add_metric([n, str(view["phase"])], 1)
            queued.add_metric([n], float(view["queued"]))
            decoding.add_metric([n], float(view["decoding"]))
            routable.add_metric([n], float(router.routable(n)))
            branches.add_metric([n], per_node[n]["branches"])
            state = router.state(n)
            if state is not None:
                for tier, used, cap in (("l1", state.l1_used, state.l1_capacity),
                                        ("l2", state.l2_used, state.l2_capacity)):
                    kv_used.add_metric([n, tier], used)
                    kv_capacity.add_metric([n, tier], cap)
        yield phase
        yield queued
        yield decoding
        yield routable
        yield kv_used
        yield kv_capacity
        yield branches
        p, d = router.split()
        g = GaugeMetricFamily("evinfra_split_nodes", "Nodes per phase", labels=["phase"])
        g.add_metric(["prefill"], len(p))
        g.add_metric(["decode"], len(d))
        g.add_metric(["collocated"], sum(router.phase(n) is Phase.COLLOCATED for n in s.nodes))
        yield g
        yield GaugeMetricFamily("evinfra_in_flight", "Requests in flight", value=s.in_flight())
        yield GaugeMetricFamily("evinfra_directory_blocks", "Blocks in the KV directory",
                                value=directory["blocks"])
        yield GaugeMetricFamily("evinfra_directory_entries", "(block, node) entries",
                                value=directory["entries"])
        yield GaugeMetricFamily("evinfra_active_branches", "Agent branches with counts",
                                value=directory["active_branches"])
        yield GaugeMetricFamily("evinfra_inferred_branches",
                                "Active branches inferred from requests without hints",
                                value=s.branches.inferred())
        c = CounterMetricFamily("evinfra_inferred_branch_events",
                                "Branch inference for requests without hints: branches "
                                "started, requests chained, branches ended by a join, "
                                "compactions", labels=["event"])
        for event in ("branches_inferred", "requests_chained", "branches_joined",
                      "compactions_inferred"):
            c.add_metric([event], getattr(s.counters, event))
        yield c
        c = CounterMetricFamily("evinfra_kv_event_problems", "Tolerated bad KV events",
                                labels=["problem"])
        for f in ("unknown_parent", "unknown_removal", "duplicate_hash", "unknown_node",
                  "untracked_medium", "block_size_mismatch"):
            c.add_metric([f], directory["events"][f])
        yield c
        c = CounterMetricFamily("evinfra_driver_events", "What each node's driver did with its "
                                "engine (SGLang: count hints sent, retried, refused; fetch "
                                "plans; KV stream resyncs...)", labels=["node", "event"])
        for n, d in s.drivers.items():
            for event, value in d.stats.items():
                c.add_metric([n, event], value)
        yield c
        yield CounterMetricFamily("evinfra_bus_errors", "Bus subscribers that raised",
                                  value=s.bus.errors)
