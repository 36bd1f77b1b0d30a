"""Test-only KV corruption, so that an equivalence test can show it fails on wrong KV
(engine process only).

``EVINFRA_TEST_CORRUPT_KV`` names a file. When it is set and the file holds

* ``fetch``: the pages a fetch read from a peer are zeroed in this engine's host memory
  before they join the radix tree (so the request is prefilled on zeroed prefix KV);
* ``switch``: at an in-place flip, every KV byte of the device pool and of the host tier is
  zeroed (the cache the switch keeps is wrong, its tree intact).

The file, not the variable, says what to corrupt, so that one pair of engines serves a test's
honest and corrupted runs (an engine's environment is fixed at its start). Without the
variable nothing is read and nothing happens: production engines never set it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Sequence

from evinfra.engine_patch.layout import address
from evinfra.engine_patch.wire import HostLayout

__all__ = ["CORRUPT_ENV", "armed", "zero_host_slots", "zero_kv_pools"]

log = logging.getLogger("evinfra.engine_patch")

CORRUPT_ENV = "EVINFRA_TEST_CORRUPT_KV"


def armed(what: str) -> bool:
    path = os.environ.get(CORRUPT_ENV)
    if not path:
        return False
    try:
        with open(path) as f:
            return f.read().strip() == what
    except OSError:
        return False


def zero_host_slots(layout: HostLayout, slots: Sequence[int]) -> None:
    """Zero every plane and layer of ``slots`` in the host buffer ``layout`` describes."""
    for kv in range(layout.planes):
        for layer in range(layout.layers):
            for s in slots:
                ctypes.memset(address(layout, kv, layer, int(s)), 0, layout.token_bytes)
    log.warning("%s: zeroed %d fetched host slots", CORRUPT_ENV, len(slots))


def zero_kv_pools(scheduler: Any) -> None:
    """Zero the device KV pool and the host tier of ``scheduler``."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    n = 0
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        bufs = getattr(pool, name, None)
        for b in ([bufs] if hasattr(bufs, "zero_") else bufs or []):
            b.zero_()
            n += 1
    ctl = getattr(scheduler.tree_cache, "cache_controller", None)
    if ctl is not None:
        from evinfra.engine_patch.pool import kv_host_pool

        kv_host_pool(ctl.mem_pool_host).kv_buffer.zero_()
    log.warning("%s: zeroed %d device KV buffers and the host tier", CORRUPT_ENV, n)
