"""What the patch reads from and does to SGLang's unified radix tree (engine process only).

SGLang 0.5.23's default tree is ``UnifiedRadixCache`` with a TreeCore that is either native
(Rust, the default) or Python (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``). The patch
runs on the Python TreeCore: its host eviction loop is Python code with a per-node key we can
extend (:mod:`~evinfra.engine_patch.eviction`), and its nodes can be walked to find the host
slots of a page. The Rust core runs host eviction natively, with no key to extend, so the
plugin selects the Python core when it is enabled. Both cores implement the same tree.

Every call into SGLang's tree internals is in this module, so a version bump is one file.
"""

from __future__ import annotations

from array import array
from typing import Any, NamedTuple, Sequence

import torch

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import compute_node_hash_values, hash_str_to_int64

__all__ = ["HostInsert", "can_republish", "host_slots_to", "host_tail", "insert_host_pages",
           "is_python_core", "load_done", "lock_device", "lock_host", "match", "matched_pages",
           "node_hashes", "republish", "start_load", "unlock_device", "unlock_host"]

FULL = 0  # ComponentType.FULL


def is_python_core(tree_cache: Any) -> bool:
    core = getattr(tree_cache, "tree_core", None)
    return core is not None and hasattr(core, "node_by_id") and hasattr(core, "root_node")


def radix_key(tokens: Sequence[int], req: Any = None) -> RadixKey:
    """The tree key of ``tokens`` (SGLang keys are ``array("q")``), in ``req``'s namespace."""
    ids = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    return RadixKey(token_ids=ids, extra_key=getattr(req, "extra_key", None),
                    cache_salt=getattr(req, "cache_salt", None))


def match(tree_cache: Any, tokens: Sequence[int], req: Any = None) -> Any:
    """``match_prefix`` of ``tokens`` (page-aligned by the tree), as the scheduler would."""
    return tree_cache.match_prefix(MatchPrefixParams(key=radix_key(tokens, req)))


def matched_pages(result: Any, page_size: int) -> int:
    """Pages of the match held on device or host."""
    return (result.device_prefix_len + result.host_hit_length) // page_size


def node_hashes(tree_core: Any, node: Any) -> list[int]:
    """The KV-event block hashes of ``node``'s pages (as SGLang publishes them)."""
    if node.key is None or len(node.key) == 0:
        return []
    values = node.hash_value
    if values is None:
        values = node.hash_value = compute_node_hash_values(node, tree_core.page_size)
    return [hash_str_to_int64(v) for v in values]


def host_slots_to(tree_core: Any, node_id: Any) -> torch.Tensor:
    """Host slots of the path root -> ``node_id``, up to the first node without a host copy
    (write-through keeps the host copies of a path a prefix of it)."""
    node = tree_core.node_by_id(node_id)
    path = []
    while node is not None and node is not tree_core.root_node:
        path.append(node)
        node = node.parent
    parts = []
    for n in reversed(path):
        hv = n.component_data[FULL].host_value
        if hv is None:
            break
        parts.append(hv.to("cpu", dtype=torch.int64))
    if not parts:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat(parts)


def host_tail(tree_core: Any, node_id: Any) -> Any:
    """The deepest node of the path to ``node_id`` that :func:`host_slots_to` covers (the node
    to pin so that every one of those slots stays)."""
    node = tree_core.node_by_id(node_id)
    path = []
    while node is not None and node is not tree_core.root_node:
        path.append(node)
        node = node.parent
    tail = None
    for n in reversed(path):
        if n.component_data[FULL].host_value is None:
            break
        tail = n
    return tail.id if tail is not None else None


class HostInsert(NamedTuple):
    inserted: int
    """Tokens that became new host copies in the tree."""
    duplicate: int
    """Leading tokens the tree already held on host (their fetched slots were freed)."""
    dropped: bool
    """SGLang refused the insert (its anchor has no host copy): all slots were freed."""


