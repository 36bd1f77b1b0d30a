"""The nginx config of the global tier: consistent hashing on the agent's identity.

``render(config)`` writes a whole ``nginx.conf`` whose every path is relative to nginx's prefix
(``nginx -p DIR -c nginx.conf``), so it runs as any user from any directory:

* ``hash $evinfra_agent consistent`` (ketama): an agent lands in one partition for all its
  requests, and a partition that goes away moves only the agents it held, to the next
  partition on the ring, where each is served (paper D.2's binding of users to partitions);
* ``$evinfra_agent`` is the first non-empty header of
  :data:`~evinfra.partitions.identity.IDENTITY_HEADERS`, the order the partitions read it in;
* ``proxy_buffering off``: server-sent events pass token by token;
* ``proxy_next_upstream error timeout``: a request whose partition refuses the connection
  goes to the next one; one that reached a partition is never sent twice (POST);
* ``X-Evinfra-Upstream`` on every answer: the partition that served it.
"""

from __future__ import annotations

import math

from evinfra.partitions.config import PartitionsConfig
from evinfra.partitions.identity import IDENTITY_HEADERS

__all__ = ["render"]


def _var(header: str) -> str:
    return "$http_" + header.lower().replace("-", "_")


def _identity_maps() -> list[str]:
    """``map`` blocks choosing the first non-empty identity header, innermost (last) first."""
    names = [_var(h) for h in IDENTITY_HEADERS]
    out = []
    fallback = names[-1]
    for i in range(len(names) - 2, -1, -1):
        target = "$evinfra_agent" if i == 0 else f"$evinfra_agent_{i}"
        out += [f"    map {names[i]} {target} {{",
                f'        ""      {fallback};',
                f"        default {names[i]};",
                "    }"]
        fallback = target
    return out


def _s(seconds: float) -> str:
    return f"{seconds:g}s" if seconds == int(seconds) else f"{round(seconds * 1000)}ms"


def render(config: PartitionsConfig, source: str = "etc/partitions.toml") -> str:
    """The ``nginx.conf`` of ``config`` (read from ``source``, named in its header)."""
    g = config.nginx
    listen = f"[{g.host}]:{g.port}" if ":" in g.host else f"{g.host}:{g.port}"
    lines = [
        f"# Written by `evinfra partitions nginx --config {source}`; edit that file instead.",
        "# The global tier in front of the partitions; run it as",
        "#   nginx -p DIR -c nginx.conf      (DIR: where it writes its pid, logs, temp files)",
        "# and start each partition with:",
    ]
    lines += [f"#   evinfra serve --config {p.config} --host {p.host} --port {p.port}   # {p.name}"
              for p in config.partitions]
    lines += [
        "",
        f"worker_processes {g.worker_processes or 'auto'};",
        "pid nginx.pid;",
        "error_log error.log warn;",
        "",
        "events {",
        "    worker_connections 4096;",
        "}",
        "",
        "http {",
        "    access_log off;",
        "    client_body_temp_path body_temp;",
        "    proxy_temp_path proxy_temp;",
        "    fastcgi_temp_path fastcgi_temp;",
        "    uwsgi_temp_path uwsgi_temp;",
        "    scgi_temp_path scgi_temp;",
        "",
        "    # The agent's identity: the first of these headers sent (evinfra/partitions/identity.py).",
    ]
    lines += _identity_maps()
    lines += [
        "",
        "    upstream evinfra_partitions {",
        "        hash $evinfra_agent consistent;",
    ]
    lines += [f"        server {p.address} max_fails={g.max_fails} "
              f"fail_timeout={math.ceil(g.fail_timeout_s)}s;   # {p.name}" for p in config.partitions]
    lines += [
        "        keepalive 64;",
        "    }",
        "",
        "    server {",
        f"        listen {listen};",
        f"        client_max_body_size {g.max_body_bytes};",
        "        location / {",
        "            proxy_pass http://evinfra_partitions;",
        "            proxy_http_version 1.1;",
        '            proxy_set_header Connection "";',
        "            proxy_set_header Host $host;",
        "            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;",
        "            # Token streams (SSE) pass as the partition writes them.",
        "            proxy_buffering off;",
        "            proxy_cache off;",
        f"            proxy_connect_timeout {_s(g.connect_timeout_s)};",
        f"            proxy_read_timeout {_s(g.read_timeout_s)};",
        f"            proxy_send_timeout {_s(g.send_timeout_s)};",
        "            # A partition down: the next on the ring (a POST that reached one is never resent).",
        "            proxy_next_upstream error timeout;",
        f"            proxy_next_upstream_timeout {_s(g.connect_timeout_s * len(config.partitions))};",
        "            add_header X-Evinfra-Upstream $upstream_addr always;",
        "        }",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)
