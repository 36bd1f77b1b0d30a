"""The shared pool on MLA host pools (``pool.host_layout_of``, ``layout``), at the unit level
against SGLang 0.5.23's real ``MLATokenToKVPoolHost`` (``sglang_cpu/mla_probe.py``, run with
the SGLang venv): SGLang cannot run an MLA model on these CPU machines (see
``evinfra/engine_patch/README.md``, "MLA and tensor parallelism on CPU"), so no engine
serves one here.

For each host layout the pool's byte addresses are those of SGLang's own tensor elements, and
the pages a fetch's transfer chunks copy are equal, page by page as SGLang reads them, to the
peer's; the same copy made with the chunks of a two-plane (MHA) reading of the same buffers,
or followed by the patch's test-only zeroing, is not (the can-fail controls)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import _require_sglang
from engines import REPO, SHADOW, sglang_python

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).parent / "sglang_cpu" / "mla_probe.py"


@pytest.fixture(scope="module")
def probe() -> dict:
    _require_sglang()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVINFRA_")}
    env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.pathsep.join(map(str, (SHADOW, REPO))))
    p = subprocess.run([str(sglang_python()), str(PROBE)], env=env, capture_output=True,
                       text=True, timeout=300, cwd=str(REPO))
    line = next((x for x in p.stdout.splitlines() if x.startswith("PROBE ")), None)
    assert p.returncode == 0 and line is not None, p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(line[6:])


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pages_copied_by_the_pools_chunks_equal_the_peers(probe, layout):
    r = probe[layout]
    assert r["planes"] == 1 and r["token_bytes"] == (32 + 8) * 2  # latent + rope, bf16
    assert r["addresses_match"]
    assert r["copied_pages_equal"]
    assert not r["mha_reading_equal"]  # control: an MHA reading copies other bytes
    assert not r["zeroed_equal"]  # control: zeroed copies are caught


def test_the_chunks_merge_contiguous_runs(probe):
    # 5 pages in 3 runs; 3 layers: per layer and run (layer_first), per run (page_first,
    # contiguous across layers), per layer and page (page_first_direct).
    assert [probe[x]["chunks"] for x in ("layer_first", "page_first", "page_first_direct")] \
        == [9, 3, 15]
