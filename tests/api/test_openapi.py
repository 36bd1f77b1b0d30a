"""``GET /openapi.json`` describes every route the app serves, with the request bodies its
handlers decode; schemathesis generates requests from it (valid and not) against a live
server, a bounded number per operation, and none may be a 500 or an answer the document does
not describe."""

from __future__ import annotations

import asyncio
import threading

import pytest
import requests
import schemathesis
import schemathesis.specs.openapi.schemas  # noqa: F401  (see below)
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import content_type_conformance, status_code_conformance

from evinfra.api import build_app
from evinfra.api.front import FrontRunner
from evinfra.api.tokenizer import ByteTokenizer
from evinfra.config import parse_config
from evinfra.control import Service
from evinfra.core.clock import WallClock
from tests.api.conftest import BASE, merged

# from_url() imports schemathesis' OpenAPI modules lazily, through pytest's assertion rewriter;
# on CPython 3.11.7, compiling them inside a test (after hypothesis has moved the recursion
# limit) can raise "SystemError: AST constructor recursion depth mismatch" (CPython gh-106905).
# Imported above, they compile at collection instead.

EXAMPLES = 12
"""Generated requests per operation (some 26 operations)."""

FUZZ = merged(BASE, {
    # Tiny outputs: a generated max_tokens or n cannot make one request run for long.
    "model": {"max_context_tokens": 256},
    "fake": {"c0": 1e-4, "d0": 1e-4, "d1": 1e-5},
    "limits": {"body_bytes": 100_000},
})


@pytest.fixture(scope="module")
def live():
    """The app behind ``FrontRunner`` in a thread of its own (schemathesis calls are
    blocking), on a loopback port; its base URL."""
    started, stop = threading.Event(), None
    where: dict = {}

    async def run() -> None:
        nonlocal stop
        stop = asyncio.Event()
        service = Service.from_config(parse_config(FUZZ), WallClock())
        await service.start()
        runner = FrontRunner(build_app(service, ByteTokenizer()), service.config.limits)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        where["base"] = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        where["loop"] = asyncio.get_running_loop()
        started.set()
        await stop.wait()
        await runner.cleanup()
        await service.stop()

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    assert started.wait(30)
    yield where["base"]
    where["loop"].call_soon_threadsafe(stop.set)
    thread.join(30)


def test_the_document_lists_every_route_and_body(live):
    doc = requests.get(live + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    paths = doc["paths"]
    for path, method in [("/v1/chat/completions", "post"), ("/v1/messages", "post"),
                         ("/v1/responses/{response_id}", "delete"), ("/health", "get"),
                         ("/v1/evinfra/nodes/{node}/{action}", "post"), ("/metrics", "get")]:
        assert method in paths[path], path
    chat = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = doc["components"]["schemas"][chat["schema"]["$ref"].rsplit("/", 1)[1]]
    assert {"model", "messages"} <= set(schema["required"])
    action = paths["/v1/evinfra/nodes/{node}/{action}"]["post"]["parameters"][1]
    assert action["schema"]["enum"] == ["cordon", "uncordon"]


def no_500(ctx, response, case) -> bool:
    """An unexpected error (the mixed-batch TypeError was one): never. A 503 (no node now)
    or a 504 is the cluster's honest answer, not a bug of the API."""
    if response.status_code == 500:
        raise AssertionError(f"500 for {case.method} {case.formatted_path}: {response.text}")
    return True


def test_schemathesis_finds_no_500_and_nothing_undocumented(live):
    schema = schemathesis.openapi.from_url(live + "/openapi.json")
    tried, failures = 0, []
    session = requests.Session()
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            nonlocal tried
            tried += 1
            response = case.call(base_url=live, session=session, timeout=30)
            try:
                case.validate_response(response, checks=[
                    no_500, status_code_conformance, content_type_conformance])
            except Exception as exc:  # noqa: BLE001 - gathered, reported together
                failures.append(f"{operation.label}: {exc}"[:2000])
                raise

        try:
            run()
        except Exception:  # noqa: BLE001 - hypothesis re-raises the shrunk failure
            pass
    print(f"schemathesis: {tried} requests over {len(operations)} operations, "
          f"{len(failures)} failures")
    assert len(operations) >= 19 and tried >= EXAMPLES * 10
    assert failures == [], "\n".join(failures[:5])
