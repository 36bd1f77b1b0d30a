"""Iteration times follow the ground truth: Eq. 1 for prefill, Eq. 2 plus B.4's context term
for decode, with seeded multiplicative noise."""

import numpy as np
import pytest
from fake_harness import TEST_TIMING, Harness, tokens

from evinfra.core.events import IterationReport, PrefillItem
from evinfra.core.types import Phase, qk_pairs
from evinfra.drivers.fake import FakeEngineConfig
from evinfra.drivers.fake.timing import GroundTruth, phi

CFG = FakeEngineConfig(**TEST_TIMING)


def eq1(items: list[PrefillItem]) -> float:
    return (CFG.c0 + CFG.c1 * sum(i.t_uc for i in items)
            + CFG.c2 * sum(qk_pairs(i.t_uc, i.t_c) for i in items)
            + CFG.c3 * sum(i.t_rst for i in items))


def eq2(B: int, context: int) -> float:  # noqa: N803
    return CFG.d0 + CFG.d1 * phi(B, 8 / 256, 2) + CFG.d2 * B + 1e-9 * context


def test_decode_defaults_span_the_papers_17_to_45_ms() -> None:
    assert eq2(8, 0) == pytest.approx(0.0165, abs=5e-4)
    assert eq2(64, 0) == pytest.approx(0.0448, abs=5e-4)
    # 8K new tokens after a 128K cached prefix take about 0.3 s (Fig. 5a)
    assert eq1([PrefillItem("r", 8192, 131072)]) == pytest.approx(0.295, abs=0.005)


def test_reported_iterations_match_the_formulas() -> None:
    h = Harness()
    for i, n in enumerate((5000, 7000, 3000)):
        h.submit(f"r{i}", tokens(n, seed=i), max_tokens=40)
    h.run(10)
    prefill = [r for r in h.of(IterationReport) if r.prefill]
    assert [[(i.t_uc, i.t_c) for i in r.prefill] for r in prefill] == [
        [(5000, 0)], [(7000, 0), (1192, 0)], [(1808, 1192)]]
    for r in prefill:
        assert r.duration == pytest.approx(eq1(r.prefill), rel=1e-12)
    # consecutive iterations tile the timeline: no gap while work is ready
    for a, b in zip(prefill, prefill[1:]):
        assert b.start == pytest.approx(a.start + a.duration)


def test_decode_iterations_match_eq2_plus_the_context_term() -> None:
    h = Harness()
    h.submit("r", tokens(100_000), max_tokens=30)
    h.run(20)
    decode = [r for r in h.of(IterationReport) if r.batch]
    assert decode and all(r.batch == 1 and r.t_fwd == 2 for r in decode)
    for r in decode:
        assert r.duration == pytest.approx(eq2(1, 100_000), rel=1e-12)
    assert sum(r.accepted for r in decode) == 29  # the first token came with the join


def test_noise_is_multiplicative_seeded_and_bounded() -> None:
    items = [PrefillItem("r", 4096, 10_000, 500)]
    noisy = FakeEngineConfig(**TEST_TIMING, noise=0.05)
    a = [GroundTruth(noisy, np.random.default_rng(1)).prefill(items) for _ in range(2)]
    assert a[0] == a[1]
    g = GroundTruth(noisy, np.random.default_rng(2))
    xs = np.array([g.decode(16, 0) for _ in range(2000)]) / g.decode_base(16, 0)
    assert xs.std() == pytest.approx(0.05, rel=0.15) and xs.min() >= 0.5
    assert abs(xs.mean() - 1) < 0.01


def test_collocated_node_reports_separate_prefill_and_decode_iterations() -> None:
    h = Harness(nodes=[("c0", Phase.COLLOCATED)])
    h.submit("a", tokens(3000), prefill="c0", decode="c0", max_tokens=50)
    h.run(0.3)
    h.submit("b", tokens(2000, seed=1), prefill="c0", decode="c0", max_tokens=5)
    h.run(5)
    for r in h.of(IterationReport):
        assert bool(r.prefill) != bool(r.batch)  # fitting data, never mixed (planner README)
    assert h.output("a")[1] == h.output("b")[1] == "length"
