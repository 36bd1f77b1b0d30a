"""Host KV addresses: which bytes of a peer's host buffer hold a page, and how to read them in
as few transfers as possible (pure; numpy only).

An engine's host tier is one buffer (SGLang ``HostKVCache.kv_buffer``) registered with the
Mooncake transfer engine. :func:`host_layout` describes it as strides
(:class:`~evinfra.engine_patch.wire.HostLayout`); :func:`transfer_chunks` turns "read these
remote slots into these local slots" into ``(local address, remote address, length)``
chunks for ``batch_transfer_sync_read``, merging what is contiguous on both sides:

* ``layer_first`` (and ``page_first_direct`` within a page): a slot run is contiguous per
  (K/V, layer): ``2 * layers`` chunks per run;
* ``page_first``: a slot run is contiguous across layers: 2 chunks per run;
* anything else: one chunk per (K/V, layer, slot).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from evinfra.engine_patch.wire import HostLayout

__all__ = ["LAYOUTS", "host_layout", "slot_runs", "transfer_chunks"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def host_layout(name: str, base: int, slots: int, layers: int, token_bytes: int,
                page_size: int, planes: int = 2) -> HostLayout:
    """The strides of SGLang's host layout ``name`` for a buffer of ``slots`` token slots.

    Dims (SGLang ``MHATokenToKVPoolHost.init_kv_buffer``, ``planes`` = 2): ``layer_first`` is
    ``[2, layers, slots, heads, dim]``, ``page_first`` ``[2, slots, layers, heads, dim]``,
    ``page_first_direct`` ``[2, slots / page, layers, page, heads, dim]``. An MLA host pool
    (``MLATokenToKVPoolHost``, ``planes`` = 1) has the same dims without the leading 2 (and
    with ``heads`` = 1, ``dim`` = the latent plus the rope part).
    """
    tb, L, P = token_bytes, layers, page_size
    if planes not in (1, 2):
        raise ValueError(f"{planes} KV planes: 2 (MHA: K and V) or 1 (MLA)")
    if slots % P:
        raise ValueError(f"host slots ({slots}) must be a multiple of the page size ({P})")
    if name == "layer_first":
        return HostLayout(name, base, kv_stride=L * slots * tb, layer_stride=slots * tb,
                          page_stride=P * tb, slot_stride=tb, token_bytes=tb, layers=L,
                          page_size=P, slots=slots, planes=planes)
    if name == "page_first":
        return HostLayout(name, base, kv_stride=slots * L * tb, layer_stride=tb,
                          page_stride=P * L * tb, slot_stride=L * tb, token_bytes=tb,
                          layers=L, page_size=P, slots=slots, planes=planes)
    if name == "page_first_direct":
        return HostLayout(name, base, kv_stride=slots * L * tb, layer_stride=P * tb,
                          page_stride=L * P * tb, slot_stride=tb, token_bytes=tb, layers=L,
                          page_size=P, slots=slots, planes=planes)
    raise ValueError(f"host layout {name!r} is not supported by the shared pool "
                     f"(supported: {', '.join(LAYOUTS)})")


def address(layout: HostLayout, kv: int, layer: int, slot: int) -> int:
    P = layout.page_size
    return (layout.base + kv * layout.kv_stride + layer * layout.layer_stride
            + (slot // P) * layout.page_stride + (slot % P) * layout.slot_stride)


def slot_runs(local: np.ndarray, remote: np.ndarray, page_size: int, split_pages: bool
              ) -> list[tuple[int, int, int]]:
    """``(local start, remote start, length)`` runs where both slot lists go up by one;
    with ``split_pages`` a run also ends at every page boundary of either side."""
    local = np.asarray(local, dtype=np.int64)
    remote = np.asarray(remote, dtype=np.int64)
    if local.shape != remote.shape:
        raise ValueError(f"{local.size} local slots for {remote.size} remote slots")
    n = local.size
    if n == 0:
        return []
    brk = (np.diff(local) != 1) | (np.diff(remote) != 1)
    if split_pages:
        brk |= (local[1:] % page_size == 0) | (remote[1:] % page_size == 0)
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    ends = np.concatenate((starts[1:], [n]))
    return [(int(local[s]), int(remote[s]), int(e - s)) for s, e in zip(starts, ends)]


def transfer_chunks(local: HostLayout, remote: HostLayout, local_slots: Sequence[int],
                    remote_slots: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Chunks that copy ``remote_slots`` of ``remote`` into ``local_slots`` of ``local``."""
    if not _same_shape(local, remote):
        raise ValueError(f"host KV geometry differs: local {local.geometry()}, "
                         f"remote {remote.geometry()}")
    lay = local
    contiguous_pages = all(x.page_stride == x.page_size * x.slot_stride for x in (local, remote))
    runs = slot_runs(np.asarray(local_slots), np.asarray(remote_slots), lay.page_size,
                     split_pages=not contiguous_pages)
    la: list[int] = []
    ra: list[int] = []
    ln: list[int] = []
    tb, L = lay.token_bytes, lay.layers
    per_layer = all(x.slot_stride == tb for x in (local, remote))
    all_layers = all(x.layer_stride == tb and x.slot_stride == L * tb for x in (local, remote))
    for ls, rs, n in runs:
        for kv in range(lay.planes):
            if all_layers:
                la.append(address(local, kv, 0, ls))
                ra.append(address(remote, kv, 0, rs))
                ln.append(n * L * tb)
            elif per_layer:
                for layer in range(L):
                    la.append(address(local, kv, layer, ls))
                    ra.append(address(remote, kv, layer, rs))
                    ln.append(n * tb)
            else:
                for layer in range(L):
                    for i in range(n):
                        la.append(address(local, kv, layer, ls + i))
                        ra.append(address(remote, kv, layer, rs + i))
                        ln.append(tb)
    return la, ra, ln


def _same_shape(a: HostLayout, b: HostLayout) -> bool:
    """Same layout and token geometry; the slot counts may differ (engines given different
    host-tier sizes still exchange pages: each side's strides are its own)."""
    return a.geometry() == b.geometry()
