"""Eq. 7 by hand, and the incremental queue sums against a literal replay of chunked
prefill iterations in arrival order (what the paper's implementation does)."""

import random

import pytest

from evinfra.router.ttft import FetchTime, PrefillQueue, TTFTConfig, predict

C = (0.02, 2e-5, 1e-10, 2e-7)
CFG = TTFTConfig(chunk_tokens=100, fetch_base_s=0.45, fetch_s_per_token=1e-6, fetch_min_tokens=512,
                 kappa=1e-6)
tau = FetchTime(CFG)  # E.3's line: no fetch observed


def A(u, c):
    return u * c + u * (u + 1) // 2


def replay(queue, r, B, c):
    """Iterate: each iteration takes the next B tokens of the queue stream (requests in
    arrival order, split across iterations), costs Eq. 1 over its pieces. Returns when r's
    first piece starts and when its last piece ends."""
    c0, c1, c2, c3 = c
    items = [list(e) for e in queue] + [list(r)]  # [u, t_c, t_rst]
    t, start, i = 0.0, None, 0
    while i < len(items):
        budget, cost, pieces = B, c0, []
        while budget and i < len(items):
            u, tc, rst = items[i]
            take = min(u, budget)
            pieces.append((i, take))
            cost += c1 * take + c2 * A(take, tc) + c3 * rst
            items[i] = [u - take, tc + take, 0]
            budget -= take
            if items[i][0] == 0:
                i += 1
        if start is None and any(j == len(items) - 1 for j, _ in pieces):
            start = t
        t += cost
    return start, t


def test_tau_has_a_threshold() -> None:
    assert tau(511) == 0.0
    assert tau(512) == pytest.approx(0.45 + 512e-6)


def test_tau_is_refitted_to_the_fetches_engines_report() -> None:
    """E.3's 0.45 s + 1 µs/token is the prior only: a handful of reported fetches of the fake
    engine's cost (2 ms + 1.05 µs/token, D.6) move τ there; a control without reports keeps
    the prior."""
    fitted = FetchTime(CFG)
    rng = random.Random(3)
    for _ in range(12):
        x = int(512 * 400 ** rng.random())  # prefix lengths spread over three decades
        fitted.observe(x, (0.002 + 1.05e-6 * x) * rng.uniform(0.97, 1.03))
    assert fitted.fetches == 12
    for x in (512, 20_000, 150_000):
        assert fitted(x) == pytest.approx(0.002 + 1.05e-6 * x, rel=0.05)
        assert FetchTime(CFG)(x) == pytest.approx(0.45 + 1e-6 * x)
    assert fitted(511) == 0.0
    # A constant fetch time (bound by latency) fits on the face per_token = 0; junk is ignored.
    flat = FetchTime(CFG)
    for x in (1000, 50_000, 100_000):
        flat.observe(x, 0.01)
    flat.observe(0, 1.0)
    flat.observe(5000, 0.0)
    assert flat.fetches == 3 and flat(70_000) == pytest.approx(0.01, rel=0.05)


def test_hand_computed_small_queue_hidden_fetch() -> None:
    q = PrefillQueue()
    q.add("a", 150, 1000, 0)
    q.add("b", 30, 0, 10)
    # r: 40 uncached, 2,000 cached (1,000 fetched). Queue stream: 180 tokens -> r's first
    # token is in iteration 2 (of 100 tokens each); iteration 1 = a's first 100 tokens.
    p = predict("n", q, C, 5.0, 40, 2000, 1000, 1000, 1000, CFG, tau)
    w = 5.0 + C[0] + C[1] * 100 + C[2] * A(100, 1000)
    assert p.w_hat == pytest.approx(w)
    done = 5.0 + 3 * C[0] + C[1] * 220 + C[2] * (A(150, 1000) + A(30, 0) + A(40, 2000)) + C[3] * (10 + 1000)
    assert tau(1000) < w  # hidden
    assert p.t_hat == pytest.approx(done + 1e-6 * 1000)
    assert replay([(150, 1000, 0), (30, 0, 10)], (40, 2000, 1000), 100, C) == pytest.approx((w - 5.0, done - 5.0))


def test_exposed_fetch_adds_what_the_wait_does_not_hide() -> None:
    q = PrefillQueue()
    p = predict("n", q, C, 0.0, 40, 5000, 0, 5000, 0, CFG, tau)
    assert p.w_hat == 0.0
    done = C[0] + C[1] * 40 + C[2] * A(40, 5000)
    assert p.t_hat == pytest.approx(done + tau(5000) + 1e-6 * 5000)


def test_launched_chunks_leave_the_queue() -> None:
    q = PrefillQueue()
    q.add("a", 150, 0, 7)
    q.launched("a", 100)
    assert q.entry("a") == (50, 100, 0)
    assert (q.U, q.SA, q.SR) == (50, A(50, 100), 0)
    q.remove("a")
    assert (q.U, q.SA, q.SR, len(q)) == (0, 0, 0, 0)


@pytest.mark.parametrize("seed", range(30))
def test_matches_a_literal_replay(seed: int) -> None:
    rng = random.Random(seed)
    B = rng.choice([64, 100, 8192])
    q = PrefillQueue()
    live = {}
    for k in range(rng.randrange(0, 60)):
        rid = f"r{k}"
        e = (rng.randrange(1, 3 * B), rng.randrange(0, 10 * B), rng.randrange(0, 500))
        q.add(rid, *e)
        live[rid] = e
        if rng.random() < 0.3 and live:  # finished or withdrawn out of order
            gone = rng.choice(sorted(live))
            q.remove(gone)
            del live[gone]
    order = [live[r] for r in q.requests()]
    r = (rng.randrange(1, 3 * B), rng.randrange(0, 10 * B), rng.randrange(0, 100))
    cfg = TTFTConfig(chunk_tokens=B, kappa=0.0)
    p = predict("n", q, C, 0.0, r[0], r[1], r[2], 0, 0, cfg, FetchTime(cfg))
    start, end = replay(order, r, B, C)
    assert p.w_hat == pytest.approx(start, rel=1e-9, abs=1e-12)
    assert p.t_hat == pytest.approx(end, rel=1e-9)
