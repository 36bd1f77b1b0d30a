"""τ, the router's fetch time (E.3 line 9), learned from the fetches the engines report: a
fetch from a peer's host memory makes the fake engine report its time in ``PrefillDone``, the
service hands it to the router, and τ moves from E.3's prior (0.45 s + 1 µs/token) to the
engine's cost (the fake engine's 2 ms + 1.05 µs/token, paper D.6)."""

from __future__ import annotations

import pytest

from evinfra.drivers.fake.config import FakeEngineConfig
from tests.control.virtual import FAST, VSim, prompt

ENGINE = FakeEngineConfig()


def test_a_reported_fetch_refits_tau():
    sim = VSim(fake={**FAST, "c1": 2e-4})
    svc = sim.service
    tau = svc.router.tau
    assert tau.fetches == 0 and tau(20_000) == pytest.approx(0.45 + 20_000e-6)  # the prior
    t = prompt(4000)
    first = sim.submit("a", t[:2000], branch="agent")
    sim.run_for(5.0)
    svc.cordon("n0")  # where "agent"'s KV was prefilled: "b" fetches it from n0's host memory
    second = sim.submit("b", t[:3000], branch="agent")
    sim.run_for(5.0)
    assert first.ok and second.ok and second.record.fetched_tokens == 31 * 64
    assert tau.fetches == 1
    x = second.record.fetched_tokens
    engine = ENGINE.fetch_latency + ENGINE.fetch_s_per_token * x
    # One fetch against the two rows of the prior: within 15 % (tests/router checks that a
    # dozen fetches pin it to 5 %); the prior was off by 0.45 s, a factor of 100.
    assert tau(x) == pytest.approx(engine, rel=0.15)
