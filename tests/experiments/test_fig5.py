"""Fig. 5: the planner's fit of Eq. 1-2 on the fake engine's iteration times, held-out error,
through ``evinfra experiment fig5`` and its measurement."""

from __future__ import annotations

import json

import msgspec
import pytest

from evinfra.cli import main
from evinfra.config import load_config
from evinfra.experiments.fig5 import measure


def with_fake(config, **fields):
    return msgspec.structs.replace(config, fake=msgspec.structs.replace(config.fake, **fields))


def test_without_noise_the_fit_recovers_eq1_and_only_the_context_term_is_error() -> None:
    config = load_config("etc/cluster.toml")
    m = measure(config, 1, noise=0.0)
    assert (m.count("single", True), m.count("single", False), m.count("batch", False),
            m.count("decode", True), m.count("decode", False)) == (20, 28, 12, 10, 40)
    for k in ("c0", "c1", "c2", "d0", "d1"):
        assert m.model[k] == pytest.approx(m.truth[k], rel=1e-6)
    assert m.mean_error("single") < 1e-9 and m.mean_error("batch") < 1e-9
    # The context term Eq. 2 omits is the decode error; without it there is none (control).
    assert m.mean_error("decode") > 1.0
    flat = measure(with_fake(config, d_ctx=0.0), 1, noise=0.0)
    assert flat.mean_error("decode") < 1e-9
    assert flat.model["d2"] == pytest.approx(flat.truth["d2"], rel=1e-6)
    assert m.model["d2"] > m.truth["d2"]  # the fit folds the context into the per-request cost


def test_noise_is_the_prefill_error_and_a_seed_repeats_it() -> None:
    config = load_config("etc/cluster.toml")
    m = measure(config, 1)
    assert m.noise == config.fake.noise > 0
    # |N(0, σ)| averages 0.8 σ: the held-out error is of the noise's size, not zero.
    for panel in ("single", "batch"):
        assert 0.3 * 100 * m.noise < m.mean_error(panel) < 2.5 * 100 * m.noise
    assert measure(config, 1) == m and measure(config, 2) != m
    louder = measure(with_fake(config, noise=0.1), 1)
    assert louder.mean_error("single") > 2 * m.mean_error("single")


def test_the_command_writes_the_table_beside_the_papers_numbers(tmp_path, capsys) -> None:
    assert main(["experiment", "fig5", "--quick", "--out", str(tmp_path), "--jobs", "1"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    rows = {r[0]: r[1:] for r in data["tables"][0]["rows"]}
    m = measure(load_config("etc/cluster.toml"), 1)
    single = rows["prefill, single requests (a, b)"]
    assert single[:3] == [20, 28, m.mean_error("single")] and single[4:] == [4.2, 2.6]
    assert rows["prefill, batches of 2-8 (c)"][4] == 6.3
    assert (tmp_path / "fig5.png").exists()
