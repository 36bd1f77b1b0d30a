"""``evinfra partitions nginx --config etc/partitions.toml [--out FILE]``: the global tier's
nginx config for the partitions of a cluster (``evinfra/partitions/nginx.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evinfra.errors import ConfigError
from evinfra.partitions.config import load_partitions
from evinfra.partitions.nginx import render

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("partitions", help="the global tier in front of partitions (nginx)")
    what = p.add_subparsers(dest="partitions_command", required=True)
    n = what.add_parser("nginx", help="write the nginx config that binds agents to partitions")
    n.add_argument("--config", default="etc/partitions.toml",
                   help="the partitions (etc/partitions.toml)")
    n.add_argument("--out", help="write nginx.conf here (default: stdout)")
    n.set_defaults(func=_nginx)


def _nginx(args: argparse.Namespace) -> int:
    text = render(load_partitions(args.config), args.config)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.out).write_text(text)
    except OSError as exc:
        raise ConfigError(f"cannot write {args.out}: {exc.strerror}") from None
    return 0
