"""Tensor parallelism: the ranks of one engine flip at the same scheduler iteration, deciding
together over their own gloo group (``engine_patch/ranks.py``), in two processes of the SGLang
venv (``sglang_cpu/ranks_probe.py``; torch.distributed as SGLang's TP ranks use it).

Rank 0 has drained at iteration 2, rank 1 at iteration 5: with the joint decision both flip
at 5; each deciding alone (the control), rank 0 would flip at 2, before rank 1 can. With rank 1
never draining and a 0.25 s drain limit, both give up at the same iteration, and neither
flips (alone, rank 0 would have flipped at 2 and rank 1 given up).

Then a real SGLang engine with ``--tp-size 2`` on CPU (SGLang runs it there: gloo all-reduce,
one core per rank through ``SGLANG_CPU_OMP_THREADS_BIND``) runs the patch: it switches P->D->P
in place, both ranks flipping (each logs its ``evinfra_switch``), and is healthy after each.
Its host-tier features are off with the logged reason (one rank per engine; README).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _require_sglang
from engines import HICACHE_ARGS, REPO, Engine, free_port, sglang_python
from pd_client import http

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).parent / "sglang_cpu" / "ranks_probe.py"


def run(mode: str, case: str) -> dict[int, list]:
    _require_sglang()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVINFRA_")}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([str(sglang_python()), str(PROBE), str(r), str(port), mode, case],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=str(REPO)) for r in (0, 1)]
    out = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        line = next((x for x in stdout.splitlines() if x.startswith("PROBE ")), None)
        assert p.returncode == 0 and line, stdout[-2000:] + stderr[-3000:]
        got = json.loads(line[6:])
        out[got["rank"]] = [tuple(e) for e in got["events"]]
    return out


def test_both_ranks_flip_when_the_last_one_has_drained():
    assert run("agree", "drain") == {0: [("flip", 5)], 1: [("flip", 5)]}
    assert run("alone", "drain") == {0: [("flip", 2)], 1: [("flip", 5)]}  # the control


def test_both_ranks_give_up_together_when_one_cannot_drain():
    agreed = run("agree", "timeout")
    assert agreed[0] == agreed[1] and agreed[0][0][0] == "gave_up"
    alone = run("alone", "timeout")
    assert alone[0] == [("flip", 2)] and alone[1][0][0] == "gave_up"  # the control


@pytest.mark.heavy  # a tp=2 engine on two cores: three minutes (make test-heavy)
def test_a_tp2_engine_switches_in_place_on_both_ranks(tmp_path_factory):
    from tiny_model import write_model_dir

    _require_sglang()
    model = write_model_dir(tmp_path_factory.mktemp("tiny-llama-tp"))
    logs = Path(os.environ.get("EVINFRA_SGLANG_LOGS") or tmp_path_factory.mktemp("tp-logs"))
    e = Engine("tp2", "prefill", model, logs, patch=True,
               extra_args=HICACHE_ARGS + ("--tp-size", "2"),
               env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        e.start()
        e.wait_ready(timeout=400)
        info = http("GET", e.url + "/server_info")[1]
        assert info["tp_size"] == 2 and info["evinfra_engine_patch"]["switch_in_place"]
        for role in ("decode", "prefill"):
            body = {"new_role": role, "decode_cuda_graph_memory_gb": 0}
            code, out = http("POST", e.url + "/pd_role_switch", body, timeout=120)
            assert code == 200 and out["success"], out
            assert http("GET", e.url + "/model_info")[1]["disaggregation_mode"] == role
            assert http("GET", e.url + "/health")[0] == 200
        # Two switches, each logged by both ranks (SGLang prefixes rank 1's lines "TP1"; the
        # answer comes from rank 0, whose line may be written first).
        deadline = time.monotonic() + 20
        while True:
            log = e.log_path.read_bytes()[e._log_start:].decode(errors="replace")  # this start
            flips = [line for line in log.splitlines() if "evinfra_switch {" in line]
            if len(flips) >= 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(flips) == 4 and sum("TP1]" in line for line in flips) == 2, flips
        assert all('"ok": true' in line for line in flips)
        assert "evinfra engine patch: pool off: tp=2" in log
    finally:
        e.stop()
