"""The evinfra engine patch: an SGLang plugin that makes an SGLang 0.5.23 engine symmetric
(paper 4.1, 4.2, 5.3): it switches phase in place and keeps its KV, evicts host memory in the
count-aware order, and shares its host tier with its peers. See ``README.md`` beside this file.

Only the pure modules (``wire``, ``layout``, ``eviction``, ``fetch_plan``, ``settings``) are
imported outside an engine; the others import SGLang and run inside the engine's processes.
"""

from evinfra.engine_patch.settings import ENABLE_ENV, PatchSettings, enabled

__all__ = ["ENABLE_ENV", "PatchSettings", "enabled"]
