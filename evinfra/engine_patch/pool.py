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
2. answers with the slots and, per TP rank, a :class:`~evinfra.engine_patch.wire.Shard`
   (its Mooncake session and :class:`~evinfra.engine_patch.wire.HostLayout`); each rank of
   the peer reads its own shard itself (one-sided ``batch_transfer_sync_read``: the pages go
   from this engine's host memory straight into the peer's, with no copy through a store,
   unlike SGLang's Mooncake-store L3, paper A.2);
3. unpins once every rank of the reader sent its :class:`~evinfra.engine_patch.wire.Release`,
   or when the lease's TTL runs out.

**Tensor parallelism.** Each rank's host pool holds its own KV heads of every token (an MLA
latent is replicated: each rank holds all of it, and each reading rank reads its own replica
of it, so an MLA fetch moves tp copies of the same bytes). SGLang keeps the ranks' radix trees
in step (same inputs each iteration, same slots for the same tokens), and a lease must keep
them so: a pin on rank 0 alone would change what rank 0's host eviction may take. So only rank
0 has the socket, and it hands every message, and every lease expiry it decides on its own
clock, to SGLang's input broadcast (a hook on the scheduler's ``_poll_timeout_aborts``, whose
aborts ride that broadcast for the same reason): every rank pins, answers and unpins in the
same iteration, and rank 0 replies. The reading engine's ranks ask with one ``key`` and get
one lease; a reader of another tp is refused (rank i reads shard i).

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
from typing import Any, Callable

import msgspec
import zmq

from evinfra.core.hashing import block_hashes
from evinfra.engine_patch import tree_ops
from evinfra.engine_patch.layout import host_layout
from evinfra.engine_patch.ranks import gather, rank_in
from evinfra.engine_patch.wire import (HostLayout, LeaseReply, LeaseRequest, Release, Shard,
                                       pool_decoder, pool_encoder)

__all__ = ["POOL_METHOD", "PoolServer", "host_layout_of", "kv_host_pool", "transfer_engine"]

POOL_METHOD = "evinfra_pool"
"""The ``RpcReqInput`` method that carries a peer's pool message to every rank."""

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
    __slots__ = ("node", "params", "expires", "reply", "key", "ranks", "released",
                 "expiring")

    def __init__(self, node: Any, params: Any, expires: float, reply: LeaseReply, key: str,
                 ranks: int) -> None:
        self.node = node
        self.params = params
        self.expires = expires  # rank 0's clock: rank 0 decides expiries for every rank
        self.reply = reply
        self.key = key
        self.ranks = ranks  # the releases that end it: one per rank of the reading engine
        self.released = 0
        self.expiring = False


