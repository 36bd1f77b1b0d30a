"""Equations 1-4 and their online fit (paper 5.1, Figure 5, Figure 8c)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from planner_fakes import TRUTH, Synth

from evinfra.core.events import IterationReport, PrefillItem
from evinfra.core.types import qk_pairs
from evinfra.planner import FitReport, NodeFitter, NodeModel, PrefillMix, phi, pool


def fitter() -> NodeFitter:
    return NodeFitter("n0", TRUTH.k_over_e, TRUTH.t_fwd)


def mean_error(model: NodeModel, reports: list[IterationReport]) -> float:
    errors = []
    for r in reports:
        if r.prefill:
            t_uc, t_c, t_rst = np.array([(i.t_uc, i.t_c, i.t_rst) for i in r.prefill]).T
            predicted = model.t_p_iter(t_uc, t_c, t_rst)
        else:
            predicted = model.t_d_iter(r.batch)
        errors.append(abs(predicted - r.duration) / r.duration)
    return float(np.mean(errors))


# -- the equations ---------------------------------------------------------------------------


def test_decode_model_spans_the_papers_range():
    """Figure 5(d) / App. B.4: 17-45 ms for 8-64 running requests."""
    assert 0.016 < TRUTH.t_d_iter(8) < 0.018
    assert 0.044 < TRUTH.t_d_iter(64) < 0.046
    assert phi(0, 8 / 256, 2) == 0
    assert phi(10_000, 8 / 256, 2) == pytest.approx(1)
    assert phi(8, 8 / 256, 2) == pytest.approx(1 - (1 - 8 / 256) ** 16)


def test_request_time_of_a_lone_full_iteration_is_the_iteration_time():
    """Eq. 3 divides the fixed cost by t_uc/t̄: a request that alone fills an iteration of
    t̄ tokens, restoring f of its prefix, occupies the node for exactly Eq. 1."""
    model = msgspec.structs.replace(TRUTH, t_bar=8192.0, f=0.25)
    assert model.t_p_req(8192, 40_000) == pytest.approx(model.t_p_iter(8192, 40_000, 10_000))


def test_methods_broadcast_like_their_scalar_calls():
    t_uc = np.array([100.0, 8192.0, 30_000.0])
    t_c = np.array([0.0, 131_072.0, 5_000.0])
    B = np.array([1, 16, 64])  # noqa: N806
    vector = TRUTH.t_p_req(t_uc, t_c), TRUTH.mu_d(300.0, 1.8, B), TRUTH.t_d_req(300.0, 1.8, B)
    scalar = ([TRUTH.t_p_req(u, c) for u, c in zip(t_uc, t_c)],
              [TRUTH.mu_d(300.0, 1.8, b) for b in B], [TRUTH.t_d_req(300.0, 1.8, b) for b in B])
    for v, s in zip(vector, scalar):
        np.testing.assert_allclose(v, s)
    np.testing.assert_allclose(TRUTH.mu_p(t_uc, t_c), 1 / TRUTH.t_p_req(t_uc, t_c))
    # A batch axis: two iterations of two chunks each.
    batches = TRUTH.t_p_iter([[100, 200], [300, 400]], [[0, 10], [20, 30]])
    assert batches[1] == pytest.approx(TRUTH.t_p_iter([300, 400], [20, 30]))
    assert TRUTH.mu_d(300.0, 1.8, 0) == 0


def test_occupancy_at_the_mean_of_the_terms_is_the_mean_occupancy():
    """Why the planner's w̄ is the mean of (t_uc, A, t_c, t_out): Eq. 3 and 4 are linear in
    them."""
    rng = np.random.default_rng(3)
    t_uc, t_c = rng.uniform(100, 30_000, 50), rng.uniform(0, 2e5, 50)
    t_out = rng.uniform(50, 5e3, 50)
    model = msgspec.structs.replace(TRUTH, f=0.3)
    exact = model.t_p_req(t_uc, t_c).mean()
    A = qk_pairs(t_uc, t_c).mean()  # noqa: N806
    assert model.t_p_req(t_uc.mean(), t_c.mean(), A=A) == pytest.approx(exact)
    assert model.t_p_req(t_uc.mean(), t_c.mean()) < exact  # A of the mean request undercounts
    mean = model.t_d_req(t_out, 1.8, 20).mean()
    assert model.t_d_req(t_out.mean(), 1.8, 20) == pytest.approx(mean)


# -- Figure 5's protocol ---------------------------------------------------------------------


def figure5_prefill(seed: int) -> tuple[list, list, list]:
    """48 single-request settings (24 at a 128K cached prefix, 24 at 8K uncached tokens), the
    20 evenly spaced ones to fit on, the 28 others, and 12 batches of 2-8 requests."""
    synth = Synth(seed)
    singles = ([(int(u), 131_072, 0) for u in np.geomspace(256, 32_768, 24)]
               + [(8192, int(c), 0) for c in np.geomspace(1024, 262_144, 24)])
    fit_on = set(np.round(np.linspace(0, 47, 20)).astype(int))
    rng = synth.rng
    prefixes = [0, 16_384, 65_536, 131_072, 262_144]
    batches = [[(int(rng.integers(256, 8192)), int(rng.choice(prefixes)), 0) for _ in range(n)]
               for n in [2, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8, 8]]
    fit = [synth.prefill("n0", [s]) for k, s in enumerate(singles) if k in fit_on]
    held = [synth.prefill("n0", [s]) for k, s in enumerate(singles) if k not in fit_on]
    return fit, held, [synth.prefill("n0", b) for b in batches]


@pytest.mark.parametrize("seed", range(5))
def test_prefill_fit_on_20_single_requests_predicts_the_rest(seed):
    fit, held, batches = figure5_prefill(seed)
    f = fitter()
    for r in fit:
        f.add(r)
    report = f.fit()
    assert report.prefill_records == 20 and (len(held), len(batches)) == (28, 12)
    assert report.model.prefill_ok
    # Controlled settings restore nothing from host memory: c3 is unknown, and said so.
    assert report.model.unidentified == ("c3", "d0", "d1", "d2")
    single, batch = mean_error(report.model, held), mean_error(report.model, batches)
    print(f"seed {seed}: prefill mean error {single:.1%} single, {batch:.1%} batches")
    assert single < 0.07 and batch < 0.07


@pytest.mark.parametrize("seed", range(5))
def test_decode_fit_on_the_16k_points_predicts_the_rest(seed):
    """Figure 5(d): fit on the ten 16K-context points; other contexts change the time by a few
    percent, a term Eq. 2 omits."""
    synth = Synth(seed)
    batch_sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]
    f = fitter()
    for B in batch_sizes:  # noqa: N806
        f.add(synth.decode("n0", B, context=16_384))
    report = f.fit()
    assert report.model.decode_ok
    held = [synth.decode("n0", B, context=ctx) for ctx in (4096, 8192, 32_768) for B in batch_sizes]
    error = mean_error(report.model, held)
    print(f"seed {seed}: decode mean error {error:.1%} on {len(held)} held-out points")
    assert error < 0.07


def test_a_minute_of_warmup_traffic_suffices():
    """Figure 8c: the error on fresh traffic is under 7 % after 60 s of a busy node."""
    synth = Synth(11)
    f = fitter()
    for r in synth.busy_node("n0", 60.0):
        f.add(r)
    report = f.fit()
    assert report.usable and not report.problems
    fresh = synth.busy_node("n0", 60.0, start=1000.0)
    prefill = mean_error(report.model, [r for r in fresh if r.prefill])
    decode = mean_error(report.model, [r for r in fresh if not r.prefill])
    print(f"after 60 s ({report.prefill_records} prefill, {report.decode_records} decode records):"
          f" {prefill:.1%} prefill, {decode:.1%} decode")
    assert prefill < 0.07 and decode < 0.07
    # The fitted coefficients are TRUTH's, to the accuracy a minute of 4 % noise allows.
    for name in ("c1", "c2", "c3", "d0", "d1", "d2"):
        assert getattr(report.model, name) == pytest.approx(getattr(TRUTH, name), rel=0.35), name


def test_fit_is_exact_without_noise_and_the_columns_span_ten_orders_of_magnitude():
    synth = Synth(1, noise=0.0)
    f = fitter()
    for r in synth.busy_node("n0", 60.0):
        f.add(r)
    report = f.fit()
    for name in ("c0", "c1", "c2", "c3", "d0", "d1", "d2"):
        assert getattr(report.model, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    # The residual comes from the normal equations (Σ of n terms ~1): sqrt(n·eps) ~ 1e-8.
    assert report.prefill_error < 1e-6 and report.decode_error < 1e-6


def test_coefficients_are_non_negative():
    """A node with no fixed decode cost: unconstrained least squares would go below 0 on noise."""
    synth = Synth(2, noise=0.05)
    truth = msgspec.structs.replace(TRUTH, d0=0.0, c3=0.0)
    f = fitter()
    for r in synth.busy_node("n0", 60.0, truth):
        f.add(r)
    model = f.fit().model
    assert all(getattr(model, k) >= 0 for k in ("c0", "c1", "c2", "c3", "d0", "d1", "d2"))


# -- bad input -------------------------------------------------------------------------------


def test_equal_uncached_tokens_tie_c0_and_c1_and_a_reduced_fit_folds_c0_into_c1(synth):
    f = fitter()
    fitted = [synth.prefill("n0", [(4096, int(c), int(c * synth.rng.uniform()))])
              for c in np.geomspace(1024, 262_144, 30)]
    for r in fitted:
        f.add(r)
    for B in range(1, 65, 3):  # noqa: N806
        f.add(synth.decode("n0", B))
    report = f.fit()
    assert report.model.unidentified == ()
    assert report.model.reduced == ("c0",) and report.model.c0 == 0.0 and report.model.c1 > 0
    assert report.model.prefill_ok and report.model.decode_ok and report.usable
    assert any("c0, c1 unidentifiable" in p and "1, Σt_uc" in p for p in report.problems)
    assert any("c0 fixed at 0" in p for p in report.problems)
    # Exact for iterations like the recorded ones; 4096 tokens cost c0 + 4096·c1 of the truth.
    fresh = [synth.prefill("n0", [(4096, int(c), int(c * synth.rng.uniform()))])
             for c in np.geomspace(2048, 131_072, 12)]
    assert mean_error(report.model, fresh) < 0.07
    assert report.model.c1 * 4096 == pytest.approx(TRUTH.c0 + TRUTH.c1 * 4096, rel=0.1)


def test_restores_proportional_to_the_prefix_tie_c2_and_c3(synth):
    """ΣA and Σt_rst both follow t_c when t_uc is fixed and every request restores 1/3: the
    reduced fit drops c0 (tied to c1), then c3 (tied to c2)."""
    f = fitter()
    for c in np.geomspace(1024, 262_144, 30):
        f.add(synth.prefill("n0", [(4096, int(c), int(c) // 3)]))
    model = f.fit().model
    assert model.reduced == ("c0", "c3") and model.unidentified == ("d0", "d1", "d2")
    assert model.prefill_ok and not model.decode_ok


def test_one_batch_size_leaves_a_constant_decode_time(synth):
    f = fitter()
    for _ in range(20):
        f.add(synth.decode("n0", 32))
    report = f.fit()
    assert report.model.reduced == ("d1", "d2") and report.model.decode_ok
    assert report.model.t_d_iter(32) == pytest.approx(float(TRUTH.t_d_iter(32)), rel=0.05)
    assert report.model.t_d_iter(1) == report.model.t_d_iter(64)  # nothing to tell them apart


def test_a_phase_without_records_is_pooled_from_the_peers_that_identified_it(synth):
    fits = {}
    for node, scale in (("a", 1.0), ("b", 1.2), ("c", 1.4)):
        f = NodeFitter(node, TRUTH.k_over_e, TRUTH.t_fwd)
        truth = msgspec.structs.replace(TRUTH, d0=TRUTH.d0 * scale, c1=TRUTH.c1 * scale)
        for r in synth.busy_node(node, 30.0, truth):
            if node != "c" or r.prefill:  # c never decoded
                f.add(r)
        fits[node] = f.fit()
    assert not fits["c"].model.decode_ok
    a, b, c = pool([fits[n].model for n in "abc"])
    assert (a, b) == (fits["a"].model, fits["b"].model)  # complete fits are left alone
    assert c.decode_ok and c.pooled == ("d0", "d1", "d2") and c.stand_in
    assert c.d0 == pytest.approx((a.d0 + b.d0) / 2) and c.c1 == fits["c"].model.c1
    # A phase nobody identified stays unidentified.
    lone = pool([fits["c"].model, msgspec.structs.replace(fits["c"].model, node="d")])
    assert not any(m.decode_ok for m in lone)


def test_no_decode_records_leave_the_decode_model_unusable(synth):
    f = fitter()
    for r in synth.busy_node("n0", 30.0):
        if r.prefill:
            f.add(r)
    report = f.fit()
    assert report.decode_records == 0 and report.model.prefill_ok and not report.model.decode_ok
    assert report.problems == ["d0, d1, d2 unidentifiable: no decode iterations recorded"]
    assert np.isnan(report.decode_error)


def test_too_few_records(synth):
    f = fitter()
    for u in (1000, 2000, 4000):
        f.add(synth.prefill("n0", [(u, 5000 + u, 0)]))
    report = f.fit()
    assert set(report.model.unidentified) >= {"c0", "c1", "c2", "c3"}
    assert "only 3 prefill iterations recorded, 8 needed" in report.problems[0]


def test_mixed_and_broken_records_are_skipped(synth):
    f = fitter()
    f.add(IterationReport(node="n0", start=0, duration=0.1, prefill=[PrefillItem("a", 10, 0)],
                          batch=4, accepted=4))
    f.add(IterationReport(node="n0", start=0, duration=0.0, batch=4, accepted=4))
    report = f.fit()
    assert report.skipped_records == 2 and report.prefill_records == report.decode_records == 0
    assert "2 records skipped" in report.problems[-1]


def test_other_t_fwd_in_the_records_is_reported(synth):
    f = NodeFitter("n0", TRUTH.k_over_e, t_fwd=1)
    for B in range(1, 65, 3):  # noqa: N806
        f.add(synth.decode("n0", B))
    assert any("t_fwd [2]" in p for p in f.fit().problems)


def test_fit_report_is_json(synth):
    f = fitter()
    for r in synth.busy_node("n0", 20.0):
        f.add(r)
    report = f.fit()
    assert msgspec.json.decode(msgspec.json.encode(report), type=FitReport) == report


# -- t̄_n and f_n -----------------------------------------------------------------------------


def test_prefill_mix_counts_a_chunked_requests_cached_prefix_once():
    mix = PrefillMix()
    mix.add([PrefillItem("a", 8192, 10_000, 5_000)])
    mix.add([PrefillItem("a", 2000, 18_192), PrefillItem("b", 6192, 1_000)])
    mix.add([PrefillItem("c", 100, 0)])
    assert mix.t_bar == pytest.approx((8192 + 8192 + 100) / 3)
    assert mix.f == pytest.approx(5_000 / (10_000 + 1_000))
    assert PrefillMix().t_bar is None and PrefillMix().f is None


def test_a_summarised_run_of_decode_iterations_weighs_as_its_iterations():
    """An engine that computes its next state change reports k identical iterations at once
    (``count``); the fit must see k records, not one."""
    synth = Synth(3, noise=0.02)
    reports = [r for r in synth.busy_node("n0", 30.0) if r.batch]
    one_by_one, summarised = fitter(), fitter()
    for r in reports:
        one_by_one.add(r)
    for r in reports[::3]:
        summarised.add(msgspec.structs.replace(r, count=3, accepted=3 * r.accepted))
    a, b = one_by_one.fit(), summarised.fit()
    assert b.decode_records == 3 * len(reports[::3])
    for name in ("d0", "d1", "d2"):
        assert getattr(b.model, name) == pytest.approx(getattr(a.model, name), rel=0.1), name
