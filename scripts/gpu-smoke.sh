#!/usr/bin/env bash
# The evinfra engine patch on one NVIDIA GPU: a smoke test of what the CPU tests cannot reach
# (CUDA graphs, the overlap scheduler, SGLang's GPU host-tier kernels). NOT YET RUN ON A GPU.
#
#   scripts/gpu-smoke.sh [PYTHON]      # PYTHON: an interpreter with SGLang 0.5.23 (CUDA build)
#                                      # and evinfra importable (default: python3)
#
# Starts a patched prefill/decode pair on the one GPU (each with a third of its memory, CUDA
# graphs and overlap scheduling on, HiCache write-through, Mooncake over TCP), serving the
# context-sensitive random-weight model of tests/integration/sglang_cpu/context_model.py
# (bfloat16 here), then checks, as the CPU tests do (tests/integration/
# test_engine_patch_sglang.py):
#   1. control: another prefix gives other tokens and log-probabilities;
#   2. local reuse, a fetch from the peer's host memory (48 tokens), and the kept cache after
#      a P->D->P switch round trip give the base request's tokens and log-probabilities
#      (within SMOKE_LOGPROB_TOL, default 0.05: bfloat16 and different kernels per path);
#   3. count hints: after a flood, host eviction took zero-count blocks only;
#   4. the engine logs name no hook failure (SGLang's "Failed to apply hooks", "Failed to
#      execute general plugin", the patch's refusal or start failure, a Python traceback).
# Prints one line per check and exits 0 only if all pass; logs stay in $SMOKE_DIR (default a
# new temp dir). Budget: about 3 minutes (engine starts dominate), 10 at most (timeouts).
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${1:-python3}"
SMOKE_DIR="${SMOKE_DIR:-$(mktemp -d -t evinfra-gpu-smoke.XXXXXX)}"
export SMOKE_DIR SMOKE_LOGPROB_TOL="${SMOKE_LOGPROB_TOL:-0.05}"

command -v nvidia-smi >/dev/null || { echo "gpu-smoke: no nvidia-smi: not a GPU machine" >&2; exit 2; }
"$PY" -c "import sglang, torch; assert torch.cuda.is_available()" \
  || { echo "gpu-smoke: $PY has no CUDA SGLang" >&2; exit 2; }
echo "gpu-smoke: logs in $SMOKE_DIR"

exec timeout 600 "$PY" - <<'EOF'
import json, os, random, re, subprocess, sys
from pathlib import Path

sys.path[:0] = ["tests/integration/sglang_cpu", "."]
from context_model import write_context_model_dir  # noqa: E402
from engines import Engine  # noqa: E402
from pd_client import generate, http  # noqa: E402
from evinfra.core.hashing import block_hashes  # noqa: E402
from evinfra.engine_patch.wire import FetchPlan, FetchRunWire, fetch_kv_hints  # noqa: E402

P, LP, TOL = 16, 49, float(os.environ["SMOKE_LOGPROB_TOL"])
out = Path(os.environ["SMOKE_DIR"])
model = write_context_model_dir(out / "model", sys.executable)
cfg = json.loads((model / "config.json").read_text())
(model / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))


class GpuEngine(Engine):
    def command(self):
        kv = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.kv_port}", "bind": True,
              "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
                "--load-format", "safetensors", "--mem-fraction-static", "0.3",
                "--page-size", str(P), "--max-total-tokens", "8192",
                "--host", "127.0.0.1", "--port", str(self.port),
                "--kv-events-config", json.dumps(kv), "--disaggregation-mode", self.role,
                "--disaggregation-transfer-backend", "mooncake_tcp",
                "--disaggregation-bootstrap-port", str(self.bootstrap_port),
                "--enable-pd-role-switch", "--disaggregation-decode-enable-radix-cache",
                "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
                "--hicache-ratio", "2"]

    def start(self):
        env = {**os.environ, "EVINFRA_ENGINE_PATCH": "1"}
        self.proc = subprocess.Popen(self.command(), stdout=open(self.log_path, "ab"),
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)


