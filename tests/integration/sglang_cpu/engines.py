"""Real SGLang 0.5.23 engines on CPU, started and stopped by the integration tests.

Each engine runs ``python -m sglang.launch_server`` from the separate SGLang venv (built by
``scripts/install-sglang-cpu.sh``) in its own process group, so stopping it kills the scheduler
and detokenizer children too. Flags are the verified CPU recipe of ``shared/sglang-cpu.md``;
every port is picked free on 127.0.0.1 and every socket binds loopback only.

Ports: an engine binds its HTTP port only at the end of its start (half a minute on 2 cores),
so a port picked by ``bind(0)`` could meanwhile become the source port of some outgoing
connection: both come from the kernel's ephemeral range. Ports are therefore picked below that
range, between the windows where the engines pick their own (Mooncake's transfer engine
15000-17000, SGLang's NCCL port 22000-29999); an engine that still finds a port taken starts
again on new ones.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SHADOW = HERE / "shadow"
PATCH = HERE / "patch"
"""The evinfra engine patch's entry point (a dist-info SGLang finds on PYTHONPATH; the
repository root beside it provides the ``evinfra`` package). Every engine sees the plugin;
only an engine started with ``patch=True`` gets ``EVINFRA_ENGINE_PATCH=1``, so the others run
stock SGLang with the plugin installed but disabled."""

# The engine patch's host tier on CPU (evinfra/engine_patch/README.md).
HICACHE_ARGS = ("--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                "--hicache-mem-layout", "layer_first", "--hicache-write-policy", "write_through")

PAGE_SIZE = 4
MAX_TOTAL_TOKENS = 4096
SERVED_NAME = "tiny-llama"


def sglang_python() -> Path:
    """The SGLang venv's interpreter (``EVINFRA_SGLANG_VENV`` or ``.venv-sglang``)."""
    venv = Path(os.environ.get("EVINFRA_SGLANG_VENV") or REPO / ".venv-sglang")
    if not venv.is_absolute():
        venv = REPO / venv  # as the Makefile names it: relative to the repository
    return venv / "bin" / "python"


_PICK = random.SystemRandom()  # not the global generator, which a test may seed
_PORTS = (17001, 22000)  # see the module docstring


def free_port() -> int:
    """A port free now on 127.0.0.1, below the ephemeral range (see the module docstring)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    ports = range(_PORTS[0], min(_PORTS[1], ephemeral))
    for port in _PICK.sample(ports, min(64, len(ports))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """One SGLang server process (a PD engine with role switch enabled). ``patch=True`` turns
    the evinfra engine patch on (add ``HICACHE_ARGS`` for its host tier); ``extra_args`` are
    appended to the launch flags; ``kv_replay_steps`` is how many KV event batches its replay
    endpoint keeps (SGLang's ``buffer_steps``; default 10,000)."""

    def __init__(self, name: str, role: str, model_dir: Path, log_dir: Path, *,
                 patch: bool = False, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None,
                 max_total_tokens: int = MAX_TOTAL_TOKENS,
                 kv_replay_steps: int | None = None) -> None:
        self.name = name
        self.role = role
        self.model_dir = model_dir
        self.patch = patch
        self.extra_args = tuple(extra_args)
        self.extra_env = dict(env or {})
        self.max_total_tokens = max_total_tokens
        self.kv_replay_steps = kv_replay_steps
        self.log_path = log_dir / f"sglang-{name}.log"
        self._pick_ports()
        self._log_start = 0  # where the last start's output begins in the log
        self.proc: subprocess.Popen | None = None

    def _pick_ports(self) -> None:
        self.port = free_port()
        self.kv_port = free_port()
        self.replay_port = free_port()
        self.bootstrap_port = free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        kv = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.kv_port}", "bind": True,
              "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}
        if self.kv_replay_steps is not None:
            kv["buffer_steps"] = self.kv_replay_steps
        return [
            str(sglang_python()), "-m", "sglang.launch_server",
            "--model-path", str(self.model_dir), "--served-model-name", SERVED_NAME,
            "--load-format", "dummy", "--device", "cpu",
            "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            # xgrammar holds outputs to JSON schemas (constrained output); JSON without free
            # whitespace, or the dummy weights may write whitespace up to max_tokens.
            "--grammar-backend", "xgrammar", "--constrained-json-disable-any-whitespace",
            "--disable-cuda-graph", "--disable-overlap-schedule",
            "--page-size", str(PAGE_SIZE), "--max-total-tokens", str(self.max_total_tokens),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--kv-events-config", json.dumps(kv),
            "--disaggregation-mode", self.role,
            "--disaggregation-transfer-backend", "mooncake_tcp",
            "--disaggregation-bootstrap-port", str(self.bootstrap_port),
            "--disaggregation-decode-retraction-backup", "cpu_tensor",
            "--enable-pd-role-switch",
            # Keep the radix cache in both roles: SGLang disables it on decode engines by
            # default, and an engine launched as decode would prefill without one after a
            # switch.
            "--disaggregation-decode-enable-radix-cache",
            *self.extra_args,
        ]

    def start(self) -> None:
        env = dict(os.environ)
        env.update(SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(map(str, (SHADOW, PATCH, REPO))),
                   TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("VIRTUAL_ENV", None)
        env.pop("EVINFRA_ENGINE_PATCH", None)
        if self.patch:
            env["EVINFRA_ENGINE_PATCH"] = "1"
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)  # a new $EVINFRA_SGLANG_LOGS
        log = open(self.log_path, "ab")
        self._log_start = log.tell()
        log.write(f"\n=== start {self.name} ({self.role}) at {time.ctime()}\n".encode())
        log.flush()
        # A new session: the engine and the children it forks form one process group that
        # stop()/kill() end together.
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=str(self.model_dir),
                                     start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = 240.0, restarts: int = 2) -> None:
        """Wait for ``/health``; an engine that could not bind one of its ports (it stays up,
        serving nothing) is started again on new ports, at most ``restarts`` times."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"SGLang engine {self.name} exited during start; see "
                                   f"{self.log_path}:\n{self.log_tail()}")
            if restarts and self._port_taken():
                print(f"warning: SGLang engine {self.name} found a port taken; starting it "
                      f"again on new ports", file=sys.stderr)
                self.stop()
                self._pick_ports()
                self.start()
                restarts -= 1
                deadline = time.monotonic() + timeout
                continue
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"SGLang engine {self.name} not healthy after {timeout:g} s; see "
                           f"{self.log_path}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as the tests want it)."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if not self.alive():
            self._signal_group(signal.SIGKILL)  # stray children of a dead leader
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            print(f"warning: SGLang engine {self.name} (pid {self.proc.pid}) did not exit",
                  file=sys.stderr)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group id is the leader's pid (new session)
        except ProcessLookupError:
            pass

    def _port_taken(self) -> bool:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return b"address already in use" in f.read()
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@contextmanager
def running(engines: dict[str, "Engine"]) -> Iterator[dict[str, "Engine"]]:
    """Start every engine, wait until all are ready (together), and stop them all at the end,
    whatever happened: what each engine-pair fixture does."""
    try:
        for e in engines.values():
            e.start()
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda e: e.wait_ready(), engines.values()))
        yield engines
    finally:
        for e in engines.values():
            e.stop()
