"""Fixtures that start real SGLang engines (``sglang_cpu/engines.py``) and evinfra in front,
and ``evinfra serve`` on fast fake engines (``fake_serve``).

The engines need the separate SGLang venv of ``scripts/install-sglang-cpu.sh``. Without it the
``sglang`` tests are skipped, unless ``EVINFRA_SGLANG_REQUIRED=1`` (``make test`` sets it), in
which case they fail: CI must not pass by skipping them.

At most two engines run at once (the machines have two cores); every process started here is
stopped in the fixture's teardown, its whole process group.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).parent / "sglang_cpu"))

from engines import (PAGE_SIZE, SERVED_NAME, Engine, free_port, running,  # noqa: E402
                     sglang_python)
from tiny_model import write_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVE = """
[server]
port = {port}
shutdown_grace_s = 3.0
[cluster]
nodes = [{{ name = "n0" }}, {{ name = "n1" }}, {{ name = "n2" }}]
initial_prefill = 1
[fake]
c0 = 0.002
c1 = 1e-6
d0 = 0.002
d1 = 0.002
d2 = 1e-5
"""


class FakeServe(NamedTuple):
    proc: subprocess.Popen
    base: str
    log: Path
    """The server's JSON log (its stdout and stderr)."""


@pytest.fixture(scope="module")
def fake_serve(tmp_path_factory) -> Iterator[FakeServe]:
    """``evinfra serve`` on three fast fake engines at a free loopback port, once ready;
    stopped at the module's end."""
    port = free_port()
    d = tmp_path_factory.mktemp("serve")
    cfg, log = d / "cluster.toml", d / "serve.log"
    cfg.write_text(FAKE_SERVE.format(port=port))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "evinfra.cli", "serve", "--config",
                                 str(cfg), "--log-format", "json"], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    else:
        proc.kill()
        proc.wait()
        pytest.fail("evinfra serve did not become ready: " + log.read_text()[-3000:])
    yield FakeServe(proc, base, log)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _require_sglang() -> None:
    if sglang_python().exists():
        return
    msg = (f"no SGLang venv at {sglang_python().parent.parent} "
           "(run scripts/install-sglang-cpu.sh)")
    if os.environ.get("EVINFRA_SGLANG_REQUIRED") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def engines(model_dir, tmp_path_factory):
    """Engine ``a`` launched as prefill, ``b`` as decode (the tests may switch them)."""
    _require_sglang()
    logs = Path(os.environ.get("EVINFRA_SGLANG_LOGS") or tmp_path_factory.mktemp("sglang-logs"))
    pair = {"a": Engine("a", "prefill", model_dir, logs), "b": Engine("b", "decode", model_dir, logs)}
    with running(pair):
        yield pair


def sglang_config(engines: dict[str, Engine], model_dir: Path, port: int = 0) -> dict:
    """The evinfra config for the pair (``a`` listed first: it prefills in the initial split).

    ``t_learn`` is long so the planner never changes the split by itself during a test: the
    tests force splits through the admin route."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "first_token_timeout_s": 60.0,
                   "token_timeout_s": 30.0, "shutdown_grace_s": 2.0},
        "model": {"name": SERVED_NAME, "dir": str(model_dir), "max_context_tokens": 2048},
        "cluster": {"driver": "sglang", "initial_prefill": 1, "page_size": PAGE_SIZE,
                    "nodes": [{"name": n, "url": e.url} for n, e in engines.items()]},
        "planner": {"t_learn": 3600.0},
    }


def toml_text(config: dict) -> str:
    """A minimal TOML writer for the config above (tomllib reads; nothing here writes)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        raise TypeError(v)

    out = []
    for section, fields in config.items():
        out.append(f"[{section}]")
        out += [f"{k} = {value(v)}" for k, v in fields.items()]
    return "\n".join(out) + "\n"


class ServiceThread:
    """``evinfra serve``'s service and HTTP app (the same objects ``cli._run_server`` builds)
    on a loop in a background thread, so a test can talk HTTP to it *and* read its directory.

    ``call(fn)`` runs ``fn(service)`` on the service's loop and returns its result."""

    def __init__(self, config) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.service = None
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="evinfra-service", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServiceThread":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the service did not start")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        from aiohttp import web

        from evinfra.api import build_app
        from evinfra.api.tokenizer import load_tokenizer
        from evinfra.core.clock import WallClock
        from evinfra.control import Service

        try:
            self._stop = asyncio.Event()
            service = Service.from_config(self.config, WallClock())
            app = build_app(service, load_tokenizer(self.config.model.dir))
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await service.start()
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.service, self.url = service, f"http://127.0.0.1:{port}"
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        service.accepting = False
        await site.stop()
        await service.stop()
        await runner.cleanup()

    def call(self, fn, timeout: float = 30.0):
        async def run():
            return fn(self.service)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
