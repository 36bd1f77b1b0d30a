"""Two ranks of one engine taking a fetch's steps together (``engine_patch/fetch.py`` over
``ranks.py``), in two processes joined by a real torch.distributed gloo group, as SGLang's TP
ranks are: each runs the patch's ``Fetcher.tick`` once per "loop iteration" over one job whose
read (this rank's puller) ends at a step and with a page count of its own (``READS``). Prints
one JSON line per rank: per case, when and with how many pages the job's read was used, and
when the job gave up waiting.

    python fetch_ranks_probe.py RANK PORT agree|alone

(every case in turn: read, fail, short, timeout; then ``pool_start``).
"""

from __future__ import annotations

import json
import sys
import time
import types

import torch.distributed as dist

from evinfra.engine_patch import fetch
from evinfra.engine_patch.pull import Pulled

rank, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
# (step at which this rank's read is over, pages it read, error) per case and rank
READS = {"read": ((1, 12, ""), (3, 12, "")),
         "fail": ((1, 12, ""), (2, 0, "mooncake read from peer-1 failed (rc=-1)")),
         "short": ((1, 12, ""), (2, 8, "")),
         "timeout": ((10**9, 0, ""), (10**9, 0, ""))}
STEPS = 6

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
group = dist.new_group([0, 1], backend="gloo")


def run_case(case: str) -> list:
    done_at, pages, error = READS[case][rank]
    events: list = []
    step = 0

    class Puller:
        def take(self) -> list:
            return [Pulled(0, pages, error, 0.0, 1.0)] if step == done_at else []

    f = fetch.Fetcher.__new__(fetch.Fetcher)
    f.group = group if mode == "agree" else None
    f.tree_cache = None
    # The timeout case: rank 1's clock passes its limit (0.25 s, at step 3); rank 0's never.
    f.timeout_s = 0.25 if (case == "timeout" and rank == 1) else 60.0
    f.active, f._by_id, f.jobs, f.parked = {}, {}, {}, []
    f.stats = {"timeouts": 0}
    f._puller = Puller()
    job = fetch.FetchJob(types.SimpleNamespace(rid="r1"), list(range(64)))
    job.state, job.jid = fetch.FETCHING, 0
    f.active[job.rid] = f.jobs[job.rid] = f._by_id[0] = job

    def pulled(job, done, agreed):
        events.append(("used", step, agreed))
        job.state = fetch.READY
        f.active.pop(job.rid)

    f._pulled = pulled
    for step in range(STEPS):
        was = job.timed_out
        if f.active:
            f.tick()
        if job.timed_out and not was:
            events.append(("gave_up", step))
        time.sleep(0.1)  # an iteration
        if mode == "agree":
            dist.barrier(group)  # (SGLang's ranks are in step through its input broadcast)
    return events


def pool_start() -> list:
    """Each rank builds its pool shard; rank 1's Mooncake engine cannot start. Agreed: no
    rank serves (rank 0 would otherwise lease pages rank 1 cannot be read for)."""
    import torch

    from evinfra.engine_patch.pool import PoolServer

    buf = torch.zeros((2, 2, 64, 1, 16), dtype=torch.float16)  # planes, layers, slots, heads
    host = types.SimpleNamespace(kv_buffer=buf, head_num=1, head_dim=16, dtype=buf.dtype,
                                 layer_num=2, size=64, layout="layer_first", page_size=4)
    tree = types.SimpleNamespace(page_size=4,
                                 cache_controller=types.SimpleNamespace(mem_pool_host=host))
    engine = types.SimpleNamespace(register=lambda ptr, n: 0,
                                   get_session_id=lambda: f"127.0.0.1:{17000 + rank}")

    def open_engine():
        if rank == 1:
            raise RuntimeError("no mooncake here")
        return engine, "127.0.0.1", "127.0.0.1"

    try:
        pool = PoolServer(tree, open_engine, 0, group if mode == "agree" else None)
    except RuntimeError as exc:
        return [("refused", str(exc))]
    pool.close()
    return [("serving", len(pool.shards))]


events = {c: run_case(c) for c in READS}
events["pool_start"] = pool_start()
print("PROBE " + json.dumps({"rank": rank, "events": events}), flush=True)
dist.destroy_process_group()
