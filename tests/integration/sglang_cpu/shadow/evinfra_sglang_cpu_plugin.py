"""SGLang general plugin (entry point group ``sglang.srt.plugins``) for PD pairs on CPU.

Mooncake's sender advertises ``supports_host_tensor_indices``; the prefill scheduler then
allocates its index tensors with ``pin_memory=True``, which CPU-only torch cannot do ("no
pinned memory allocator"). Turning the flag off makes the prefill side use plain tensors."""


def _no_host_tensor_indices(result, self, *args, **kwargs):
    self.supports_host_tensor_indices = False
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
        _no_host_tensor_indices, HookType.AFTER)