def insert_host_pages(tree_cache: Any, anchor_id: Any, tokens: Sequence[int],
                      host_indices: torch.Tensor, hash_strs: list[str], req: Any = None
                      ) -> HostInsert:
    """Insert pages that now sit in this engine's host memory under ``anchor_id``, as
    SGLang's own storage prefetch does (``_handle_prefetch_result``): the tree takes the slots
    it lacked, and what it already held is freed."""
    core = tree_cache.tree_core
    host = tree_cache.cache_controller.mem_pool_host
    result = core.insert_host(anchor_id, radix_key(tokens, req), host_indices, hash_strs)
    tree_cache._apply_cache_actions(result.cache_actions)
    if result.host_insert_dropped:
        host.free(host_indices)
        return HostInsert(0, 0, True)
    if result.prefix_len:
        host.free(host_indices[: result.prefix_len])
    return HostInsert(len(tokens) - result.prefix_len, result.prefix_len, False)


def start_load(tree_cache: Any, node_id: Any) -> int:
    """Load the host-only part of the path to ``node_id`` into device memory now (H->D),
    instead of layer by layer in the prefill that will use it. Returns the tokens loaded
    (0: nothing to load, or no room)."""
    before = _device_tokens_to(tree_cache.tree_core, node_id)
    if not tree_cache.load_back(node_id, mem_quota=None, req=None):
        return 0
    tree_cache.ready_to_load_host_cache()
    return _device_tokens_to(tree_cache.tree_core, node_id) - before


def load_done(tree_cache: Any, node_id: Any) -> bool:
    """The load started for ``node_id`` has completed (SGLang reaped its ack)."""
    return node_id not in tree_cache.ongoing_load_back


def _device_tokens_to(tree_core: Any, node_id: Any) -> int:
    node = tree_core.node_by_id(node_id)
    n = 0
    while node is not None and node is not tree_core.root_node:
        if node.component_data[FULL].value is not None:
            n += len(node.key)
        node = node.parent
    return n


def lock_host(tree_cache: Any, node_id: Any) -> Any:
    """Pin the host copies of the path to ``node_id``; returns what :func:`unlock_host`
    needs."""
    return tree_cache.inc_host_lock_ref(node_id).to_dec_params()


def unlock_host(tree_cache: Any, node_id: Any, params: Any) -> None:
    tree_cache.dec_host_lock_ref(node_id, params)


def lock_device(tree_cache: Any, node_id: Any) -> Any:
    return tree_cache.inc_lock_ref(node_id).to_dec_params()


def unlock_device(tree_cache: Any, node_id: Any, params: Any) -> None:
    tree_cache.dec_lock_ref(node_id, params)


def can_republish(tree_cache: Any) -> bool:
    """The tree can be walked (Python TreeCore) and records KV events (``--kv-events-config``)."""
    return is_python_core(tree_cache) and \
        getattr(getattr(tree_cache.tree_core, "kv_events", None), "enabled", False)


def republish(tree_cache: Any) -> int:
    """Record the whole cache as KV events: ``AllBlocksCleared``, then every page held on
    device (``GPU``), then every completed host copy (``CPU``; a write-through still in flight
    publishes its store when SGLang acks it). Each pass walks the tree depth-first, parents
    before children, so a path is one coalesced ``BlockStored`` chain (SGLang's recorder joins
    a store to the previous one when it continues it). Returns the pages recorded."""
    core = tree_cache.tree_core
    kv = core.kv_events
    kv.record_all_cleared()
    pages = 0
    for medium in (StorageMedium.GPU, StorageMedium.CPU):
        stack = list(core.root_node.children.values())
        while stack:
            node = stack.pop()
            full = node.component_data[FULL]
            held = full.value is not None if medium is StorageMedium.GPU else (
                full.host_value is not None and node.write_through_pending_id is None)
            if held:
                kv.record_store(node, medium=medium)
                pages += len(node.key) // core.page_size
            stack.extend(node.children.values())
    return pages
