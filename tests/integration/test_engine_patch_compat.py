"""The engine patch refuses a SGLang it does not fit (``engine_patch/compat.py``), on the real
SGLang 0.5.23 of the SGLang venv: SGLang's own plugin loader runs the entry point as an engine's
server process does (``sglang_cpu/compat_probe.py``), unchanged, with its version string
changed, or with a hook target removed; and with ``EVINFRA_PATCH_ON_MISMATCH=stock`` the same
mismatch gives stock SGLang (no hook) and a loud warning. No engine is started."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import _require_sglang
from engines import PATCH, REPO, SHADOW, sglang_python

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).parent / "sglang_cpu" / "compat_probe.py"


def probe(mode: str, **env: str) -> tuple[dict, str]:
    _require_sglang()
    e = {k: v for k, v in os.environ.items() if not k.startswith("EVINFRA_")}
    e.update(SGLANG_USE_CPU_ENGINE="1", EVINFRA_ENGINE_PATCH="1",
             PYTHONPATH=os.pathsep.join(map(str, (SHADOW, PATCH, REPO))), **env)
    p = subprocess.run([str(sglang_python()), str(PROBE), mode], env=e, capture_output=True,
                       text=True, timeout=300, cwd=str(REPO))
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert line is not None, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(line[6:]), p.stderr


def test_the_supported_sglang_gets_every_hook():
    out, _ = probe("ok")
    assert out["exit"] is None
    assert out["hooks"] == ["sglang.srt.entrypoints.http_server.launch_server"]
    assert out["patched"] == out["hooks"]


def test_another_sglang_version_is_refused():
    out, err = probe("version")
    assert out["exit"] and "refusing to start" in out["exit"]
    assert "SGLang 0.6.0 (supported: 0.5.23)" in out["exit"] and out["hooks"] == []
    assert "refusing to start" in err


def test_a_missing_hook_target_is_refused_by_name():
    out, _ = probe("target")
    assert out["exit"] and out["hooks"] == []
    assert ("hook target sglang.srt.managers.scheduler.Scheduler.process_batch_result not "
            "found") in out["exit"]
    assert "(supported:" not in out["exit"]  # the version is fine: only the target is named


def test_the_operator_may_run_stock_instead_with_a_loud_warning():
    out, err = probe("target", EVINFRA_PATCH_ON_MISMATCH="stock")
    assert out["exit"] is None and out["hooks"] == []
    assert "WARNING" in err and "runs STOCK SGLang" in err and "process_batch_result" in err
