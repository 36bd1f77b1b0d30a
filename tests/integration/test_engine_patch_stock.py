"""Nothing of the engine patch is active unless it is enabled.

The stock pair of ``conftest.engines`` runs with the plugin *installed* (its entry point is on
every engine's PYTHONPATH) but without ``EVINFRA_ENGINE_PATCH=1``. Such an engine registers no
hook: it advertises nothing, has none of the patch's routes, and behaves as stock SGLang, which
``test_sglang_service.py`` checks on the same engines (a role switch there still drops the
prefix cache, ``AllBlocksCleared`` and all)."""

from __future__ import annotations

import pytest

from pd_client import http

pytestmark = pytest.mark.sglang


def test_an_engine_without_the_variable_runs_stock(engines):
    for e in engines.values():
        code, info = http("GET", e.url + "/server_info")
        assert code == 200
        assert not [k for k in info if k.startswith("evinfra")]
        assert http("GET", e.url + "/evinfra/status")[0] == 404
        assert http("POST", e.url + "/evinfra/hints", {"positive": [1]})[0] == 404
        log = e.log_path.read_text(errors="replace")
        assert "evinfra engine patch: installed, disabled" in log
        assert "evinfra engine patch on" not in log