class PoolServer:
    """Leases this engine's host pages to peers. With TP every rank registers its own shard
    of the host pool (its KV heads; an MLA latent is whole on every rank) with its own
    Mooncake engine; rank 0 alone has the socket, and hands what peers send to every rank
    through SGLang's input broadcast (:meth:`take_messages`), so that all ranks pin and
    unpin the same pages in the same iteration (their radix trees stay in step)."""

    def __init__(self, tree_cache: Any, open_engine: Callable[[], tuple[Any, str, str]],
                 port: int = 0, group: Any = None) -> None:
        """``open_engine()``: the Mooncake transfer engine, and the hosts the pool binds and
        advertises. Every rank of ``group`` builds its part, then they compare: if one rank
        failed, all raise (no rank serves, or waits for, a shard that is not there)."""
        self.tree_cache = tree_cache
        self.page_size = tree_cache.page_size
        self.rank = rank_in(group)
        self.address: str | None = None
        self._stop = threading.Event()
        try:
            self.engine, bind_host, advertise_host = open_engine()
            host_pool = kv_host_pool(tree_cache.cache_controller.mem_pool_host)
            self.layout = host_layout_of(host_pool)
            buf = host_pool.kv_buffer
            self.engine.register(buf.data_ptr(), buf.numel() * buf.element_size())
            if self.rank == 0:
                self._open_socket(bind_host, advertise_host, port)
            own: Any = msgspec.to_builtins(Shard(self.engine.get_session_id(), self.layout))
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it (below)
            own = f"{type(exc).__name__}: {exc}"
        shards = gather(own, group)
        failed = [f"rank {i}: {x}" for i, x in enumerate(shards) if isinstance(x, str)]
        if failed:
            self.close()
            raise RuntimeError("; ".join(failed))
        self.shards = [msgspec.convert(x, Shard) for x in shards]
        self._leases: dict[int, _Lease] = {}
        self._keys: dict[str, int] = {}
        self._ids = itertools.count(1)
        self.stats = {"leases": 0, "pages_leased": 0, "refused": 0, "released": 0,
                      "expired": 0, "bad_messages": 0}
        if self.rank != 0:
            log.info("evinfra pool shard of TP rank %d (mooncake session %s, host layout %s, "
                     "%d slots)", self.rank, self.shards[self.rank].session, self.layout.name,
                     self.layout.slots)
            return
        self._thread = threading.Thread(target=self._run, name="evinfra-pool", daemon=True)
        self._thread.start()
        log.info("evinfra pool server at %s (%d shard(s), mooncake sessions %s, host layout "
                 "%s, %d slots)", self.address, len(self.shards),
                 [x.session for x in self.shards], self.layout.name, self.layout.slots)

    def _open_socket(self, bind_host: str, advertise_host: str, port: int) -> None:
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

    # -- socket thread (rank 0) ---------------------------------------------------------

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
        if getattr(self, "_sock", None) is not None:
            self._sock.close(linger=0)

    # -- scheduler thread ---------------------------------------------------------------

    def take_messages(self) -> list[dict]:
        """Rank 0, as its scheduler gathers its inputs: what peers sent since, and the
        leases whose time ran out, each as the parameters of one message that SGLang hands
        to every rank in the same iteration (:meth:`on_message`)."""
        if self.rank != 0:
            return []
        out: list[dict] = []
        while True:
            try:
                ident, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            out.append({"ident": ident.hex(), "payload": payload.hex()})
        if self._leases:
            now = time.monotonic()
            for lid, lease in self._leases.items():
                if lease.expires < now and not lease.expiring:
                    lease.expiring = True
                    out.append({"expire": lid})
        return out

    def on_message(self, params: dict) -> None:
        """Every rank, in the same iteration: one message of :meth:`take_messages`. Rank 0
        answers the peer."""
        if "expire" in params:
            if params["expire"] in self._leases:
                self.stats["expired"] += 1
                self._end(params["expire"])
            return
        try:
            msg = pool_decoder.decode(bytes.fromhex(params["payload"]))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.stats["bad_messages"] += 1
            reply = LeaseReply(False, reason=f"bad message: {exc}")
        else:
            if isinstance(msg, LeaseRequest):
                reply = self._lease(msg)
            elif isinstance(msg, Release):
                self._release(msg.lease)
                return
            else:
                reply = LeaseReply(False, reason="unexpected message")
        if self.rank == 0:
            self._outbox.put((bytes.fromhex(params["ident"]), pool_encoder.encode(reply)))
            self._wake_tx.send(b"")

    def _lease(self, req: LeaseRequest) -> LeaseReply:
        P = self.page_size
        if req.ranks != len(self.shards):
            self.stats["refused"] += 1
            return LeaseReply(False, reason=(
                f"this engine serves {len(self.shards)} TP shard(s), the asking engine has "
                f"tp={req.ranks}: rank i reads shard i, so both need the same tp"))
        if req.end_page <= req.start_page or len(req.tokens) < req.end_page * P:
            self.stats["refused"] += 1
            return LeaseReply(False, reason="bad page range")
        if req.key and req.key in self._keys:  # another rank of the same reader
            return self._leases[self._keys[req.key]].reply
        tokens = req.tokens[: req.end_page * P]
        if req.hashes:
            want = block_hashes(tokens, P)[req.start_page: req.end_page]
            if list(req.hashes) != want:
                self.stats["refused"] += 1
                return LeaseReply(False, reason="block hashes do not match the tokens")
        tc = self.tree_cache
        none = LeaseReply(True, shards=self.shards)
        result = tree_ops.match(tc, tokens)
        if result.best_match_node is None:
            return none
        slots = tree_ops.host_slots_to(tc.tree_core, result.best_match_node)
        pages = min(len(slots) // P, req.end_page) - req.start_page
        if pages <= 0:
            return none
        # Pin the deepest node whose host copy we hand out (and so its ancestors).
        node = tree_ops.host_tail(tc.tree_core, result.best_match_node)
        params = tree_ops.lock_host(tc, node)
        lid = next(self._ids)
        chosen = slots[req.start_page * P: (req.start_page + pages) * P]
        reply = LeaseReply(True, lease=lid, shards=self.shards, pages=pages,
                           slots=chosen.tolist())
        self._leases[lid] = _Lease(node, params, time.monotonic() + req.ttl_s, reply, req.key,
                                   req.ranks)
        if req.key:
            self._keys[req.key] = lid
        self.stats["leases"] += 1
        self.stats["pages_leased"] += pages
        return reply

    def _release(self, lid: int) -> None:
        lease = self._leases.get(lid)
        if lease is None:
            return
        lease.released += 1
        if lease.released >= lease.ranks:
            self.stats["released"] += 1
            self._end(lid)

    def _end(self, lid: int) -> None:
        lease = self._leases.pop(lid)
        if lease.key:
            self._keys.pop(lease.key, None)
        tree_ops.unlock_host(self.tree_cache, lease.node, lease.params)

    def status(self) -> dict:
        return {"address": self.address, "rank": self.rank,
                "shards": msgspec.to_builtins(self.shards),
                "open_leases": len(self._leases), **self.stats}
