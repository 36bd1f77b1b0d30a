"""SGLang PD as the static-sglang baseline runs it: decode KV reserved at submit and held
while the request queues (paper D.1), prefill gated on that reservation, private host memory
(no peer reads), LRU host eviction."""

import numpy as np
from baseline_harness import Sim, config, tokens

from evinfra.core.events import BlockStored
from evinfra.router.router import Route, Routing


def decode_reserved(sim: Sim) -> dict[str, int]:
    return {n: e.cache.reserved for n, e in sim.engines.items() if n in ("n2", "n3")}


def test_static_sglang_reserves_decode_kv_at_submit_evinfra_at_prefill_end() -> None:
    sg = Sim(config("static-sglang"))
    sg.run(1.0)
    sink = sg.submit("a", tokens(3000, 1), max_tokens=100)
    assert sum(decode_reserved(sg).values()) == 3100  # input + output, before any prefill
    assert sg.service.status()["nodes"]["n0"]["prefilling"] == 0
    sg.run(30.0)
    assert sink.record is not None and sink.record.status == "ok"
    assert sum(decode_reserved(sg).values()) == 0

    ev = Sim(config("evinfra"))
    ev.run(40.0)  # past the collocated warm-up: PD at 2P2D
    ev.submit("a", tokens(3000, 1), max_tokens=100)
    assert sum(decode_reserved(ev).values()) == 0


def test_a_prefill_waits_until_its_decode_node_has_reserved() -> None:
    # One decode node with room for one request at a time: the second request's prefill may
    # start only once the first has left the decode node (SGLang's handshake, D.1).
    sim = Sim(config("static-sglang", nodes=2, prefill=1,
                     fake={"l1_tokens": 5000, "l2_tokens": 20000, "d0": 0.05}))
    sim.run(1.0)
    a = sim.submit("a", tokens(3000, 1), max_tokens=200)
    b = sim.submit("b", tokens(3000, 2), max_tokens=200)
    sim.run(200.0)
    ra, rb = a.record, b.record
    assert ra.status == rb.status == "ok"
    assert rb.prefill_start >= ra.end  # b was not prefilled while a held the decode room


def test_private_host_memory_plans_no_fetch_the_pool_does() -> None:
    for policy, fetches in (("static-sglang", False), ("evinfra-fixed", True)):
        sim = Sim(config(policy))
        sim.run(40.0)
        toks = tokens(4000, 7)
        path = sim.service.directory.branches.hasher.hash(toks).hashes
        for medium in ("GPU", "CPU_PINNED"):
            sim.service.directory.apply("n0", BlockStored(path, None, [], 64, medium=medium))
        router = sim.service.router
        for i in range(40):  # load n0 so that n1 is the better choice
            router._nodes["n0"].queue.add(f"x{i}", 8192, 0, 0)
        route = router.route(Routing("q", "q", np.concatenate([toks, tokens(500, 8)]),
                                          10), 40.0)
        assert isinstance(route, Route)
        assert bool(route.fetch) is fetches, policy
        if not fetches:
            assert route.prediction.x == 0


def test_the_engines_follow_the_policy() -> None:
    sim = Sim(config("static-sglang"))
    e = sim.engines["n0"].config
    assert (e.eviction, e.peer_fetch, e.decode_prealloc, e.switch) == ("lru", "none", True,
                                                                         "in_place")
    assert not sim.engines["n0"].cache.order.count_aware
    assert sim.service.status()["policy"]["name"] == "static-sglang"
