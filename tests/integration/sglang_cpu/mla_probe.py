"""The shared pool's addressing and copy against SGLang's real MLA host pool
(``MLATokenToKVPoolHost``), for ``test_engine_patch_mla.py`` (run with the SGLang venv's
interpreter; prints one JSON line).

For each host layout: two real MLA host pools (a peer's and this engine's, of different sizes)
built from CPU "device" buffers as SGLang's assembler builds them; ``pool.host_layout_of`` must
give, for every (layer, slot), the byte address of SGLang's own ``kv_buffer`` element; then the
peer's random pages are copied into local slots by exactly the chunks a fetch hands Mooncake
(``layout.transfer_chunks``; ``memmove`` stands in for ``batch_transfer_sync_read``, which
copies those (local, remote, length) triplets) and each page is compared with SGLang's own
``get_data_page``. Controls that must differ: the chunks an MHA (two-plane) reading of the
same buffers would give, and the copied pages zeroed by the patch's fault switch.
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch

from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from evinfra.engine_patch import faults
from evinfra.engine_patch.layout import address, host_layout, transfer_chunks
from evinfra.engine_patch.pool import host_layout_of

L, P, RANK, ROPE = 3, 4, 32, 8  # layers, page size, kv_lora_rank, qk_rope_head_dim
DIM = RANK + ROPE


def mla_host_pool(layout: str, device_tokens: int) -> MLATokenToKVPoolHost:
    bufs = tuple(torch.zeros(device_tokens + P, 1, DIM, dtype=torch.bfloat16) for _ in range(L))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                         layer_indices=tuple(range(L)), device_layer_num=L, page_size=P,
                         kv_lora_rank=RANK, qk_rope_head_dim=ROPE, kv_cache_dim=DIM,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=device_tokens, start_layer=0,
                                end_layer=L, target_layer_num=L)


def element_address(pool: MLATokenToKVPoolHost, layer: int, slot: int) -> int:
    buf = pool.kv_buffer
    if pool.layout == "layer_first":
        return buf[layer, slot].data_ptr()
    if pool.layout == "page_first":
        return buf[slot, layer].data_ptr()
    return buf[slot // P, layer, slot % P].data_ptr()


def copy(chunks) -> None:
    for la, ra, n in zip(*chunks):
        ctypes.memmove(la, ra, n)


def same_pages(dst, src, local, remote) -> bool:
    """Every copied page equal, as SGLang's own ``get_data_page`` reads them."""
    return all(torch.equal(dst.get_data_page(lp), src.get_data_page(rp))
               for lp, rp in zip(local[::P], remote[::P]))


def main() -> None:
    out = {}
    gen = torch.Generator().manual_seed(7)
    for name in ("layer_first", "page_first", "page_first_direct"):
        peer, mine = mla_host_pool(name, 64), mla_host_pool(name, 48)
        lp, lm = host_layout_of(peer), host_layout_of(mine)
        addr_ok = all(address(lp, 0, layer, s) == element_address(peer, layer, s)
                      for layer in range(L) for s in range(0, peer.size, 3))
        peer.kv_buffer.copy_(torch.randn(peer.kv_buffer.shape, generator=gen))
        remote = [s for page in (5, 6, 7, 20, 2) for s in range(page * P, page * P + P)]
        local = [s for page in (1, 2, 3, 9, 10) for s in range(page * P, page * P + P)]
        chunks = transfer_chunks(lm, lp, local, remote)
        copy(chunks)
        equal = same_pages(mine, peer, local, remote)
        # Control 1: the same buffers read as an MHA pool (two planes) copy other bytes.
        mine.kv_buffer.zero_()
        as_mha = [host_layout(name, x.base, x.slots, L, x.token_bytes // 2, P, 2)
                  for x in (lm, lp)]
        copy(transfer_chunks(as_mha[0], as_mha[1], local, remote))
        mha_equal = same_pages(mine, peer, local, remote)
        # Control 2: the right copy, then the fault switch zeroes the copied slots.
        copy(chunks)
        faults.zero_host_slots(lm, local)
        zeroed_equal = same_pages(mine, peer, local, remote)
        out[name] = {"planes": lm.planes, "token_bytes": lm.token_bytes, "chunks": len(chunks[0]),
                     "addresses_match": addr_ok, "copied_pages_equal": equal,
                     "mha_reading_equal": mha_equal, "zeroed_equal": zeroed_equal}
    print("PROBE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
