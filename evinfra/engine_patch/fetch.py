"""A prefill engine pulls a request's prefix from peers' host memory while the request waits
(paper 4.2, D.6), then loads it into device memory, all before the request's prefill starts.

One :class:`FetchJob` per request that brings a fetch plan (``kv_hints``, see ``wire``) or
finds part of its prefix in this engine's own host tier. On the scheduler thread:

1. **arrival** (the request enters the bootstrap queue): match the prompt in the radix tree,
   cut the plan (:func:`~evinfra.engine_patch.fetch_plan.segments`), allocate host slots for
   the pages to pull (host eviction makes room in the count-aware order), pin the anchor node
   they will hang from, and hand the segments to the puller thread;
2. **pulled** (the thread reports): insert the pages into the tree as host copies (as SGLang's
   storage prefetch does), then start their load into device memory (``load_back``) right
   away, rather than layer by layer inside the prefill;
3. **loaded**: the request may be prefilled. Until then it is *parked*: held back from the
   waiting queue when the bootstrap queue releases it. A job that outlasts
   ``EVINFRA_FETCH_TIMEOUT_S`` lets its request go (it prefills what it lacks); the pages
   still land in the tree when they arrive.

The puller thread (one per engine, :mod:`~evinfra.engine_patch.pull`) does only I/O: per
segment, a lease from the peer's pool server, one Mooncake ``batch_transfer_sync_read``
straight into the allocated host slots, and a release. A segment that returns fewer pages
than asked ends the job there (later pages could not attach to the prefix).

Each job's times are wall clock (``time.time()``): ``arrival``, ``fetch_start``,
``fetch_end``, ``load_end``, ``released`` (un-parked), ``prefill_start``; they are logged as
one ``evinfra_fetch {json}`` line when the prefill starts, kept in ``recent``, and the counts
(``fetched`` tokens from peers, ``restored`` tokens loaded host->device) go back to the client
in ``meta_info.cached_tokens_details`` (``evinfra_fetched``, ``evinfra_restored``, and
``evinfra_fetch_s``: the seconds the read of a fetch took).
Decode engines never fetch: plans reaching one are ignored (paper 4.2, D.6).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from evinfra.core.hashing import PathHasher
from evinfra.engine_patch import faults, tree_ops
from evinfra.engine_patch.fetch_plan import Segment, segments
from evinfra.engine_patch.pull import Pull, Pulled, Puller
from evinfra.engine_patch.ranks import min_over_ranks
from evinfra.engine_patch.wire import HostLayout, Shard, WireError, find_fetch_plan

__all__ = ["FetchJob", "Fetcher"]

log = logging.getLogger("evinfra.engine_patch.fetch")

FETCHING, LOADING, READY = "fetching", "loading", "ready"


class FetchJob:
    __slots__ = ("rid", "req", "tokens", "digests", "state", "segments", "local_pages",
                 "end_page", "anchor", "anchor_params", "slots", "fetched_pages", "restored",
                 "load_node", "parked", "released", "times", "outcome", "peers", "timed_out",
                 "planned_pages", "jid", "pulled")

    def __init__(self, req: Any, tokens: list[int]) -> None:
        self.rid = req.rid
        self.req = req
        self.tokens = tokens
        self.digests: list[str] = []
        self.state = READY
        self.segments: list[Segment] = []
        self.local_pages = 0
        self.end_page = 0
        self.planned_pages = 0
        self.anchor = None
        self.anchor_params = None
        self.slots: torch.Tensor | None = None
        self.fetched_pages = 0
        self.restored = 0
        self.load_node = None
        self.parked = False
        self.released = False
        self.timed_out = False
        self.times: dict[str, float] = {"arrival": time.time()}
        self.outcome = ""
        self.peers: list[str] = []
        self.jid = -1
        self.pulled: Pulled | None = None  # this rank's read, used once every rank has one

    def record(self, page_size: int) -> dict:
        return {"rid": self.rid, "outcome": self.outcome, "peers": self.peers,
                "local_pages": self.local_pages, "planned_pages": self.planned_pages,
                "fetched_pages": self.fetched_pages,
                "fetched": self.fetched_pages * page_size, "restored": self.restored,
                "parked": self.parked, "timed_out": self.timed_out, "times": self.times}


class Fetcher:
    """Fetch jobs of one prefill scheduler."""

    MAX_JOBS = 4096

    def __init__(self, scheduler: Any, engine: Any, layout: HostLayout, timeout_s: float,
                 lease_ttl_s: float, shards: list[Shard] | None = None, rank: int = 0,
                 group: Any = None) -> None:
        self.scheduler = scheduler
        self.group = group  # the engine's TP ranks, which agree on every job's steps
        self.tree_cache = scheduler.tree_cache
        self.page_size = self.tree_cache.page_size
        self.host = self.tree_cache.cache_controller.mem_pool_host
        self.layout = layout
        self.timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self.hasher = PathHasher(self.page_size)
        self.jobs: OrderedDict[str, FetchJob] = OrderedDict()
        self.active: dict[str, FetchJob] = {}  # fetching or loading: what tick() looks at
        self.parked: list[Any] = []
        self._by_id: dict[int, FetchJob] = {}
        self._next_id = 0
        self.recent: deque[dict] = deque(maxlen=256)
        self.stats = {"jobs": 0, "plans": 0, "plans_cut": 0, "fetched_pages": 0,
                      "restored_tokens": 0, "timeouts": 0, "failures": 0, "parked": 0}
        shards = shards or [Shard("", layout)]
        self._puller = Puller(engine, layout, timeout_s, lease_ttl_s, self.page_size, rank,
                              len(shards), shards[0].session)

    # -- arrival ------------------------------------------------------------------------

    def on_request(self, req: Any) -> None:
        """A request entered the prefill bootstrap queue."""
        try:
            plan = find_fetch_plan(getattr(req, "kv_hints", None))
        except WireError as exc:
            log.warning("evinfra fetch plan of %s ignored: %s", req.rid, exc)
            plan = None
        if plan is not None:
            self.stats["plans"] += 1
        tokens = list(req.origin_input_ids)
        P = self.page_size
        tc = self.tree_cache
        res = tree_ops.match(tc, tokens, req)
        local = tree_ops.matched_pages(res, P)
        job = FetchJob(req, tokens)
        job.local_pages = local
        segs: list[Segment] = []
        if plan is not None:
            path = self.hasher.start(tokens)
            job.digests = [path.digest(i).hex() for i in range(len(path))]
            segs, why = segments(plan, path.hashes, local, P)
            job.planned_pages = sum(r.end - r.start for r in segs)
            if why:
                self.stats["plans_cut"] += 1
                job.outcome = f"plan cut: {why}"
        if segs:
            if not self._start_pull(job, res, segs):
                segs = []
        if not segs and res.host_hit_length <= 0 and plan is None:
            return  # nothing to do for this request: not tracked
        self._track(job)
        if not segs:
            self._start_load(job, res)

    def _start_pull(self, job: FetchJob, res: Any, segs: list[Segment]) -> bool:
        P = self.page_size
        tc = self.tree_cache
        need = (segs[-1].end - job.local_pages) * P
        avail = self.host.available_size()
        if avail < need:
            tc.evict_host(need - avail)
        slots = self.host.alloc(need)
        if slots is None:
            job.outcome = "no host memory for the fetch"
            self.stats["failures"] += 1
            return False
        job.slots = slots
        job.segments = segs
        job.end_page = segs[-1].end
        job.anchor = res.best_match_node
        if job.anchor is not None and job.anchor != tc.tree_core.root_node.id:
            job.anchor_params = tree_ops.lock_host(tc, job.anchor)
        job.state = FETCHING
        self.active[job.rid] = job
        job.peers = sorted({s.peer for s in segs})
        job.times["fetch_start"] = time.time()
        job.jid = jid = self._next_id
        self._next_id += 1
        self._by_id[jid] = job
        self._puller.submit(Pull(jid, job.tokens[: job.end_page * P], segs, job.local_pages,
                                  slots.tolist()))
        return True

    def _start_load(self, job: FetchJob, res: Any | None = None) -> None:
        tc = self.tree_cache
        if res is None:
            res = tree_ops.match(tc, job.tokens, job.req)
        if res.host_hit_length > 0 and tc.has_free_load_back_slot():
            loaded = tree_ops.start_load(tc, res.best_match_node)
            if loaded > 0:
                job.restored += loaded
                self.stats["restored_tokens"] += loaded
                job.load_node = res.best_match_node
                job.state = LOADING
                job.times["load_start"] = time.time()
                self.active[job.rid] = job
                return
        self._ready(job)

    def _ready(self, job: FetchJob) -> None:
        job.state = READY
        self.active.pop(job.rid, None)
        job.times.setdefault("ready", time.time())
        if not job.outcome:
            job.outcome = "fetched" if job.fetched_pages else (
                "restored" if job.restored else "nothing to do")

    def _track(self, job: FetchJob) -> None:
        self.stats["jobs"] += 1
        self.jobs[job.rid] = job
        self.jobs.move_to_end(job.rid)
        while len(self.jobs) > self.MAX_JOBS:
            old_rid, old = next(iter(self.jobs.items()))
            if old.state != READY or (old.parked and not old.released):
                break
            del self.jobs[old_rid]

    # -- the bootstrap queue releases requests --------------------------------------------

    def hold(self, reqs: list) -> list:
        """The requests that may enter the waiting queue now; the others are parked."""
        out = []
        for req in reqs:
            job = self.jobs.get(req.rid)
            if job is not None and job.state != READY and not job.timed_out:
                job.parked = True
                self.parked.append(req)
                self.stats["parked"] += 1
                continue
            out.append(req)
        return out

    def unpark_matching(self, rid_prefix: str | None) -> None:
        """Before an abort: parked requests it names go back to the waiting queue, where
        SGLang's abort finds them."""
        keep = []
        for req in self.parked:
            if rid_prefix is None or req.rid.startswith(rid_prefix):
                self._release(req)
            else:
                keep.append(req)
        self.parked = keep

    def _release(self, req: Any) -> None:
        job = self.jobs.get(req.rid)
        if job is not None:
            job.released = True
            job.times["released"] = time.time()
        self.scheduler.waiting_queue.append(req)

    # -- every scheduler iteration -------------------------------------------------------

    def tick(self) -> None:
        for done in self._puller.take():
            job = self._by_id.get(done.job)
            if job is not None:
                job.pulled = done
        jobs = list(self.active.values())  # the same jobs, in the same order, on every rank
        if not jobs:
            self._unpark()
            return
        now = time.time()
        mine = []
        for job in jobs:
            mine += [job.pulled is not None, job.pulled.pages if job.pulled else 0,
                     job.state == LOADING and tree_ops.load_done(self.tree_cache, job.load_node),
                     now - job.times["arrival"] <= self.timeout_s]
        # Every rank takes each step in the same iteration (``ranks``): a read used once
        # every rank's is done, with the pages all of them read.
        agreed = min_over_ranks(mine, self.group)
        for i, job in enumerate(jobs):
            pulled, pages, loaded, in_time = agreed[4 * i: 4 * i + 4]
            if job.state == FETCHING and pulled:
                del self._by_id[job.jid]
                self._pulled(job, job.pulled, pages)
            elif job.state == LOADING and loaded:
                job.times["load_end"] = now
                self._ready(job)
            if job.state != READY and not job.timed_out and not in_time:
                job.timed_out = True
                self.stats["timeouts"] += 1
                log.warning("evinfra fetch of %s not done after %.1f s (%s): prefilled "
                            "without it", job.rid, self.timeout_s, job.state)
        self._unpark()

    def _unpark(self) -> None:
        if not self.parked:
            return
        keep = []
        for req in self.parked:
            job = self.jobs.get(req.rid)
            if job is None or job.state == READY or job.timed_out:
                self._release(req)
            else:
                keep.append(req)
        self.parked = keep

    def _pulled(self, job: FetchJob, done: Pulled, pages: int) -> None:
        """The job's read is over on every rank; ``pages``: the leading pages every rank
        read (no more than this rank's ``done.pages``)."""
        P = self.page_size
        tc = self.tree_cache
        job.times["fetch_end"] = done.end
        job.times["fetch_thread_start"] = done.start
        slots = job.slots
        if pages * P < len(slots):
            self.host.free(slots[pages * P:])
        inserted = None
        if pages > 0:
            if faults.armed("fetch"):
                faults.zero_host_slots(self.layout, slots[: pages * P])
            lo, hi = job.local_pages, job.local_pages + pages
            inserted = tree_ops.insert_host_pages(
                tc, job.anchor if job.anchor is not None else tc.tree_core.root_node.id,
                job.tokens[lo * P: hi * P], slots[: pages * P], job.digests[lo:hi], job.req)
            if inserted.dropped:
                pages = 0
        if job.anchor_params is not None:
            tree_ops.unlock_host(tc, job.anchor, job.anchor_params)
            job.anchor_params = None
        job.fetched_pages = pages
        self.stats["fetched_pages"] += pages
        if done.error:
            self.stats["failures"] += 1
            job.outcome = f"fetch failed after {pages} pages: {done.error}"
        elif inserted is not None and inserted.dropped:
            job.outcome = "fetched pages dropped by the tree (anchor not on host)"
        elif pages < done.pages:
            self.stats["failures"] += 1
            job.outcome = (f"fetch cut to {pages} of {done.pages} pages: another TP rank "
                           "read fewer")
        if job.state == FETCHING:
            self._start_load(job)

    # -- reporting -----------------------------------------------------------------------

    def on_prefill_start(self, reqs: list) -> None:
        now = time.time()
        for req in reqs:
            job = self.jobs.get(req.rid)
            if job is None or "prefill_start" in job.times:
                continue
            job.times["prefill_start"] = now
            job.req = None  # only the counts are needed from now on
            rec = job.record(self.page_size)
            self.recent.append(rec)
            log.info("evinfra_fetch %s", json.dumps(rec))

    def details(self, rid: str) -> dict | None:
        job = self.jobs.get(rid)
        if job is None:
            return None
        out = {"evinfra_fetched": job.fetched_pages * self.page_size,
               "evinfra_restored": job.restored}
        if job.fetched_pages and "fetch_end" in job.times:
            # The read itself (lease, transfer, release), the fetch time the router's tau
            # models; waiting for the puller thread is the request's queueing.
            out["evinfra_fetch_s"] = job.times["fetch_end"] - job.times["fetch_thread_start"]
        return out

    def busy(self) -> bool:
        return bool(self.parked) or bool(self.active)

    def status(self) -> dict:
        return {**self.stats, "parked_now": len(self.parked), "in_flight": len(self.active),
                "recent": list(self.recent)}

    def close(self) -> None:
        self._puller.close()