def tokens(seed, n):
    r = random.Random(seed)
    return [r.randrange(3, 500) for _ in range(n)]


def diff(r, base):
    bad = [] if r["output_ids"] == base["output_ids"] else ["tokens"]
    for k in ("input_logprobs", "logprobs"):
        d = max((abs(x - y) for x, y in zip(r[k], base[k]) if None not in (x, y)), default=0)
        if d > TOL or len(r[k]) != len(base[k]):
            bad.append(f"{k} {d:.3f}")
    return bad


failed = []


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        failed.append(name)


a, b = (GpuEngine(n, role, model, out) for n, role in (("a", "prefill"), ("b", "decode")))
try:
    for e in (a, b):
        e.start()
    for e in (a, b):
        e.wait_ready(timeout=300, restarts=0)
    gen = lambda p, d, ids, **kw: generate(p.url, d.url, p.bootstrap_port, ids, 8,  # noqa: E731
                                           logprob_start=LP, **kw)
    prompt = tokens(1, 48) + tokens(2, 9)
    base = gen(a, b, prompt)
    other = gen(a, b, tokens(3, 48) + prompt[48:])
    check("control: another prefix changes the output", "tokens" in diff(other, base),
          str(diff(other, base)))
    local = gen(a, b, prompt)
    check("local prefix reuse", not diff(local, base) and local["prefill"]["cached_tokens"] >= 48,
          str(diff(local, base)))
    http("POST", a.url + "/flush_cache")
    peer = http("GET", b.url + "/server_info")[1]["evinfra_engine_patch"]["pool"]
    plan = FetchPlan(P, [FetchRunWire(peer, 0, block_hashes(prompt, P)[:3])])
    r = gen(a, b, prompt, kv_hints=fetch_kv_hints(plan, "smoke"), decode_delay_s=0.5)
    fetched = r["prefill"].get("cached_tokens_details", {}).get("evinfra_fetched", 0)
    check("fetch from the peer's host memory", fetched == 48 and not diff(r, base),
          f"fetched={fetched} {diff(r, base)}")
    for e, role in ((a, "decode"), (b, "prefill"), (b, "decode"), (a, "prefill")):
        code, ans = http("POST", e.url + "/pd_role_switch",
                         {"new_role": role, "decode_cuda_graph_memory_gb": 0}, timeout=300)
        check(f"switch {e.name} -> {role}", code == 200 and ans.get("success"), str(ans)[:200])
    r = gen(a, b, prompt)
    check("kept cache after P->D->P", not diff(r, base) and r["prefill"]["cached_tokens"] >= 48,
          str(diff(r, base)))
    kept = [tokens(200 + i, 256) for i in range(3)]
    for p in kept:
        gen(a, b, p)
    positive = [h for p in kept for h in block_hashes(p, P)]
    http("POST", a.url + "/evinfra/hints", {"positive": positive, "zero": []})
    for i in range(80):  # 20k tokens through 8k device + 16k host slots
        generate(a.url, b.url, a.bootstrap_port, tokens(300 + i, 256), 1)
    ev = http("GET", a.url + "/evinfra/status")[1].get("eviction", {})
    check("count-aware host eviction", ev.get("evicted_zero_nodes", 0) > 0
          and ev.get("evicted_positive_nodes", 1) == 0 and ev.get("violations", 1) == 0,
          json.dumps({k: ev.get(k) for k in ("evicted_zero_nodes", "evicted_positive_nodes",
                                             "violations")}))
finally:
    for e in (a, b):
        e.stop()

pattern = re.compile(r"Failed to apply hooks|Failed to execute general plugin|refusing to start|"
                     r"engine patch failed|Traceback|evinfra .* off: ")
for e in (a, b):
    hits = [line for line in e.log_path.read_text(errors="replace").splitlines()
            if pattern.search(line)]
    check(f"engine {e.name} log names no hook failure", not hits, "; ".join(hits[:3]))
print(f"gpu-smoke: {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
sys.exit(1 if failed else 0)
EOF
