"""``evinfra``: the command line.

    evinfra serve --config etc/cluster.toml [--host H] [--port P] [--policy NAME] [--log-format F]
    evinfra simulate --config etc/cluster.toml --workload cc --agents 126 ... --out DIR
    evinfra replay --target URL --workload cc --agents 8 --duration 60 --out DIR
    evinfra experiment fig6 [--quick] [--out DIR] [--jobs N]
    evinfra partitions nginx --config etc/partitions.toml [--out FILE]

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
    if args.policy is not None:
        config = msgspec.structs.replace(
            config, policy=msgspec.structs.replace(config.policy, name=args.policy))
    server = config.server
    if args.host is not None or args.port is not None:
        server = msgspec.structs.replace(
            server, host=args.host if args.host is not None else server.host,
            port=args.port if args.port is not None else server.port)
        config = msgspec.structs.replace(config, server=server)
    from evinfra.api.auth import exposure

    exposure(config.server)  # refuses an open server on the network before anything starts
    tokenizer = load_tokenizer(config.model.dir)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(_run_server(config, tokenizer))
    return uvloop.run(_run_server(config, tokenizer))


async def _run_server(config, tokenizer) -> int:
    from aiohttp import web

    from evinfra.api import build_app
    from evinfra.api.auth import exposure
    from evinfra.api.front import FrontRunner
    from evinfra.core.clock import WallClock
    from evinfra.control import Service

    warning = exposure(config.server)  # (a server that must not start raised in _serve)
    service = Service.from_config(config, WallClock())
    app = build_app(service, tokenizer)
    runner = FrontRunner(app, config.limits)
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
    if warning is not None:
        log.warning("auth", message=warning)
        print(f"evinfra: warning: {warning}", file=sys.stderr, flush=True)

    # The first SIGTERM or SIGINT starts the graceful shutdown; a second one cuts its grace
    # short (an operator who presses Ctrl-C twice, or an orchestrator that insists).
    stop, hurry = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if stop.is_set():
            log.warning("shutdown_hurried", in_flight=service.in_flight())
            hurry.set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled)
    await stop.wait()

    grace = config.server.shutdown_grace_s
    log.info("shutting_down", in_flight=service.in_flight(), grace_s=grace)
    service.accepting = False
    await site.stop()  # no new connections; open ones finish their requests
    deadline = loop.time() + grace
    while service.in_flight() and loop.time() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    left = service.in_flight()
    await service.stop()  # fails what is left
    await runner.cleanup()
    log.info("stopped", failed_at_shutdown=left)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from evinfra.workloads.replay import run

    return run(args)


def _port(text: str) -> int:
    """``--port``: what the config's ``server.port`` accepts (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    from evinfra.config import Port

    try:
        return msgspec.convert(port, Port)
    except msgspec.ValidationError:
        message = f"{port} is not a port (0-65535; 0: any free port)"
        raise argparse.ArgumentTypeError(message) from None


def main(argv: list[str] | None = None) -> int:
    from evinfra.baselines import POLICIES
    from evinfra.logs import configure_logging

    ap = argparse.ArgumentParser(prog="evinfra", description="Agent-adaptive LLM serving control plane")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the control plane with its HTTP API")
    s.add_argument("--config", required=True, help="TOML config (etc/cluster.toml)")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=_port, default=None)
    s.add_argument("--policy", choices=POLICIES,
                   help="the system to run (default: the config's [policy] name)")
    s.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    s.set_defaults(func=_serve)

    from evinfra.sim.command import add_parser as add_simulate

    add_simulate(sub)
    # --partitions: the simulate command of evinfra/partitions (sim knows nothing of it).
    from evinfra.partitions.simulate import add_arguments as add_partitioned

    add_partitioned(sub.choices["simulate"])

    from evinfra.experiments.command import add_parser as add_experiment

    add_experiment(sub)

    from evinfra.partitions.command import add_parser as add_partitions

    add_partitions(sub)

    r = sub.add_parser("replay", help="drive an OpenAI-compatible endpoint with agent traffic")
    r.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    r.add_argument("--api-key", default=None)
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", help="cc | putnam | osworld | shift")
    what.add_argument("--trace", help="a trace file (see --format)")
    r.add_argument("--format", default="mooncake", help="trace format: mooncake | agentic | trie")
    load = r.add_mutually_exclusive_group()
    load.add_argument("--agents", type=int, help="closed loop: agents kept running")
    load.add_argument("--arrival-rate", type=float,
                      help="open loop: agents per second (a trace without either: its times)")
    r.add_argument("--max-active", type=int, default=None,
                   help="open loop: admission cap (agents running at once)")
    r.add_argument("--duration", type=float, required=True, help="seconds of (replayed) time")
    r.add_argument("--speedup", type=float, default=1.0, help="compress pauses and arrivals")
    r.add_argument("--model", default=None, help="model name (default: the target's first)")
    r.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="token-id prompts on /v1/completions, or chat messages")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    r.add_argument("--grace", type=float, default=30.0,
                   help="wall seconds requests in flight at the end get to finish")
    r.add_argument("--page-size", type=int, default=64, help="KV page size for the ideal h*")
    r.add_argument("--token-range", default="1000:32000",
                   help="LOW:HIGH ids of synthesized tokens; fit the target's vocabulary")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--no-hints", action="store_true",
                   help="send no branch hints (X-Evinfra-*), as harnesses ship")
    r.add_argument("--out", required=True, help="directory for requests.jsonl and summary.json")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--log-format", choices=("auto", "json", "console"), default="auto")
    r.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="warning")
    # Bad arguments: one line and status 2 (argparse would print the usage first).
    r.error = lambda message: r.exit(2, f"evinfra replay: error: {message}\n")
    r.set_defaults(func=_replay)
    args = ap.parse_args(argv)
    configure_logging(getattr(args, "log_format", "auto"), getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except EvinfraError as exc:
        print(f"evinfra: error: {exc.message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file named on the command line or in the config
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"evinfra: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
