"""The SGLang driver: real SGLang 0.5.23 PD engines behind the ``EngineDriver`` protocol.

See ``README.md`` beside this file for the module map, the wire facts and the deviations.
``build_drivers`` is what ``Service.from_config`` calls for ``[cluster] driver = "sglang"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from evinfra.core.bus import Bus
from evinfra.core.clock import Clock
from evinfra.core.types import NodeId
from evinfra.errors import ConfigError

if TYPE_CHECKING:
    from evinfra.drivers.base import EngineDriver
    from evinfra.drivers.sglang.driver import DriverSettings

__all__ = ["build_drivers", "DriverSettings", "SGLangDriver"]


def build_drivers(urls: Mapping[NodeId, str], page_size: int, clock: Clock, bus: Bus,
                  settings: "DriverSettings | None" = None) -> "dict[NodeId, EngineDriver]":
    """One driver per node (``urls``: each node's engine base URL, ``[[cluster.nodes]]``'s
    ``name`` and ``url``), sharing the book that pairs prefills with decodes."""
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ConfigError("the SGLang driver needs pyzmq: pip install 'evinfra[sglang]'",
                          key="cluster.driver") from exc
    from evinfra.drivers.sglang.driver import DriverSettings as _Settings
    from evinfra.drivers.sglang.driver import SGLangDriver as _Driver
    from evinfra.drivers.sglang.pairs import PairBook

    missing = [node for node, url in urls.items() if not url]
    if missing:
        raise ConfigError(f"nodes {missing} have no url (the engine's HTTP base URL, e.g. "
                          "http://10.0.0.5:30000)", key="cluster.nodes")
    bad = [url for url in urls.values() if not url.startswith(("http://", "https://"))]
    if bad:  # caught here, not after the discovery's wait on an address it cannot use
        raise ConfigError(f"node urls {bad} are not http(s) base URLs (e.g. "
                          "http://10.0.0.5:30000)", key="cluster.nodes")
    pairs = PairBook()
    return {node: _Driver(node, url, clock, bus, pairs, page_size, settings or _Settings())
            for node, url in urls.items()}


def __getattr__(name: str):
    # The driver module imports pyzmq and aiohttp; keep `import evinfra.drivers.sglang` cheap.
    if name in ("SGLangDriver", "DriverSettings"):
        from evinfra.drivers.sglang import driver

        return getattr(driver, name)
    raise AttributeError(name)
