"""The shared host-memory KV pool: this engine's host tier, readable by every peer (paper 4.2).

Each patched engine registers its HiCache host buffer with the Mooncake transfer engine (the
one SGLang's PD transfer already runs, or a new one) and runs a small **pool server**: a ZMQ
ROUTER on ``EVINFRA_POOL_HOST:PORT``, advertised in ``/server_info`` (``evinfra_engine_patch.
pool``). A peer that wants some of its pages sends a :class:`~evinfra.engine_patch.wire.
LeaseRequest` (the tokens up to the last page, the page range); the server

1. matches the tokens in its radix tree **on the scheduler thread** (the tree is not
   thread-safe; the socket thread only queues messages), takes the host slots of the asked
   pages that are in host memory (a leading run of them), and pins them with a host lock so
   they are not evicted while being read;
2. answers with the slots, its :class:`~evinfra.engine_patch.wire.HostLayout` and its Mooncake
   session; the peer reads the bytes itself (one-sided ``batch_transfer_sync_read``: the
   pages go from this engine's host memory straight into the peer's, with no copy through a
   store, unlike SGLang's Mooncake-store L3, paper A.2);
3. unpins on :class:`~evinfra.engine_patch.wire.Release`, or when the lease's TTL runs out.

The server runs in either role: a decode engine's host tier is as readable as a prefill's,
and stays so across a switch (the buffer is never re-registered). Only host copies are
served (write-through gives every cached page one shortly after it is computed).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from evinfra.core.hashing import block_hashes
from evinfra.engine_patch import tree_ops
from evinfra.engine_patch.layout import host_layout
from evinfra.engine_patch.wire import (HostLayout, LeaseReply, LeaseRequest, Release,
                                       pool_decoder, pool_encoder)

__all__ = ["PoolServer", "host_layout_of", "kv_host_pool", "transfer_engine"]

log = logging.getLogger("evinfra.engine_patch.pool")


def kv_host_pool(host_pool: Any) -> Any:
    """The KV pool itself: SGLang wraps it in a ``HostPoolGroup`` (one entry for a plain
    full-attention model; hybrid models add SWA / Mamba pools, which the pool does not
    serve)."""
    entries = getattr(host_pool, "entries", None)
    if entries is None:
        return host_pool
    if len(entries) != 1:
        raise ValueError(f"host pool group of {len(entries)} pools "
                         f"({[e.name for e in entries]}): the shared pool serves full "
                         "attention KV only")
    return host_pool.anchor_entry.host_pool


def host_layout_of(host_pool: Any) -> HostLayout:
    """The :class:`HostLayout` of SGLang's MHA host pool (a K and a V plane) or MLA host pool
    (``MLATokenToKVPoolHost``: one latent row per token and layer). Hybrid groups, FP8/FP4
    packed MLA rows and layouts other than :data:`~evinfra.engine_patch.layout.LAYOUTS`
    raise."""
    host_pool = kv_host_pool(host_pool)
    buf = host_pool.kv_buffer
    if buf is None:
        raise ValueError(f"{type(host_pool).__name__}: no host buffer (allocator-only pool)")
    if hasattr(host_pool, "kv_lora_rank"):  # MLA
        if getattr(host_pool, "dsa_kv_cache_store_fp8", False) or \
                getattr(host_pool, "_native_buffers", None) is not None:
            raise ValueError("packed or split MLA host rows are not served by the shared pool")
        token_bytes = host_pool.kv_cache_dim * host_pool.dtype.itemsize
        planes = 1
    elif hasattr(host_pool, "head_num") and buf.dim() >= 2 and buf.shape[0] == 2:
        token_bytes = host_pool.head_num * host_pool.head_dim * host_pool.dtype.itemsize
        planes = 2
    else:
        raise ValueError(f"{type(host_pool).__name__}: the shared pool serves MHA and MLA "
                         "host pools only")
    if buf.numel() * buf.element_size() != planes * host_pool.layer_num * host_pool.size * \
            token_bytes:
        raise ValueError(f"{type(host_pool).__name__}: host buffer of {tuple(buf.shape)} is "
                         "not the layout the pool addresses")
    return host_layout(host_pool.layout, buf.data_ptr(), host_pool.size, host_pool.layer_num,
                       token_bytes, host_pool.page_size, planes)


def transfer_engine() -> Any:
    """SGLang's shared Mooncake transfer engine (PD with the mooncake backend starts it), or
    a new one registered as the shared engine."""
    from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as mte
    from sglang.srt.utils.network import get_local_ip_auto

    engine = mte.get_mooncake_transfer_engine()
    if engine is None:
        engine = mte.init_mooncake_transfer_engine(hostname=get_local_ip_auto())
    return engine


class _Lease:
    __slots__ = ("node", "params", "expires", "pages")

    def __init__(self, node: Any, params: Any, expires: float, pages: int) -> None:
        self.node = node
        self.params = params
        self.expires = expires
        self.pages = pages


class PoolServer:
    """Leases this engine's host pages to peers."""

    def __init__(self, tree_cache: Any, engine: Any, bind_host: str, advertise_host: str,
                 port: int = 0) -> None:
        self.tree_cache = tree_cache
        self.page_size = tree_cache.page_size
        host_pool = kv_host_pool(tree_cache.cache_controller.mem_pool_host)
        self.layout = host_layout_of(host_pool)
        self.engine = engine
        self.session = engine.get_session_id()
        buf = host_pool.kv_buffer
        engine.register(buf.data_ptr(), buf.numel() * buf.element_size())
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"{advertise_host}:{port}"
        # The socket thread owns the ROUTER; the scheduler thread answers through the queue
        # and wakes it over an inproc pair.
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        wake = f"inproc://evinfra-pool-wake-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake)
        self._leases: dict[int, _Lease] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self.stats = {"leases": 0, "pages_leased": 0, "refused": 0, "released": 0,
                      "expired": 0, "bad_messages": 0}
        self._thread = threading.Thread(target=self._run, name="evinfra-pool", daemon=True)
        self._thread.start()
        log.info("evinfra pool server at %s (mooncake session %s, host layout %s, %d slots)",
                 self.address, self.session, self.layout.name, self.layout.slots)

    # -- socket thread ------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(500))
            if self._wake_rx in events:
                while True:
                    try:
                        self._wake_rx.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while True:
                try:
                    ident, payload = self._outbox.get_nowait()
                except queue.Empty:
                    break
                self._sock.send_multipart([ident, b"", payload])
            if self._sock in events:
                while True:
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._inbox.put((frames[0], frames[-1]))

    def close(self) -> None:
        self._stop.set()

    # -- scheduler thread ---------------------------------------------------------------

    def serve(self) -> None:
        """Answer what peers asked since the last call, and end expired leases."""
        answered = False
        while True:
            try:
                ident, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                msg = pool_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.stats["bad_messages"] += 1
                reply = LeaseReply(False, reason=f"bad message: {exc}")
            else:
                if isinstance(msg, LeaseRequest):
                    reply = self._lease(msg)
                elif isinstance(msg, Release):
                    self._release(msg.lease)
                    continue
                else:
                    reply = LeaseReply(False, reason="unexpected message")
            self._outbox.put((ident, pool_encoder.encode(reply)))
            answered = True
        if answered:
            self._wake_tx.send(b"")
        if self._leases:
            now = time.monotonic()
            for lid in [k for k, v in self._leases.items() if v.expires < now]:
                self.stats["expired"] += 1
                self._release(lid)

    def _lease(self, req: LeaseRequest) -> LeaseReply:
        P = self.page_size
        if req.end_page <= req.start_page or len(req.tokens) < req.end_page * P:
            self.stats["refused"] += 1
            return LeaseReply(False, reason="bad page range")
        tokens = req.tokens[: req.end_page * P]
        if req.hashes:
            want = block_hashes(tokens, P)[req.start_page: req.end_page]
            if list(req.hashes) != want:
                self.stats["refused"] += 1
                return LeaseReply(False, reason="block hashes do not match the tokens")
        tc = self.tree_cache
        result = tree_ops.match(tc, tokens)
        if result.best_match_node is None:
            return LeaseReply(True, session=self.session, layout=self.layout)
        slots = tree_ops.host_slots_to(tc.tree_core, result.best_match_node)
        pages = min(len(slots) // P, req.end_page) - req.start_page
        if pages <= 0:
            return LeaseReply(True, session=self.session, layout=self.layout)
        # Pin the deepest node whose host copy we hand out (and so its ancestors).
        node = tree_ops.host_tail(tc.tree_core, result.best_match_node)
        params = tree_ops.lock_host(tc, node)
        lid = next(self._ids)
        self._leases[lid] = _Lease(node, params, time.monotonic() + req.ttl_s, pages)
        self.stats["leases"] += 1
        self.stats["pages_leased"] += pages
        chosen = slots[req.start_page * P: (req.start_page + pages) * P]
        return LeaseReply(True, lease=lid, session=self.session, layout=self.layout,
                          pages=pages, slots=chosen.tolist())

    def _release(self, lid: int) -> None:
        lease = self._leases.pop(lid, None)
        if lease is None:
            return
        self.stats["released"] += 1
        tree_ops.unlock_host(self.tree_cache, lease.node, lease.params)

    def status(self) -> dict:
        return {"address": self.address, "session": self.session,
                "layout": msgspec.to_builtins(self.layout), "open_leases": len(self._leases),
                **self.stats}
