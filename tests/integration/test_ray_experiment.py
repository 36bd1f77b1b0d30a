"""``evinfra experiment ... --ray``: the runs as tasks on a local Ray give the same
``results.json`` bytes as worker processes. Ray is the optional extra ``evinfra[ray]``
(``make install`` installs it); without it this skips. ``--partitions --ray``:
``tests/partitions/test_partitioned_simulate.py``."""

from __future__ import annotations

import importlib.util

import pytest

from evinfra.cli import main

# Heavy: four quick runs and a local Ray's start, three minutes on two cores (make test-heavy).
pytestmark = [pytest.mark.heavy,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="Ray is the optional extra evinfra[ray]")]


def play(tmp_path, name: str, *how: str, seed: int = 5) -> bytes:
    out = tmp_path / name
    # One quick run of Figure D.1 (evinfra on 9 nodes): the others are left out.
    assert main(["experiment", "figD1", "--quick", "--only", "9-evinfra", "--seed", str(seed),
                 "--out", str(out), *how]) == 0
    return (out / "results.json").read_bytes()


def test_an_experiment_on_ray_gives_the_bytes_of_local_processes(tmp_path):
    local = play(tmp_path, "local", "--jobs", "1")
    assert b'"9-evinfra"' in local
    assert play(tmp_path, "ray", "--ray") == local
    assert play(tmp_path, "other", "--jobs", "1", seed=6) != local  # the control
