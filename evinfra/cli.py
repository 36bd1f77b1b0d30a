"""``evinfra``: the command line.

    evinfra serve --config etc/cluster.toml [--host H] [--port P] [--log-format F]

A bad config or argument prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import msgspec
import structlog

from evinfra.errors import EvinfraError

__all__ = ["main"]

log = structlog.get_logger("evinfra")


def _serve(args: argparse.Namespace) -> int:
    from evinfra.api.tokenizer import load_tokenizer
    from evinfra.config import load_config

    config = load_config(args.config)
    server = config.server
    if args.host is not None or args.port is not None:
        server = msgspec.structs.replace(
            server, host=args.host if args.host is not None else server.host,
            port=args.port if args.port is not None else server.port)
        config = msgspec.structs.replace(config, server=server)
    tokenizer = load_tokenizer(config.model.dir)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(_run_server(config, tokenizer))
    return uvloop.run(_run_server(config, tokenizer))


async def _run_server(config, tokenizer) -> int:
    from aiohttp import web

    from evinfra.api import build_app
    from evinfra.core.clock import WallClock
    from evinfra.service import Service

    service = Service.from_config(config, WallClock())
    app = build_app(service, tokenizer)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.server.host, config.server.port)
    try:
        await service.start()
        await site.start()
    except BaseException as exc:
        await service.stop()  # drivers that did start let go of their connections
        await runner.cleanup()
        if isinstance(exc, OSError):
            raise EvinfraError(f"cannot listen on {config.server.host}:{config.server.port}: "
                               f"{exc.strerror or exc}") from exc
        raise
    port = site._server.sockets[0].getsockname()[1] if site._server else config.server.port
    log.info("serving", url=f"http://{config.server.host}:{port}", model=config.model.name,
             nodes=len(config.cluster.nodes))
    print(f"evinfra serving {config.model.name!r} on http://{config.server.host}:{port}",
          file=sys.stderr, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    grace = config.server.shutdown_grace_s
    log.info("shutting_down", in_flight=service.in_flight(), grace_s=grace)
    service.accepting = False
    await site.stop()  # no new connections; open ones finish their requests
    deadline = loop.time() + grace
    while service.in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = service.in_flight()
    await service.stop()  # fails what is left
    await runner.cleanup()
    log.info("stopped", failed_at_shutdown=left)
    return 0


def main(argv: list[str] | None = None) -> int:
    from evinfra.logs import configure_logging

    ap = argparse.ArgumentParser(prog="evinfra", description="Agent-adaptive LLM serving control plane")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the control plane with its HTTP API")
    s.add_argument("--config", required=True, help="TOML config (etc/cluster.toml)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    s.set_defaults(func=_serve)
    args = ap.parse_args(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        return args.func(args)
    except EvinfraError as exc:
        print(f"evinfra: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
