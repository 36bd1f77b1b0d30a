"""SGLang's host tier (HiCache L2) on a machine without CUDA.

Stock SGLang 0.5.23 cannot start ``--enable-hierarchical-cache`` on CPU:

* the host pool pins its buffer with ``cudaHostRegister`` (``pool_host/common.py``
  ``_cuda_host_register``), which needs a CUDA runtime;
* the host<->device copies are ``sgl_kernel.kvcacheio`` kernels (the ``kernel`` io backend)
  or, for the ``direct`` backend, functions ``pool_host/mha.py`` imports only on CUDA, ROCm
  and XPU.

With the patch, on a machine where ``torch.cuda.is_available()`` is false (and only there):
registration is skipped (CPU memory needs no pinning to be copied from), and the MHA host
pool's two copy methods are plain ``torch`` indexing on the ``direct`` backend's layouts
(``layer_first`` and ``page_first_direct``). Everything else of HiCache (the controller, its
streams and events: ``torch.cpu`` has both) runs unchanged. On a GPU each hook calls SGLang's
original: behaviour there is untouched.

Launch on CPU with ``--enable-hierarchical-cache --hicache-io-backend direct
--hicache-mem-layout layer_first``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["backup_from_device_all_layer", "cuda_host_register", "load_to_device_per_layer",
           "on_cpu"]


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def cuda_host_register(original: Callable, buffer: torch.Tensor, *args, **kwargs) -> Any:
    """AROUND ``pool_host.common._cuda_host_register``: nothing to pin without CUDA."""
    if on_cpu():
        return None
    return original(buffer, *args, **kwargs)


def _host_rows(pool: Any, layer: int, kv: int, host_indices: torch.Tensor) -> tuple:
    """Index into the host buffer for the rows of ``host_indices`` of one layer."""
    buf = pool.k_buffer if kv == 0 else pool.v_buffer
    if pool.layout == "layer_first":
        return buf[layer], host_indices
    if pool.layout == "page_first_direct":
        # [pages, layers, page, heads, dim] -> rows of one layer by (page, offset)
        P = pool.page_size
        return buf[:, layer], (host_indices // P, host_indices % P)
    raise ValueError(f"host layout {pool.layout!r} has no CPU copy path; use layer_first or "
                     "page_first_direct")


def load_to_device_per_layer(original: Callable, self: Any, device_pool: Any,
                             host_indices: torch.Tensor, device_indices: torch.Tensor,
                             layer_id: int, io_backend: str, *, is_draft: bool = False) -> Any:
    """AROUND ``MHATokenToKVPoolHost.load_to_device_per_layer`` (H->D, one layer)."""
    if not on_cpu():
        return original(self, device_pool, host_indices, device_indices, layer_id, io_backend,
                        is_draft=is_draft)
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return None
    hi = host_indices.to("cpu", dtype=torch.int64)
    di = device_indices.to("cpu", dtype=torch.int64)
    for kv, dev in ((0, self.device_k_buffers[layer_id]), (1, self.device_v_buffers[layer_id])):
        src, idx = _host_rows(self, layer_id, kv, hi)
        dev[di] = src[idx].to(dev.dtype)
    return None


def backup_from_device_all_layer(original: Callable, self: Any, device_pool: Any,
                                 host_indices: torch.Tensor, device_indices: torch.Tensor,
                                 io_backend: str) -> Any:
    """AROUND ``MHATokenToKVPoolHost.backup_from_device_all_layer`` (D->H, every layer)."""
    if not on_cpu():
        return original(self, device_pool, host_indices, device_indices, io_backend)
    hi = host_indices.to("cpu", dtype=torch.int64)
    di = device_indices.to("cpu", dtype=torch.int64)
    for layer in range(self.layer_num):
        for kv, dev in ((0, self.device_k_buffers[layer]), (1, self.device_v_buffers[layer])):
            dst, idx = _host_rows(self, layer, kv, hi)
            dst[idx] = dev[di].to(dst.dtype)
    return None
