"""Two test hosts on one machine: network namespaces joined by a bridge (``ip netns`` + veth).

``two_hosts(tag)`` makes namespaces ``evi-<tag>-a`` / ``-b`` with addresses 10.213.N.2 / .3 on
a bridge whose root-side address 10.213.N.1 lets the test process reach both; each namespace
has only its veth and loopback, so an engine there reaches the other only through its veth
address, never through a shared loopback. Everything is removed on exit. Needs root, ``ip``
(iproute2, installed by ``scripts/install-sglang-cpu.sh``) and ``nsenter`` (util-linux), with
which a test starts a process in a namespace (``/run/netns/<name>``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator


def missing() -> str | None:
    """Why the namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2): run scripts/install-sglang-cpu.sh"
    if shutil.which("nsenter") is None:
        return "no `nsenter` (util-linux)"
    return None


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if p.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


@contextlib.contextmanager
def two_hosts(tag: str, subnet: int = 77) -> Iterator[dict[str, str]]:
    """``{"a_ns", "a_ip", "b_ns", "b_ip", "gw"}``: each host's namespace and address, and the
    bridge's address (the test process's side)."""
    net = f"10.213.{subnet}"
    bridge = f"evbr{tag}"[:15]
    made: list[tuple[str, str]] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(("link", bridge))
        _ip("addr", "add", f"{net}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        out = {"gw": f"{net}.1"}
        for i, n in enumerate("ab"):
            ns, outer, inner = f"evi-{tag}-{n}", f"ev{tag}{n}"[:15], f"ev{tag}{n}i"[:15]
            _ip("netns", "add", ns)
            made.append(("netns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            made.append(("link", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            addr = f"{net}.{i + 2}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", f"{net}.1")
            out[f"{n}_ns"], out[f"{n}_ip"] = ns, addr
        _check(out)
        yield out
    finally:
        for kind, name in reversed(made):
            subprocess.run(["ip", kind, "del", name], capture_output=True, timeout=30)


def _check(hosts: dict[str, str]) -> None:
    """A TCP connection from namespace a to a listener in namespace b, through the bridge."""
    code = ("import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(1); "
            "print(s.getsockname()[1], flush=True); c, _ = s.accept(); c.sendall(b'ok')")
    srv = subprocess.Popen(["ip", "netns", "exec", hosts["b_ns"], "python3", "-c", code],
                           stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        probe = ("import socket,sys; c=socket.create_connection((sys.argv[1], int(sys.argv[2])),"
                 " timeout=5); print(c.recv(2).decode())")
        got = subprocess.run(["ip", "netns", "exec", hosts["a_ns"], "python3", "-c", probe,
                              hosts["b_ip"], str(port)], capture_output=True, text=True,
                             timeout=30)
        if got.stdout.strip() != "ok":
            raise RuntimeError(f"namespace a cannot reach b at {hosts['b_ip']}: {got.stderr}")
    finally:
        srv.kill()
        srv.wait()
